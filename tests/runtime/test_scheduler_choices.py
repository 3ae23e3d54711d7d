"""What the generation loop does, not only what it answers (issue 34, class 5): the burst-size rule and a
cancelled request that must leave the waiting line.  Both kinds of bug keep every text right (tokens depend only
on each request's own prompt and settings), so these tests watch the loop through spies that wrap the real
methods (each spy records, then calls the original): decode steps between two looks, which requests hold slots at
each step, which ones are admitted and prefilled.

The rule (scheduler.burst, docs/batching.md): after each look the loop runs at most `sync_every` decode steps,
no more than any live request still needs, and while requests wait, no more than until the first slot is freed by
length, so that a waiting request is admitted as soon as a slot is free.  The expected bursts below are worked out
by hand from that rule for tiny scenarios (each request's tokens: one from its prefill, the rest from decode
steps).  Seen red on bench/mutants.py's `sched-burst-*` mutants (the pending test swapped, the live minimum used
always, the look interval ignored) and `sched-cancel-stays-pending` (a cancelled waiting request admitted,
prefilled and given a slot later).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from online_script import scripted_session

from plamo2_tools.runtime.batching import generation
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.scheduler import Scheduler


class LoopSpy:
    """Wraps GenerationLoop._decode_step, Scheduler.drain_until / admit and PrefillGroup.step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trace: list[str] = []  # "d" per decode step, "|" per look at the tokens, "p" per prefill forward
        self.steps: list[dict[str, Any]] = []  # per decode step: who holds a slot, who waits
        self.admitted: list[list[Any]] = []  # per admission: the requests (tags, or indices)
        self.prefilled: list[Any] = []  # every request a prefill forward computed
        spy = self

        real_step = generation.GenerationLoop._decode_step

        def decode_step(self: Any, mode: str) -> None:
            sched = self.sched
            spy.steps.append(
                {
                    "slots": [None if o is None else spy.name(sched.requests[o]) for o in sched.slot_owner],
                    "waiting": [spy.name(sched.requests[i]) for i in sched.pending],
                }
            )
            spy.trace.append("d")
            return real_step(self, mode)

        real_drain = Scheduler.drain_until

        def drain_until(self: Any, number: int) -> None:
            spy.trace.append("|")
            return real_drain(self, number)

        real_admit = Scheduler.admit

        def admit(self: Any, token_budget: int | None) -> list[Any]:
            group = real_admit(self, token_budget)
            spy.admitted.append([spy.name(r) for r in group])
            return group

        real_prefill = generation.PrefillGroup.step

        def prefill(self: Any, rows: tuple[int, int] | None = None) -> int:
            a, b = rows or self.next_forward()
            spy.prefilled += [spy.name(r) for r in self.reqs[a:b]]
            spy.trace.append("p")
            return real_prefill(self, (a, b))

        monkeypatch.setattr(generation.GenerationLoop, "_decode_step", decode_step)
        monkeypatch.setattr(Scheduler, "drain_until", drain_until)
        monkeypatch.setattr(Scheduler, "admit", admit)
        monkeypatch.setattr(generation.PrefillGroup, "step", prefill)

    def clear(self) -> None:
        for seen in (self.trace, self.steps, self.admitted, self.prefilled):
            seen.clear()

    @staticmethod
    def name(r: Any) -> Any:
        return r.tag if r.tag is not None else r.index

    def bursts(self) -> list[int]:
        """Decode steps between two looks."""
        return [len(run) for run in "".join(self.trace).replace("p", "").split("|") if run]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> LoopSpy:
    return LoopSpy(monkeypatch)


@pytest.fixture(scope="module")
def rt(shards) -> Iterator[Runtime]:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch", mode="local") as runtime:
        yield runtime


def prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(rt: Runtime, limits: list[int], max_batch: int, sync_every: int = 8) -> list[list[int]]:
    seqs = prompts(rt.config.vocab_size, [4, 6, 5][: len(limits)])
    # no EOS: every request ends by length, so the schedule is fixed by the limits alone
    return rt.generate(seqs, limits, max_batch=max_batch, sync_every=sync_every, eos_token_ids=()).tokens


def test_nothing_waiting_each_burst_runs_to_the_look_interval(rt: Runtime, spy: LoopSpy) -> None:
    """Requests needing 3 and 20 tokens, two slots, nobody waiting: 19 decode steps (the first token comes from
    the prefill) in bursts of min(8, the most any live request still needs): 8, 8, 3.  Stopping at the first
    request's end instead (the waiting rule applied without waiters) would look 4 times: 2, 8, 8, 1."""
    out = run(rt, [3, 20], max_batch=2)
    assert [len(t) for t in out] == [3, 20]
    assert spy.bursts() == [8, 8, 3], spy.trace
    assert all(not s["waiting"] for s in spy.steps)


def test_with_a_request_waiting_the_burst_ends_where_a_slot_frees(rt: Runtime, spy: LoopSpy) -> None:
    """A third request waits for one of two slots: the first burst stops after 2 steps, when request 0 (3
    tokens) reaches its length and frees its slot; the waiting request is admitted at the next look, and no
    decode step runs while a slot is free and a request waits.  Then nobody waits: 8, 8, 1 (request 1's 17
    tokens left)."""
    out = run(rt, [3, 20, 5], max_batch=2)
    assert [len(t) for t in out] == [3, 20, 5]
    assert spy.bursts() == [2, 8, 8, 1], spy.trace
    assert spy.admitted == [[0, 1], [2]]
    idle = [i for i, s in enumerate(spy.steps) if s["waiting"] and None in s["slots"]]
    assert idle == [], f"decode steps {idle} ran with a free slot while {spy.steps[idle[0]]['waiting']} waited"
    assert "".join(spy.trace).replace("p", "").index("|") == 2  # request 2 did not wait for a whole look interval


def test_a_group_in_prefill_gets_one_decode_step_per_forward(shards, spy: LoopSpy) -> None:
    """Prompts prefilled in chunks of 4 tokens, one forward per loop iteration, while others decode: between two
    forwards of a group in prefill the running requests get exactly one decode step (they are not stalled, and
    the group does not wait for a whole burst).  Requests 0 and 1 (4 and 6 prompt tokens) are one group of two
    forwards (request 0 decodes after the first); request 2 (24 tokens) waits for request 0's slot, freed by
    length at its third token, and takes 6 forwards: p d p d, then p d p d ... p, then request 1's decodes."""
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch", mode="local", prefill_chunk=4) as rt4:
        seqs = prompts(rt4.config.vocab_size, [4, 6, 24])
        out = rt4.generate(seqs, [3, 30, 4], max_batch=2, eos_token_ids=()).tokens
    assert [len(t) for t in out] == [3, 30, 4]
    assert spy.admitted == [[0, 1], [2]]
    trace = "".join(spy.trace).replace("|", "")
    assert trace.count("p") == 8 and trace[: trace.rindex("p") + 1] == "pd" * 7 + "p", trace


def test_the_look_interval_bounds_every_burst(rt: Runtime, spy: LoopSpy) -> None:
    """sync_every 3, one request of 12 tokens: 11 decode steps in bursts of 3, 3, 3, 2."""
    out = run(rt, [12], max_batch=1, sync_every=3)
    assert [len(t) for t in out] == [12]
    assert spy.bursts() == [3, 3, 3, 2], spy.trace


def test_a_request_cancelled_while_waiting_never_runs(rt: Runtime, spy: LoopSpy) -> None:
    """One slot: `a` (30 tokens) runs, `b` and `c` wait; `b` is cancelled from the loop's own callback once `a`
    has its first tokens, i.e. while `b` still waits.  `b` ends cancelled with no token, is never admitted, never
    prefilled, never holds a slot; `c` runs after `a` as if `b` had never come."""
    V = rt.config.vocab_size
    pa, pb, pc = prompts(V, [5, 7, 6])
    script = [
        {"id": "a", "prompt": pa, "max_tokens": 30, "temperature": 0.0},
        {"id": "b", "prompt": pb, "max_tokens": 6, "temperature": 0.0},
        {"id": "c", "prompt": pc, "max_tokens": 4, "temperature": 0.0},
        {"cancel": "b", "after": ["a", 1]},
    ]
    want_c = rt.generate([pc], 4, eos_token_ids=()).tokens[0]
    spy.clear()
    out = scripted_session(rt, script, max_batch=1, max_context=64)
    assert out is not None
    assert out["b"]["reason"] == "cancelled" and out["b"]["tokens"] == []
    assert out["a"]["reason"] == "length" and len(out["a"]["tokens"]) == 30
    assert out["c"]["tokens"] == want_c
    assert spy.admitted[0] == ["a"] and ["c"] in spy.admitted
    assert all("b" not in group for group in spy.admitted), spy.admitted
    assert "b" not in spy.prefilled and "a" in spy.prefilled and "c" in spy.prefilled
    holders = {h for s in spy.steps for h in s["slots"] if h is not None}
    assert holders == {"a", "c"}, holders
    # b left the waiting line at once: c is the only one waiting once the cancel is in
    waited = [s["waiting"] for s in spy.steps if s["waiting"]]
    assert waited and waited[-1] == ["c"]
