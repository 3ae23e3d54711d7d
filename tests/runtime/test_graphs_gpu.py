"""CUDA-graph decode on a GPU (skipped elsewhere): graph replay equals the eager step bit for bit
on the same kernels, and generation with graphs equals generation without.

The model is the tiny-gqa preset in bf16 on the PyTorch kernels by default (its 16-wide heads are
below Triton's tile minimum); PLAMO2_GPU_TEST_SHARDS=<shard dir> runs the same checks on real
shapes with the Triton kernels (a GPU session points it at synthetic plamo-2-1b: docs/benchmarks.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.generation import PrefillGroup, make_requests

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


GIVEN = os.environ.get("PLAMO2_GPU_TEST_SHARDS")
BACKEND = "triton" if GIVEN else "torch"


@pytest.fixture(scope="module")
def gpu_shards(shards) -> Path:
    return Path(GIVEN) if GIVEN else shards("tiny-gqa", 1, 1, dtype="bfloat16", seed=11)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def snapshot(runner) -> list[torch.Tensor]:
    tensors = [runner.ids, runner.pos, runner.keys, runner.steps, runner.next]
    for st in runner.states.values():
        tensors += list(st.tensors().values())
    return tensors


# (mode, per-slot temperatures, per-slot top-p): greedy, one nucleus setting, and a mix of greedy,
# plain sampling and nucleus rows in one graph.
CASES = [
    ("greedy", [0.0] * 5, [1.0] * 5),
    ("top_p", [0.8] * 5, [0.9] * 5),
    ("top_p", [0.0, 0.7, 1.1, 0.0, 0.9], [1.0, 1.0, 0.8, 0.5, 0.95]),
]


@pytest.mark.parametrize(("mode", "temps", "tops"), CASES)
def test_graph_replay_equals_eager_bit_for_bit(gpu_shards, mode, temps, tops) -> None:
    with Runtime(gpu_shards, device="cuda", backend=BACKEND) as rt:
        eng = rt.engines[0]
        V = eng.cfg.vocab_size
        runner = eng._runner(8, 96)
        assert runner.use_graphs
        runner.prepare([mode], 8)
        reqs = make_requests(prompts(V, [5, 17, 40, 9, 23]), [8] * 5, seed=1, keys=None)
        for slot, r in enumerate(reqs):
            r.slot = slot
        group = PrefillGroup(eng, reqs, None, None)
        while any(d < len(r.prompt) for d, r in zip(group.done, reqs, strict=True)):
            group.step()
        first = group.logits.argmax(-1)
        runner.admit(
            list(range(5)), group.states, first, [len(r.prompt) for r in reqs], [r.key for r in reqs], temps, tops
        )
        for _ in range(3):  # a few steps in, so the states are not the prefill's
            runner.step(5, mode)
        before = [t.clone() for t in snapshot(runner)]
        assert (8, mode) in runner.graphs
        nxt_graph, logits_graph = runner.step(5, mode)
        graph_out = [nxt_graph.clone(), logits_graph.clone()] + [t.clone() for t in snapshot(runner)]
        for t, saved in zip(snapshot(runner), before, strict=True):
            t.copy_(saved)
        logits_eager = runner._body(8, mode)[0]
        eager_out = [runner.next[:8].clone(), logits_eager.clone()] + [t.clone() for t in snapshot(runner)]
        for a, b in zip(graph_out, eager_out, strict=True):
            assert torch.equal(a, b)
        assert not all(torch.equal(a, b) for a, b in zip(graph_out[2:], before, strict=True))  # it did step


def test_generate_with_graphs_equals_eager(gpu_shards) -> None:
    path = gpu_shards
    with Runtime(path, device="cuda", backend=BACKEND) as rt:
        seqs = prompts(rt.config.vocab_size, [3, 50, 17, 9, 31, 64, 5])
        limits = [12, 3, 20, 7, 16, 9, 1]
        graphs = rt.generate(seqs, limits, max_batch=3).tokens
        sampled = rt.generate(seqs, limits, max_batch=4, temperature=0.9, top_p=0.95, seed=3).tokens
        assert rt.engines[0].decode_runner.use_graphs
    with Runtime(path, device="cuda", backend=BACKEND, cuda_graph=False) as rt:
        assert rt.generate(seqs, limits, max_batch=3).tokens == graphs
        assert rt.generate(seqs, limits, max_batch=4, temperature=0.9, top_p=0.95, seed=3).tokens == sampled
        assert not rt.engines[0].decode_runner.use_graphs
    assert [len(t) for t in graphs] == limits


def test_graphs_captured_lazily_as_the_tail_drains(gpu_shards) -> None:
    """Issue 33: the pool's bucket is captured at the start, each smaller one when the tail first
    needs it, with sequences still decoding in its rows; the tokens are the eager run's
    (tests/runtime/test_lazy_graphs.py checks the same logic on the CPU with a stand-in backend)."""
    limits = [12, 4, 20, 2, 9, 15, 30, 37]
    with Runtime(gpu_shards, device="cuda", backend=BACKEND) as rt:
        seqs = prompts(rt.config.vocab_size, [3, 30, 9, 17, 1, 45, 12, 6], seed=5)
        lazy = rt.generate(seqs, limits, max_batch=4).tokens
        captured = list(rt.engines[0].decode_runner.captured)
    with Runtime(gpu_shards, device="cuda", backend=BACKEND, cuda_graph=False) as rt:
        assert rt.generate(seqs, limits, max_batch=4).tokens == lazy
    assert captured[0] == (4, "greedy") and len(captured) > 1, captured


def test_online_loop_with_graphs_equals_eager(gpu_shards) -> None:
    """Mixed greedy / sampled requests arriving while the loop runs: one graph per bucket and
    sampling mode on CUDA gives the tokens of the eager loop."""
    from plamo2_tools.generation_request import GenerationRequest
    from plamo2_tools.runtime.batching.online import OnlineLoop

    results = []
    for graphs in (True, False):
        with Runtime(gpu_shards, device="cuda", backend=BACKEND, cuda_graph=graphs) as rt:
            seqs = prompts(rt.config.vocab_size, [3, 50, 17, 9, 31, 64, 5])
            settings = [(0.0, 1.0), (0.9, 0.95), (0.7, 1.0), (0.0, 1.0), (1.2, 0.5), (0.8, 1.0), (0.0, 1.0)]
            with OnlineLoop(rt, max_batch=4, max_context=128, eos_token_ids=[]) as loop:
                requests = [
                    GenerationRequest(f"r{i}", tuple(p), 12, temperature=t, top_p=q, seed=4, stream=i)
                    for i, (p, (t, q)) in enumerate(zip(seqs, settings, strict=True))
                ]
                handles = [loop.submit(r) for r in requests]
                for h in handles:
                    h.result(120)
                if graphs:
                    assert rt.engines[0].decode_runner.graphs
            results.append([h.tokens for h in handles])
    assert results[0] == results[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_graphs_on_nccl_ranks_equal_eager(shards) -> None:
    from plamo2_tools.runtime.batching.generation import generate_job
    from plamo2_tools.runtime.process.launch import launch

    path = shards("tiny-gqa", 2, 1, dtype="bfloat16", seed=11)
    seqs = prompts(515, [4, 19, 33])
    outs = {}
    for graphs in (True, False):
        runtime = {"shards": str(path), "device": "cuda", "backend": "torch", "cuda_graph": graphs}
        outs[graphs] = launch(generate_job, {"runtime": runtime, "prompts": seqs, "max_new_tokens": 12}, nproc=2)
    assert outs[True] == outs[False]
