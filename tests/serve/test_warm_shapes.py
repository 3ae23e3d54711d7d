"""A warm process meets no kernel specialization it has not prepared for (issue 32 §3): after
`warmup.warm`'s prefill shapes, prefills of prompt lengths and batch compositions never run before launch
nothing new, counted by `compile_watch` at every launch of our Triton kernels, on the CPU under
Triton's interpreter (what Triton compiles is a function of what the watch keys on, so a key never
seen is a compile waiting to happen on a GPU).

The control inside the test: warmed only up to 8 tokens, a 13-token prefill adds specializations
(the watch sees a missing bucket); the rest of the warm-up, then none.  Seen failing with
`representatives` left without its "other" class (the (5, 6) probe then added specializations:
`ssd._chunk_cumsum_kernel` and the norms' `BLOCK_R`).  Leaving out the T == S shapes (prompts of
one token, whose attention runs the decode kernel) was not caught: here the (2, 2) forward
already meets the decode kernel's classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plamo2_tools.runtime.batching.warmup import prefill_shapes, representatives

MAX_TOKENS, MAX_SEQS = 16, 3

CHILD = """
import json, random, sys
from plamo2_tools.kernels import compile_watch
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.warmup import prefill_shapes, prompts_of

shards, max_tokens, max_seqs, probes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
out = {}
with Runtime(shards, device="cpu", backend="triton", mode="local") as rt:
    shapes = prefill_shapes(max_tokens, max_seqs)
    def run(shapes):
        for t, s in shapes:
            rt.generate(prompts_of(t, s, 0), 1, max_batch=s)
    def new_keys(lens):
        before = compile_watch.snapshot()
        rt.generate([[3 + i % 29 for i in range(n)] for n in lens], 1, max_batch=len(lens))
        return sorted(str(k) for k in compile_watch.snapshot() - before)
    run([sh for sh in shapes if sh[0] <= 8])
    out["partial"] = new_keys([13])
    run([sh for sh in shapes if sh[0] > 8])
    out["warm_keys"] = len(compile_watch.snapshot())
    out["probes"] = [new_keys(lens) for lens in probes]
print(json.dumps(out))
"""


def test_representatives_meet_every_bucket_and_class() -> None:
    """Against a brute force: every n in 1..limit shares its (power-of-two bucket, class) with one
    representative."""

    def cls(n: int) -> tuple[int, int]:
        return (1 << (n - 1).bit_length(), 1 if n == 1 else 16 if n % 16 == 0 else 0)

    for limit in range(1, 70):
        reps = representatives(limit)
        assert all(1 <= r <= limit for r in reps)
        assert {cls(n) for n in range(1, limit + 1)} == {cls(r) for r in reps}, limit
    assert all(s <= t and t <= 20 and s <= 3 for t, s in prefill_shapes(20, 3))


@pytest.mark.slow
def test_new_prompt_lengths_after_warm_up_specialize_nothing(shards, tmp_path: Path) -> None:
    shapes = prefill_shapes(MAX_TOKENS, MAX_SEQS)
    warmed_totals = {t for t, _ in shapes}
    # lengths and totals no warm-up forward had: (13), (5, 6), (7, 2, 2), (1, 1, 1) is a T == S shape
    probes = [[13], [5, 6], [7, 2, 2], [3, 9], [1, 1, 1], [11]]
    assert all(sum(p) <= MAX_TOKENS and len(p) <= MAX_SEQS for p in probes)
    assert {sum(p) for p in probes[:4]} & warmed_totals == set()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PLAMO2_WATCH_KERNELS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(shards("tiny", 1, 1, seed=5)),
            str(MAX_TOKENS),
            str(MAX_SEQS),
            json.dumps(probes),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["partial"], "the control: a 13-token prefill warmed only up to 8 tokens must add keys"
    assert got["warm_keys"] > 20
    assert got["probes"] == [[] for _ in probes], got["probes"]
