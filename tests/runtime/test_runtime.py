"""The runtime on shards against the reference forward on the original checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from plamo2_tools.model.registry import valid_layouts as layouts_of
from plamo2_tools.model.synth import preset_config
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.process.jobs import run_job
from plamo2_tools.verify import THRESHOLDS, compare, judge, runtime_outputs, verify

GREEDY_STEPS = 32  # the reference fixture's continuation length (conftest.py)


def valid_layouts(preset: str, max_ranks: int = 8) -> list[tuple[int, int]]:
    return layouts_of(preset_config(preset), max_ranks)


LAYOUTS = [(p, tp, pp) for p in ("tiny", "tiny-gqa", "tiny-edge", "tiny-2.1") for tp, pp in valid_layouts(p)]


@pytest.mark.parametrize(("preset", "tp", "pp"), LAYOUTS, ids=[f"{p}-tp{t}-pp{q}" for p, t, q in LAYOUTS])
def test_every_layout_matches_the_reference(preset, tp, pp, shards, prompts, reference):
    """fp32 shards: max relative logit error < 1e-4 and the same 32 greedy tokens."""
    ref = reference(preset)
    with Runtime(shards(preset, tp, pp, seed=11), backend="torch", mode="local") as rt:
        metrics = compare(ref, runtime_outputs(rt, prompts[preset], GREEDY_STEPS))
    assert metrics["max_rel_err"] < 1e-4, metrics
    assert metrics["greedy_match_tokens"] == [GREEDY_STEPS] * len(prompts[preset]), metrics
    assert judge(metrics, THRESHOLDS["float32"]) == []


def test_reference_is_not_trivially_matched(shards, prompts, reference):
    """The comparison can fail: another preset's prompts/continuations must not match."""
    ref = reference("tiny")
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        out = runtime_outputs(rt, prompts["tiny"], GREEDY_STEPS)
    out["prompt_logits"] = [lg.roll(1, dims=-1) for lg in out["prompt_logits"]]  # shifted vocab
    metrics = compare(ref, out)
    assert judge(metrics, THRESHOLDS["float32"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_shards_within_stated_tolerances(dtype, checkpoint, shards, prompts):
    result = verify(
        [shards("tiny-gqa", 2, 2, dtype=dtype, seed=11)],
        checkpoint("tiny-gqa", seed=11),
        prompts["tiny-gqa"],
        "fixture",
        16,
        backend="torch",
    )
    layout = result["layouts"][0]
    assert layout["dtype"] == dtype
    assert layout["passed"], layout
    assert layout["metrics"]["max_rel_err"] > 1e-5  # really ran in half precision


def test_torchrun_ranks_equal_one_process(shards, prompts):
    """4 real gloo ranks (TP2 x PP2) and 4 thread ranks give the same logits and tokens."""
    path, seqs = shards("tiny", 2, 2, seed=11), prompts["tiny"]
    runtime = {"shards": str(path), "device": "cpu", "backend": "torch", "prefill_chunk": None}
    dist = run_job(runtime_outputs, runtime, {"prompts": seqs, "max_new_tokens": 8}, launch=True)
    with Runtime(path, backend="torch", mode="local") as rt:
        local = runtime_outputs(rt, seqs, 8)
    assert dist["tokens"] == local["tokens"]
    for a, b in zip(dist["prompt_logits"], local["prompt_logits"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_prefill_plus_decode_equals_full_forward(shards, prompts):
    seqs = prompts["tiny-gqa"]
    with Runtime(shards("tiny-gqa", 2, 1, seed=11), backend="torch") as rt:
        gen = rt.generate(seqs, 12, return_logits=True)
        full = rt.prompt_logits([s + t for s, t in zip(seqs, gen.tokens, strict=True)])
    for s, steps, lg in zip(seqs, gen.logits, full, strict=True):
        # step j's logits come after prompt + j generated tokens: position len(s) - 1 + j
        torch.testing.assert_close(steps, lg[len(s) - 1 : len(s) - 1 + steps.shape[0]], rtol=1e-4, atol=1e-4)


def test_ragged_batch_equals_one_by_one(shards, prompts):
    seqs = prompts["tiny"] + [[1, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    with Runtime(shards("tiny", 2, 1, seed=11), backend="torch") as rt:
        batch = rt.generate(seqs, 10, return_logits=True)
        for i, s in enumerate(seqs):
            alone = rt.generate([s], 10, return_logits=True)
            assert alone.tokens[0] == batch.tokens[i]
            torch.testing.assert_close(alone.logits[0], batch.logits[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_one_shot(shards, prompts, chunk):
    seqs = prompts["tiny-gqa"]
    path = shards("tiny-gqa", 1, 2, seed=11)
    with Runtime(path, backend="torch") as rt:
        whole = rt.prompt_logits(seqs)
        whole_gen = rt.generate(seqs, 6).tokens
    with Runtime(path, backend="torch", prefill_chunk=chunk) as rt:
        pieces = rt.prompt_logits(seqs)
        assert rt.generate(seqs, 6).tokens == whole_gen
    for a, b in zip(whole, pieces, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_window_crossed_in_decode_matches_reference(shards, checkpoint):
    """Prompt and continuation far past the 12-token window of `tiny`: the reference (HF window
    semantics: self + 12 previous keys) and the runtime still agree token for token."""
    from plamo2_tools.verify import reference_outputs

    prompt = [[1] + [(i * 37) % 997 + 1 for i in range(30)]]
    ref = reference_outputs(checkpoint("tiny", seed=11), prompt, 24, torch.float64)
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        gen = rt.generate(prompt, 24, return_logits=True)
    assert gen.tokens[0] == ref.tokens[0]
    torch.testing.assert_close(gen.logits[0], ref.step_logits[0].float(), rtol=1e-4, atol=1e-4)


def test_score_matches_prompt_logits(shards, prompts):
    seqs = prompts["tiny-edge"]
    with Runtime(shards("tiny-edge", 2, 2, seed=11), backend="torch") as rt:
        logits = rt.prompt_logits(seqs)
        scores = rt.score(seqs, [2] * len(seqs))
    for s, lg, (logprob, greedy) in zip(seqs, logits, scores, strict=True):
        lp = lg.double().log_softmax(-1)
        want = torch.tensor([lp[p - 1, s[p]] for p in range(2, len(s))], dtype=torch.float64)
        torch.testing.assert_close(logprob, want, rtol=1e-6, atol=1e-6)
        assert greedy.tolist() == [int(lg[p - 1].argmax()) == s[p] for p in range(2, len(s))]


def test_sampling_is_seeded_and_respects_eos(shards, prompts):
    seqs = prompts["tiny"]
    with Runtime(shards("tiny", 2, 2, seed=11), backend="torch") as rt:
        a = rt.generate(seqs, 8, temperature=1.0, top_p=0.9, seed=5).tokens
        b = rt.generate(seqs, 8, temperature=1.0, top_p=0.9, seed=5).tokens
        c = rt.generate(seqs, 8, temperature=1.0, top_p=0.9, seed=6).tokens
        greedy = rt.generate(seqs, 8).tokens
        # EOS: a token that some sequence first produces after its first step, so that generation must
        # also run on past tokens that are not EOS; when every output repeats one token (a random tiny
        # model may) there is none, and the first token of all is EOS instead.
        first_seen = [(i, j) for i, g in enumerate(greedy) for j, t in enumerate(g) if t not in g[:j]]
        i, k = next(((i, j) for i, j in first_seen if j > 0), first_seen[0])
        eos = greedy[i][k]
        stopped = rt.generate(seqs, 8, eos_token_ids=[eos]).tokens
    assert a == b and a != c
    # every sequence ends at (and includes) its first EOS; one without EOS runs its full length
    assert stopped == [g[: g.index(eos) + 1] if eos in g else g for g in greedy]
    assert len(stopped[i]) == k + 1


def test_bad_tokens_are_a_user_error(shards):
    from plamo2_tools.errors import UserError

    with (
        Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt,
        pytest.raises(UserError, match="outside the vocabulary"),
    ):
        rt.prompt_logits([[1, 5000]])


def test_verify_cli_passes_and_catches_a_broken_shard(tmp_path, cli, shards, checkpoint):
    path = shards("tiny-gqa", 2, 1, seed=11)
    ok = cli("verify", path, "--reference", checkpoint("tiny-gqa", seed=11), "--max-new-tokens", "4", "--json")
    assert json.loads(ok.stdout)["passed"] is True

    # Swap the q rows of two heads inside rank 1's qkv_proj of layer 1, in place: same header and
    # shapes, wrong math.  Loading refuses the file (its digest); with --no-verify the numbers do.
    broken = tmp_path / "broken"
    import shutil

    from plamo2_tools.safetensors_io import read_header

    shutil.copytree(path, broken)
    f = broken / "model-rank-1-part-0.safetensors"
    info = read_header(f).tensors["model.layers.layers.1.mixer.qkv_proj.weight"]
    rows = 16 * info.row_bytes  # one head of d = 16 rows
    data = bytearray(f.read_bytes())
    a, b = info.offset, info.offset + rows
    data[a:b], data[b : b + rows] = data[b : b + rows], data[a:b]
    f.write_bytes(bytes(data))
    args = ["verify", broken, "--reference", checkpoint("tiny-gqa", seed=11), "--max-new-tokens", "4"]
    refused = cli(*args, expect=2)
    assert "model-rank-1-part-0.safetensors: xxh3-128 digest differs" in refused.stderr
    bad = cli(*args, "--no-verify", expect=1)
    assert "FAIL" in bad.output


def test_logits_cli_on_shards_equals_reference(tmp_path, cli, shards, checkpoint):
    import numpy as np

    ids = "1,17,300,42,5,6,7,8,9,10,11,12,13,14,15,16"
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    cli("logits", shards("tiny", 2, 2, seed=11), "--input-ids", ids, "--out", a, "--backend", "torch")
    cli("logits", checkpoint("tiny", seed=11), "--input-ids", ids, "--out", b)
    x, y = np.load(a), np.load(b)
    assert x.shape == y.shape == (16, 1000)
    assert np.abs(x - y).max() / np.abs(y).max() < 1e-4


def test_generate_cli_json(cli, shards):
    args = ("--prompt", "Q: 1+1?", "--max-new-tokens", "5", "--json", "--backend", "torch")
    result = cli("generate", shards("tiny", 1, 2, seed=11), *args)
    data = json.loads(result.stdout)
    assert len(data["tokens"]) == 5 and data["prompt_tokens"] == 8  # BOS + 7 bytes


def test_cli_under_torchrun_uses_real_ranks(tmp_path, shards):
    """`torchrun --nproc-per-node 4 -m plamo2_tools.cli logits ...` runs one rank per process and
    rank 0 writes the same logits as the one-process run."""
    import os
    import subprocess
    import sys

    import numpy as np

    path = shards("tiny", 2, 2, seed=11)
    ids = "1,5,9,200,31,7,8,9,10,11,12,13,14,15"
    dist_out, local_out = tmp_path / "dist.npy", tmp_path / "local.npy"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "plamo2_tools.cli",
    ]
    args = ["logits", str(path), "--input-ids", ids, "--backend", "torch"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + args + ["--out", str(dist_out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "plamo2_tools.cli", *args, "--out", str(local_out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(dist_out), np.load(local_out), rtol=1e-5, atol=1e-5)
