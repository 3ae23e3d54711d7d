"""llama.cpp itself (llama-cpp-python 0.3.36) on our GGUF exports (issues 30 §3 and 31 §1, §5).

* It loads ours, and its logits on ours equal its logits on its own converter's file, bit for bit
  (PLaMo 2: on the converter's file with the one value we write differently, see below).
* PLaMo 3 passes against the reference under the window convention llama.cpp follows (vLLM's: W keys
  counting the query), and the figures show the other one (PFN's HF code) diverging at position W.
* PLaMo 2: what this llama.cpp does, measured.  The converter's own file has layer 0's head count 0,
  so llama.cpp's n_rot is 0 and this build never finishes a forward (a canary below keeps checking
  that); our target refuses it in one line naming n_rot instead of hanging.  Our export sets that head
  count: llama.cpp then matches the reference up to the sliding window it does not implement, and
  the verdict names the first divergent position, W + 1.
* A GGUF whose RoPE base is edited with the gguf package fails, the lint naming the key.
* Quantized exports state their measured KL; a bad recipe (an f32 file with ffn_down at q4_0) is
  flagged.

The verdict is `verify`'s (deploy/compare.py's thresholds by the file type the GGUF declares).

Seen failing: with ROPE_FIX removed (the PLaMo 2 export's verification refuses its own file: n_rot =
0, no position 13), with THRESHOLDS["float32"].kl_position at 1e-12 (PLaMo 3 f32 no longer passes),
with the window convention comparison reduced to the HF one (PLaMo 3 diverges at position W), with
the lint's rope base check dropped (the edited file's findings lack the key), with precision_of
mapping every file type to "quantized" (the f32 file with a q4_0 ffn_down passes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from llama_cpp_env import convert_with_llama_cpp, needs_converter, needs_llama

from plamo2_tools.deploy.gguf import GGUFTarget
from plamo2_tools.errors import CheckFailed
from plamo2_tools.export.gguf import export_gguf, side_file
from plamo2_tools.export.gguf_verify import verify_gguf

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow, needs_llama]


def _set_array(path: Path, key: str, index: int, value: float) -> None:
    """Edit one value of a GGUF key in place, the way gguf's own gguf_set_metadata.py does."""
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    field.parts[field.data[index]][0] = value
    del reader


def _logits(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    target = GGUFTarget(str(path), n_ctx=64)
    try:
        return [target.logits(s) for s in seqs]
    finally:
        target.close()


SEQS = [[1, 17, 230, 5, 99, 290, 7, 300, 12, 250, 33, 8, 111, 222, 3, 9, 60, 61, 62, 63]]  # < 333 (tiny3-yarn)


@needs_converter
@pytest.mark.parametrize(
    ("preset", "kind"), [("tiny3", "f32"), ("tiny3-yarn", "q8_0"), ("tiny", "f32"), ("tiny-2.1", "bf16")]
)
def test_llama_cpp_logits_on_ours_equal_its_own_file(checkpoint, tmp_path, preset: str, kind: str) -> None:
    src = checkpoint(preset)
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    convert_with_llama_cpp([(src, kind, theirs)])
    export_gguf(src, ours, kind, verify=False)
    if preset.startswith("tiny") and not preset.startswith("tiny3"):  # PLaMo 2: the one value we write differently
        heads = gguf.GGUFReader(str(ours)).fields["plamo2.attention.head_count"].contents()
        _set_array(theirs, "plamo2.attention.head_count", 0, heads[0])
    for a, b in zip(_logits(theirs, SEQS), _logits(ours, SEQS), strict=True):
        assert np.array_equal(a, b)


def test_plamo3_passes_under_the_convention_llama_cpp_follows(cli, checkpoint, tmp_path) -> None:
    out = tmp_path / "m.gguf"
    cli("export", "gguf", checkpoint("tiny3"), out, "--type", "f32")
    record = json.loads(side_file(out).read_text())
    v = record["verify"]
    assert v["verdict"] == "pass" and v["follows"] == "window_convention=vllm"
    assert v["max_kl"] < 1e-5
    assert v["precision"] == "float32" and v["judged_by"].startswith("deploy/compare.py")
    hf = v["conventions"]["window_convention=hf"]
    assert not hf["passed"] and hf["first_divergence"]["position"] == 5  # W = 5: the first query that sees W keys


def test_plamo2_diverges_where_llama_cpp_has_no_window(cli, checkpoint, tmp_path, one_line_error) -> None:
    """tiny: attention window W = 12.  With RoPE on (our head count), llama.cpp equals the reference
    until a query has more than W keys before it: position W + 1 = 13."""
    out = tmp_path / "m.gguf"
    r = cli("export", "gguf", checkpoint("tiny"), out, "--type", "f32", "--json", expect=1)
    line = one_line_error(r, 1)
    assert "position 13" in line and "no sliding window" in line
    v = json.loads(r.stdout)["verify"]
    assert v["verdict"] == "diverges" and v["first_divergence"]["position"] == 13
    assert out.is_file() and json.loads(side_file(out).read_text())["verify"]["verdict"] == "diverges"


@needs_converter
def test_the_converters_plamo2_file_is_refused_not_run(checkpoint, tmp_path) -> None:
    theirs = tmp_path / "theirs.gguf"
    convert_with_llama_cpp([(checkpoint("tiny"), "f32", theirs)])
    target = GGUFTarget(str(theirs), reference=checkpoint("tiny"), n_ctx=64)
    try:
        assert any(f.key == "plamo2.rope.dimension_count" for f in target.findings)
        with pytest.raises(CheckFailed, match="n_rot = 0"):
            target.score(SEQS)
    finally:
        target.close()


@needs_converter
def test_canary_llama_cpp_never_finishes_a_plamo2_forward_with_n_rot_0(checkpoint, tmp_path) -> None:
    """What the refusal above protects from, measured in a subprocess: the same file with layer 0's
    head count set finishes (the control), the converter's own does not finish in 60x that time.
    When a llama.cpp fixes this, this test fails: update NO_ROPE (deploy/gguf.py)."""
    theirs, fixed = tmp_path / "theirs.gguf", tmp_path / "fixed.gguf"
    convert_with_llama_cpp([(checkpoint("tiny"), "f32", theirs)])
    fixed.write_bytes(theirs.read_bytes())
    _set_array(fixed, "plamo2.attention.head_count", 0, 4)
    script = textwrap.dedent(f"""
        import os, threading, time, llama_cpp
        def run(path):
            llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=1)
            llm.eval({SEQS[0]!r})
        t0 = time.time(); run({str(fixed)!r}); control = time.time() - t0
        t = threading.Thread(target=run, args=({str(theirs)!r},), daemon=True); t0 = time.time(); t.start()
        t.join(max(10.0, 60 * control))
        print("finished" if not t.is_alive() else "running", round(control, 3), round(time.time() - t0, 1), flush=True)
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.stdout.startswith("running"), proc.stdout + proc.stderr[-500:]


def test_an_edited_rope_base_fails(checkpoint, tmp_path) -> None:
    src, out = checkpoint("tiny3"), tmp_path / "m.gguf"
    export_gguf(src, out, "f32", verify=False)
    _set_array(out, "plamo3.rope.freq_base", 0, 5000.0)
    v = verify_gguf(out, src, "f32")
    assert v["verdict"] == "diverges"
    assert any(f["key"] == "plamo3.rope.freq_base" for f in v["runtime"]["lint"])
    # tiny3's layer 1 is a full-attention layer: the base matters from the second position on
    assert v["first_divergence"]["position"] == 1


def test_quantized_exports_state_their_kl_and_a_bad_recipe_is_flagged(cli, checkpoint, tmp_path) -> None:
    out = tmp_path / "q8.gguf"
    r = cli("export", "gguf", checkpoint("tiny3"), out, "--type", "q8_0", "--json")
    v = json.loads(r.stdout)["verify"]
    assert v["verdict"] == "pass" and 0 < v["mean_kl"] <= v["max_kl"] < 1.5e-2
    assert v["precision"] == "quantized" and v["runtime"]["precision"] == "q8_0"
    assert json.loads(side_file(out).read_text())["verify"]["mean_kl"] == v["mean_kl"]
    bad = tmp_path / "bad.gguf"
    r = cli(
        "export",
        "gguf",
        checkpoint("tiny3"),
        bad,
        "--type",
        "f32",
        "--tensor-type",
        "ffn_down=q4_0",
        "--json",
        expect=1,
    )
    summary = json.loads(r.stdout)
    assert summary["tensor_types"] == ["ffn_down=q4_0"] and summary["verify"]["verdict"] == "diverges"
    assert summary["verify"]["precision"] == "float32"  # the file type the GGUF declares picks the thresholds


def test_the_target_scores_and_continues_like_the_reference(checkpoint, tmp_path) -> None:
    """GGUFTarget through the deploy.target protocol (Scores, Continuation) on a PLaMo 3 f32 export,
    against the float64 reference under the vllm window convention: teacher-forced log-probs of
    every next token, and 12 greedy tokens, which must be the reference's own greedy tokens.  Seen
    failing with `score` taking positions start+1..n-1 (one late)."""
    import torch

    from plamo2_tools.model.checkpoint import HFCheckpoint

    src, out = checkpoint("tiny3"), tmp_path / "m.gguf"
    export_gguf(src, out, "f32", verify=False)
    prompt = SEQS[0][:9]
    target = GGUFTarget(str(out), reference=src, n_ctx=64)
    try:
        (scores,) = target.score([SEQS[0]], start=2)
        (cont,) = target.greedy([prompt], 12)
        assert target.tokenize("hello") is not None
    finally:
        target.close()
    with HFCheckpoint(src) as ckpt:

        def ref(seq: list[int]) -> torch.Tensor:
            logits = ckpt.family.reference_logits(ckpt, [seq], torch.float64, window_convention="vllm")[0]
            return torch.log_softmax(logits.double(), dim=-1)

        lp = ref(SEQS[0])
        want = lp[2:-1].gather(1, torch.tensor(SEQS[0][3:])[:, None])[:, 0].numpy()
        assert scores.start == 2 and scores.logprobs.shape == (len(SEQS[0]) - 3, 700)
        np.testing.assert_allclose(scores.token_logprobs, want, atol=3e-3)  # llama.cpp float32: measured 9e-4
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(ref(seq)[-1].argmax()))
    assert cont.tokens == seq[len(prompt) :] and cont.finish_reason == "length"
    assert len(cont.token_logprobs) == 12 and cont.logprobs.shape == (12, 700)


def test_layer_types_without_a_period_are_written_per_layer(cli, checkpoint, private_copy, tmp_path) -> None:
    """A transformers-v5 PLaMo 3 config whose layer_types no sliding_window_pattern describes (and
    that has none: llama.cpp's converter fails on it): the export writes the per-layer flags, which
    llama.cpp reads first, and llama.cpp then matches the reference.  Seen failing with the default
    pattern (8) written instead: llama.cpp slides the wrong layers and diverges."""
    src = private_copy(checkpoint("tiny3-yarn"))
    config = json.loads((src / "config.json").read_text())
    config.pop("sliding_window_pattern", None)
    config["layer_types"] = [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    (src / "config.json").write_text(json.dumps(config))
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "m.gguf"
    r = cli("export", "gguf", src, out, "--type", "f32", "--json")
    assert json.loads(r.stdout)["verify"]["verdict"] == "pass"
    flags = gguf.GGUFReader(str(out)).fields["plamo3.attention.sliding_window_pattern"].contents()
    assert flags == [True, True, False, True, False]


def test_the_verify_command_judges_our_gguf(cli, checkpoint, tmp_path, one_line_error) -> None:
    """`plamo2-tools verify FILE.gguf --reference SRC`, the real command: main's dispatch opens the
    GGUF target, deploy/compare judges it by the thresholds of the file type the GGUF declares.  A
    PLaMo 3 f32 export passes following vLLM's window convention; the same file with its RoPE base
    edited fails (exit 1, one line) at position 1, the first that a rotation changes.  The report
    renders the export's own record.  Seen failing with precision_of answering "quantized" for
    every file type (the precision assert), with "gguf" dropped from target.TARGETS (KeyError,
    exit 70), and with the report's known-difference notes removed."""
    src, out = checkpoint("tiny3"), tmp_path / "m.gguf"
    cli("export", "gguf", src, out, "--type", "f32")
    r = cli("verify", out, "--reference", src, "--random", "2", "--max-new-tokens", "4", "--json")
    (t,) = json.loads(r.stdout)["targets"]
    assert t["kind"] == "gguf" and t["passed"] and t["precision"] == "float32"
    assert t["follows"] == ["window_convention=vllm"] and t["kl_kind"] == "full"
    assert t["info"]["precision"] == "float32" and t["tokenizer"]["checked"]
    _set_array(out, "plamo3.rope.freq_base", 0, 5000.0)
    r = cli("verify", out, "--reference", src, "--random", "2", "--max-new-tokens", "4", "--json", expect=1)
    line = one_line_error(r, 1)
    (t,) = json.loads(r.stdout)["targets"]
    assert not t["passed"]
    known = [d for d in t["info"]["known_differences"] if d["key"] == "plamo3.rope.freq_base"]
    assert known and "5000.0" in known[0]["text"]  # the lint names the edited key and both values
    (tmp_path / "v.json").write_text(r.stdout)
    cli("report", tmp_path / "v.json", "--out", tmp_path / "v.md")
    assert "known difference: queries and keys rotate with another RoPE base" in (tmp_path / "v.md").read_text()
    assert "diverges from the reference" in line and "position 1 " in line, line
    report = tmp_path / "r.md"
    cli("report", side_file(out), "--out", report)
    text = report.read_text()
    assert "export gguf, verified with llama.cpp" in text and "| passed | float32 | window_convention=vllm |" in text
