"""Continuous batching, delayed stop checks and seeded sampling of `Runtime.generate` (CPU).

The oracles are independent of the decode loop: greedy tokens from `prompt_logits` (prefill only,
one token at a time), and a token-by-token replay of the stop rules over a free-running answer.
"""

from __future__ import annotations

import pytest
import torch

from plamo2_tools.runtime.batching import generation
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.sampling import MODES, mode_of, request_key, select_rows, select_tokens, uniforms
from plamo2_tools.runtime.batching.scheduler import Request, Scheduler

LENGTHS = [3, 30, 9, 17, 1, 45]  # ragged, one single-token prompt
LIMITS = [12, 4, 20, 1, 9, 15]  # answers of different lengths, one of a single token


def prompts(vocab: int, lengths: list[int] = LENGTHS, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def argmax_loop(rt: Runtime, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation from full-prompt forwards only (no decode step, no state reuse)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(rt.prompt_logits([prompt + out])[0][-1].argmax()))
    return out


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(requests still decoding, requests loaded) at every slot load of the generation loop."""
    seen: list[tuple[int, int]] = []
    original = generation.GenerationLoop._load

    def spy(self, group, rows):  # type: ignore[no-untyped-def]
        seen.append((len(self.sched.active()), len(rows)))
        return original(self, group, rows)

    monkeypatch.setattr(generation.GenerationLoop, "_load", spy)
    return seen


@pytest.mark.parametrize(("preset", "tp", "pp"), [("tiny", 1, 1), ("tiny-gqa", 2, 2)])
def test_continuous_batching_equals_one_at_a_time(shards, loads, preset, tp, pp) -> None:
    with Runtime(shards(preset, tp, pp, seed=11), backend="torch") as rt:
        seqs = prompts(rt.config.vocab_size)
        alone = [rt.generate([p], n).tokens[0] for p, n in zip(seqs, LIMITS, strict=True)]
        loads.clear()
        batched = rt.generate(seqs, LIMITS, max_batch=2).tokens
        assert batched == alone
        assert [len(t) for t in batched] == LIMITS
        # Slots were refilled while others kept decoding (not one static batch after another).
        assert len(loads) >= 4 and any(live > 0 for live, _ in loads)
        assert alone[0] == argmax_loop(rt, seqs[0], LIMITS[0])
        assert alone[5][:6] == argmax_loop(rt, seqs[5], 6)


def test_chunked_prefill_and_token_budget_change_nothing(shards) -> None:
    path = shards("tiny-gqa", 1, 1, seed=11)
    with Runtime(path, backend="torch") as rt:
        seqs = prompts(rt.config.vocab_size)
        want = rt.generate(seqs, LIMITS, max_batch=3).tokens
        assert not rt.engines[0].decode_runner.use_graphs  # CPU: always eager
    with Runtime(path, backend="torch", prefill_chunk=4, prefill_tokens=11) as rt:
        assert rt.generate(seqs, LIMITS, max_batch=3).tokens == want


class PrefixStop:
    """Stop request i once its tokens start with targets[i] (a stand-in for a stop string)."""

    def __init__(self, targets: list[list[int]]) -> None:
        self.targets = targets
        self.calls = 0

    def __call__(self, i: int, tokens: list[int]) -> bool:
        self.calls += 1
        t = self.targets[i]
        return bool(t) and tokens[: len(t)] == t


class SpanPrefixStop(PrefixStop):
    def first_hit(self, i: int, tokens: list[int], checked: int) -> int | None:
        n = len(self.targets[i])
        return n if self.targets[i] and checked < n <= len(tokens) and tokens[:n] == self.targets[i] else None


def replay(tokens: list[int], eos: set[int], stop: PrefixStop, i: int) -> list[int]:
    """The token-by-token loop's answer: stop after the first EOS or stop-string hit."""
    for n in range(1, len(tokens) + 1):
        if tokens[n - 1] in eos or stop(i, tokens[:n]):
            return tokens[:n]
    return tokens


@pytest.mark.parametrize("stop_kind", [PrefixStop, SpanPrefixStop])
@pytest.mark.parametrize("sync_every", [1, 8])
def test_stops_cut_exactly_despite_delayed_checks(shards, stop_kind, sync_every) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        seqs = prompts(rt.config.vocab_size, [4, 12, 7, 20, 9])
        free = rt.generate(seqs, 24).tokens
        eos_token = free[4][10]  # ends request 4 at its first occurrence, maybe others too
        cut = [3, 11, 0, 17, 0]  # request 2 and 4 never hit their stop string
        stop = stop_kind([f[:n] for f, n in zip(free, cut, strict=True)])
        streamed: dict[int, list[int]] = {}
        got = rt.generate(
            seqs,
            24,
            eos_token_ids=[eos_token],
            stop=stop,
            max_batch=2,
            sync_every=sync_every,
            on_token=lambda i, t: streamed.setdefault(i, []).append(t),
        ).tokens
    want = [replay(f, {eos_token}, PrefixStop(stop.targets), i) for i, f in enumerate(free)]
    assert got == want
    assert [len(w) for w in want] != [24] * 5 and len(want[0]) == 3 and want[4][-1] == eos_token
    assert streamed == {i: w for i, w in enumerate(want)}  # nothing past a stop was streamed


def test_seeded_sampling_is_identical_across_batch_compositions(shards) -> None:
    with Runtime(shards("tiny-gqa", 1, 1, seed=11), backend="torch") as rt:
        seqs = prompts(rt.config.vocab_size, [5, 14, 3, 22, 8])
        kw = {"temperature": 0.9, "top_p": 0.9, "seed": 11}
        together = rt.generate(seqs, 10, **kw).tokens
        slots2 = rt.generate(seqs, 10, max_batch=2, **kw).tokens
        alone = [rt.generate([p], 10, request_keys=[i], **kw).tokens[0] for i, p in enumerate(seqs)]
        order = [3, 0, 4, 2, 1]
        shuffled = rt.generate([seqs[i] for i in order], 10, request_keys=order, max_batch=3, **kw).tokens
        other_seed = rt.generate(seqs, 10, **{**kw, "seed": 12}).tokens
        greedy = rt.generate(seqs, 10).tokens
    assert together == slots2 == alone
    assert shuffled == [together[i] for i in order]
    assert other_seed != together and greedy != together
    assert len({tuple(t) for t in together}) == len(seqs)


def test_sampler_draws_from_the_nucleus_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    n = 30000
    keys = torch.tensor([request_key(5, i) for i in range(n)])
    steps = torch.zeros(n, dtype=torch.long)
    probs = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(select_tokens(logits.expand(n, 12), keys, steps, 0.7, 1.0), minlength=12) / n
    assert (freq - probs).abs().max() < 0.015
    order = probs.argsort(descending=True)
    keep = (probs[order].cumsum(0) - probs[order]) < 0.8
    nucleus = select_tokens(logits.expand(n, 12), keys, steps, 0.7, 0.8)
    assert set(nucleus.unique().tolist()) == set(order[keep].tolist())
    renorm = probs * torch.zeros(12).index_fill(0, order[keep], 1.0)
    freq = torch.bincount(nucleus, minlength=12) / n
    assert (freq - renorm / renorm.sum()).abs().max() < 0.015


def test_uniforms_depend_only_on_key_step_and_token() -> None:
    keys = torch.tensor([request_key(1, i) for i in range(6)])
    steps = torch.tensor([0, 1, 2, 0, 5, 9])
    batch = uniforms(keys, steps, 300)
    for r in range(6):
        assert torch.equal(uniforms(keys[r : r + 1], steps[r : r + 1], 300)[0], batch[r])
    assert not torch.equal(batch[0], batch[3])  # same step, other request
    assert batch.min() > 0 and batch.max() < 1 and abs(batch.mean().item() - 0.5) < 0.02
    assert request_key(1, 0) != request_key(2, 0) != request_key(1, 1)


def test_scheduler_refills_the_lowest_slot_and_closes_at_the_earliest_stop() -> None:
    reqs = [Request(i, [1] * (i + 1), 6, request_key(0, i)) for i in range(4)]
    stop = PrefixStop([[], [7, 8, 9], [], []])
    sched = Scheduler(reqs, slots=2, eos=[5], stop=stop)
    group = sched.admit(token_budget=None)
    assert [(r.index, r.slot) for r in group] == [(0, 0), (1, 1)] and not sched.can_admit()
    for r in group:
        r.live = True

    def step(values: list[int]) -> None:
        owners = [o if o is not None and reqs[o].issuing else None for o in sched.slot_owner]
        sched.record(torch.tensor(values), None, owners)
        sched.issue([reqs[o] for o in owners if o is not None])

    step([4, 7])
    step([5, 8])  # request 0 hits EOS here, but nobody looks yet
    step([6, 9])
    assert sched.slot_owner == [0, 1]  # not drained: slots still held
    sched.drain_until(sched.steps - 1)
    assert reqs[0].tokens == [4, 5] and reqs[0].closed  # EOS kept, later token dropped
    assert reqs[1].tokens == [7, 8, 9] and reqs[1].closed  # stop string at the third token
    assert sched.slot_owner == [None, None]
    assert [r.index for r in sched.admit(token_budget=3)] == [2]  # budget: 3 + 4 prompt tokens > 3
    assert reqs[2].slot == 0


def test_a_rows_token_depends_only_on_its_own_settings() -> None:
    """Per-slot sampling: each row of a mixed batch (greedy, plain, nucleus) picks what select_tokens
    picks for that row alone with its own setting, in every mode that covers the batch."""
    g = torch.Generator().manual_seed(3)
    settings = [(0.0, 1.0), (0.7, 1.0), (1.5, 1.0), (0.9, 0.6), (2.0, 0.95), (0.0, 0.3), (1.2, 1.0), (0.5, 0.8)]
    B, V = len(settings), 50
    temps = torch.tensor([t for t, _ in settings])
    tops = torch.tensor([p for _, p in settings])
    for step in range(200):
        logits = torch.randn(B, V, generator=g) * 0.5  # flat: the nucleus cuts often
        keys = torch.tensor([request_key(9, i) for i in range(B)])
        steps = torch.full((B,), step)
        alone = [
            int(select_tokens(logits[i : i + 1], keys[i : i + 1], steps[i : i + 1], t, p))
            for i, (t, p) in enumerate(settings)
        ]
        assert select_rows(logits, keys, steps, temps, tops, "top_p").tolist() == alone
        plain = [i for i, (t, p) in enumerate(settings) if mode_of(t, p) != "top_p"]
        idx = torch.tensor(plain)
        got = select_rows(logits[idx], keys[idx], steps[idx], temps[idx], tops[idx], "sample").tolist()
        assert got == [alone[i] for i in plain]
    assert MODES == ("greedy", "sample", "top_p")
