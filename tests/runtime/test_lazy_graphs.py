"""Decode graphs are captured only for the buckets a run meets, when it first meets them, and a
capture while sequences run changes none of their tokens (issue 33, runtime/batching/graphs.py).

CUDA graphs need a GPU.  Here a stand-in backend runs the step's body where a graph would replay
it, with the same eager warm-up runs before each capture (`WARMUP_RUNS`) that write into the rows
of running sequences, so what is tested is the part that can go wrong on the CPU too: which
(bucket, mode) pairs get captured, and that parking the live recurrent states and step buffers
around those warm-up runs leaves every sequence exactly where it was.  `test_graphs_gpu.py` checks
the same two facts with real graphs.  Seen failing: with the states not put back after the capture
(`src.copy_(dst)` removed in `_capture_live`), or the step buffers not put back, the tokens differ
from the eager run's (3 of 4 tests red, each time).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.graphs import WARMUP_RUNS, DecodeRunner

LENGTHS = [3, 30, 9, 17, 1, 45, 12, 6]
LIMITS = [12, 4, 20, 2, 9, 15, 30, 37]


class EagerReplay:
    """A graph backend for the CPU: capture = the warm-up runs a CUDA capture does; replay = the body."""

    def capture(self, body: Any) -> Any:
        for _ in range(WARMUP_RUNS):
            body()
        return body

    def replay(self, handle: Any) -> tuple[torch.Tensor, ...]:
        return handle()


def prompts(vocab: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture
def buckets_met(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(bucket, mode) of every decode step the loop runs."""
    seen: list[tuple[int, str]] = []
    original = DecodeRunner.step

    def spy(self, n, mode, live=None):  # type: ignore[no-untyped-def]
        seen.append((self.bucket(n), mode))
        return original(self, n, mode, live)

    monkeypatch.setattr(DecodeRunner, "step", spy)
    return seen


def run(path, replay: bool, **kwargs: Any) -> tuple[list[list[int]], list[tuple[int, str]]]:
    with Runtime(path, backend="torch") as rt:
        if replay:
            for eng in rt.engines:
                eng.graph_backend = EagerReplay()
        tokens = rt.generate(prompts(rt.config.vocab_size), LIMITS, **kwargs).tokens
        runner = rt.engines[0].decode_runner
        assert runner is not None and runner.use_graphs == replay
        return tokens, list(runner.captured)


# PLaMo 2 (Mamba and attention layers: both kinds of state).  tiny3's random weights repeat one token
# whatever the position, so its tokens cannot tell a misplaced step apart (tried: it passes with the
# step buffers left unrestored).
@pytest.mark.parametrize(("preset", "tp", "pp"), [("tiny", 1, 1), ("tiny-gqa", 2, 2)])
def test_captures_while_sequences_run_change_no_token(shards, buckets_met, preset: str, tp: int, pp: int) -> None:
    """8 prompts through 4 slots: the pool's bucket at the start, then 2 and 1 as the tail drains,
    each captured with sequences still decoding in its rows."""
    path = shards(preset, tp, pp, seed=11)
    eager, _ = run(path, replay=False, max_batch=4)
    buckets_met.clear()
    lazy, captured = run(path, replay=True, max_batch=4)
    assert lazy == eager
    met = list(dict.fromkeys(buckets_met))  # in the order first met, once each
    assert captured == met == [(4, "greedy"), (2, "greedy"), (1, "greedy")]


def test_only_the_buckets_and_modes_met(shards, buckets_met) -> None:
    """One prompt: one graph.  Sampled requests: the sampling mode's graphs, no greedy one."""
    path = shards("tiny", 1, 1, seed=11)
    with Runtime(path, backend="torch") as rt:
        rt.engines[0].graph_backend = EagerReplay()
        p = prompts(rt.config.vocab_size)
        rt.generate(p[:1], 10)
        assert rt.engines[0].decode_runner.captured == [(1, "greedy")]
        rt.engines[0].decode_runner = None  # a fresh pool
        rt.generate(p, LIMITS, max_batch=4, temperature=0.8, seed=2)
        assert rt.engines[0].decode_runner.captured == [(4, "sample"), (2, "sample"), (1, "sample")]


def test_a_bucket_without_spare_rows_runs_eager_until_it_has_them(shards, buckets_met) -> None:
    """3 slots: buckets 1, 2, 3.  Bucket 2 with 2 live sequences has no two spare rows to park them
    in (2 + 2 > 3): those steps run eager, and the tokens are still the eager run's."""
    path = shards("tiny", 1, 1, seed=11)
    eager, _ = run(path, replay=False, max_batch=3)
    buckets_met.clear()
    lazy, captured = run(path, replay=True, max_batch=3)
    assert lazy == eager
    assert (2, "greedy") in buckets_met
    assert captured[0] == (3, "greedy") and (1, "greedy") in captured
