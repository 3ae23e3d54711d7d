"""`plamo2-tools verify TARGET...` on shard directories through the real CLI, the report section
of its result, and the refusals that come before any work.

How each test was seen failing (break, red, restore): the planted head swap with
`ShardsTarget.score` one row late (every position diverges, the good layout too); the report with
`report/verify.py` not dispatching the new kind (the table of targets is missing); the refusals
with `open_target` letting the ImportError through (a traceback, exit 70)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from report_helpers import assert_png, assert_tables_well_formed, image_links, table_rows

from plamo2_tools.kinds import VERIFY_TARGETS_KIND, VERIFY_TARGETS_SCHEMA_VERSION
from plamo2_tools.report import build_report
from plamo2_tools.safetensors_io import read_header


def _swap_q_heads(shards: Path, out: Path) -> Path:
    """A copy whose layer-1 attention has the q rows of heads 0 and 1 swapped, in place: same
    header and digests' shapes, wrong math."""
    shutil.copytree(shards, out)
    f = out / "model-rank-0-part-0.safetensors"
    info = read_header(f).tensors["model.layers.layers.1.mixer.qkv_proj.weight"]
    rows = 16 * info.row_bytes  # one head of d = 16 rows
    data = bytearray(f.read_bytes())
    a, b = info.offset, info.offset + rows
    data[a:b], data[b : b + rows] = data[b : b + rows], data[a:b]
    f.write_bytes(bytes(data))
    return out


def test_a_broken_layout_is_named_where_it_first_diverges_and_reported(cli, shards, checkpoint, tmp_path) -> None:
    """Two targets in one command: the good layout passes; the head-swapped one fails at prompt 0,
    position 1.  Position 0 cannot show it: a query with one key gets softmax weight 1 whatever q
    is, so swapping q heads changes nothing there, and everything after does.  The report renders
    both, with the failing row naming that position and a per-position plot per target."""
    good = shards("tiny-gqa", 1, 1, seed=11)
    broken = _swap_q_heads(good, tmp_path / "broken")
    out = tmp_path / "runs" / "verify.json"
    out.parent.mkdir()
    r = cli(
        "verify",
        good,
        broken,
        "--reference",
        checkpoint("tiny-gqa", seed=11),
        "--no-verify",
        "--random",
        "2",
        "--max-new-tokens",
        "4",
        "--json",
        "--output",
        out,
        expect=1,
    )
    result = json.loads(r.stdout)
    assert json.loads(out.read_text()) == result
    assert (result["kind"], result["schema_version"]) == (VERIFY_TARGETS_KIND, VERIFY_TARGETS_SCHEMA_VERSION)
    ok, bad = result["targets"]
    assert ok["passed"] and not bad["passed"]
    first = bad["first_divergence"]
    assert (first["prompt"], first["position"], first["phase"]) == (0, 1, "teacher-forced"), first
    tf = bad["conventions"]["default"]["positions"][0]
    assert tf["positions"][0] == 0 and tf["kl"][0] < 1e-9  # position 0 untouched, as argued above
    (line,) = r.stderr.strip().splitlines()  # --json: the verdict's line alone on stderr
    assert line.startswith(f"error: {broken} diverges from the reference at prompt 0, position 1 (teacher-forced)")

    report = build_report([out.parent], tmp_path / "rep" / "r.md", timestamp=False)
    md = report.out.read_text()
    assert_tables_well_formed(md)
    rows = table_rows(md)
    failing = next(row for row in rows if row[0] == f"`{broken}`")
    assert failing[-1] == "**FAIL**" and failing[-2].startswith("prompt 0, pos 1 (teacher-forced)")
    passing = next(row for row in rows if row[0] == f"`{good}`")
    assert passing[-1] == "pass" and passing[2] == "float32" and passing[3] == "full"
    assert len(image_links(md)) == 2 and len(report.plots) == 2
    for p in report.plots:
        assert_png(p)
    assert any("1 target(s) diverge" in w for w in report.warnings)


def test_the_report_survives_mangled_results(tmp_path: Path) -> None:
    """A result file edited by hand or cut short renders what it can: no crash, tables intact."""
    base = {"kind": VERIFY_TARGETS_KIND, "schema_version": VERIFY_TARGETS_SCHEMA_VERSION, "passed": False}
    odd_target = {
        "location": "a|b",
        "conventions": {
            "x": {
                "positions": [{"positions": [0, 1], "kl": ["inf", "x"], "logprob_diff": [None, 1e300], "prompt": "p"}],
                "first_divergence": {"position": "?"},
            },
            "y": 5,
        },
        "follows": "none",
        "tokenizer": [],
        "failures": ["bad\nline | here"],
    }
    for name, targets in {"a.json": [odd_target, 7, None], "b.json": [{}]}.items():
        (tmp_path / name).write_text(json.dumps({**base, "targets": targets}))
    report = build_report([tmp_path], tmp_path / "out" / "r.md", timestamp=False)
    assert report.skipped == [] and len(report.docs) == 2
    assert_tables_well_formed(report.out.read_text())


HAVE_GGUF_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("gguf", "llama_cpp"))


def test_targets_are_refused_before_any_work(cli, one_line_error, checkpoint, tmp_path: Path) -> None:
    ref = checkpoint("tiny", seed=11)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    mlx = tmp_path / "mlx"
    mlx.mkdir()
    (mlx / "config.json").write_text("{}")
    (mlx / "model.safetensors").write_bytes(b"")
    cases = [
        # without the [gguf] extra the target is refused for it; with it, llama.cpp is never started on this file
        ((gguf,), "not a readable GGUF file" if HAVE_GGUF_EXTRA else "verifying a gguf target needs"),
        # without the [mlx] extra the extra is named; with it, the empty config is refused (it once failed here
        # with "takes no option ...": verify's options reached MLXTarget)
        (
            (mlx,),
            "verifying a mlx target needs" if importlib.util.find_spec("mlx_lm") is None else "architectures None",
        ),
        ((tmp_path / "none.gguf",), "no such GGUF file"),
        ((tmp_path,), "neither a shard directory nor an MLX model directory"),
        ((ref, "--target-precision", "int3"), "--target-precision 'int3': one of auto, float32"),
        ((ref, "--prompts", gguf, "--gsm8k-like"), "--prompts and --gsm8k-like: give one"),
        (("http://127.0.0.1:1", "--timeout", "0"), "--timeout 0: must be > 0"),
    ]
    for args, words in cases:
        line = one_line_error(cli("verify", *args, "--reference", ref, expect=2), 2)
        assert words in line, (args, line)


def test_text_prompts_are_the_reference_tokenizers_and_it_is_loaded_once(
    shards, checkpoint, tmp_path, monkeypatch
) -> None:
    """A prompts file of text and the built-in GSM8K-like questions are tokenized by the reference's
    tokenizer, the same one that names tokens and checks parity: the reference's is loaded once per
    call.  Seen failing with `verify_prompts` loading its own (two loads)."""
    from plamo2_tools.deploy import verify as deploy_verify
    from plamo2_tools.deploy.prompts import GSM8K_LIKE
    from plamo2_tools.runtime.batching import engine

    src, layout = checkpoint("tiny", seed=5), shards("tiny", 1, 1, seed=5)
    text = tmp_path / "prompts.txt"
    text.write_text("The capital of Japan is\n" + json.dumps({"text": "One, two,"}) + "\n")
    loads = []
    real = engine.load_tokenizer

    def counting(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        loads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(engine, "load_tokenizer", counting)
    tok = real(src)
    for prompts, gsm8k_like, texts in (
        (text, False, ["The capital of Japan is", "One, two,"]),
        (None, True, GSM8K_LIKE),
    ):
        loads.clear()
        result = deploy_verify.verify_deployments(
            [str(layout)], src, prompts, gsm8k_like=gsm8k_like, max_new_tokens=1, backend="torch"
        )
        assert result["passed"] and loads.count(src) == 1, loads  # (the shards target loads its own, for parity)
        assert result["prompts"]["lengths"] == [len(tok(t)["input_ids"]) for t in texts]
