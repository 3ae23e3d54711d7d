"""The generation loop one rank runs: continuous batching over a pool of decode slots.

    while requests are open:
        admit waiting requests into free slots (a group, at most `prefill_tokens` prompt tokens)
        run the next forward of the group's prefill (chunked; its own states, so it never touches
            running sequences), and when it is done sample the first tokens and load the group
            into its slots
        run decode steps for every live slot (one step while requests wait to be admitted, else
            up to `sync_every`), each leaving an asynchronous copy of its tokens
        drain the copies that are `sync_every` steps old: EOS ids and stop strings close
            requests, their slots are refilled next round

Each request's tokens depend only on its own prompt and its sampling stream, never on which
requests share the batch, so results equal one-at-a-time generation and come back in input
order.  Every rank walks the same loop: token ids come from the last stage by broadcast, and every
decision is taken at a fixed step count from tokens all ranks hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .core import RankCore
from .graphs import DecodeRunner, Sampling
from .sampling import request_key, select_tokens
from .scheduler import OnToken, Request, Scheduler, StopFn

Tensor = torch.Tensor
RING_ROWS = 64  # host rows for token copies in flight; must exceed 2 * sync_every + 2


@dataclass(frozen=True)
class GenerateOptions:
    """How one `generate` call runs (none of it changes the tokens)."""

    max_batch: int | None = None  # decode slots; None: every prompt at once
    sync_every: int = 8  # decode steps between looks at the tokens (also the host's lag)
    return_logits: bool = False


@dataclass
class PhaseTimer:
    """Device time of prefill forwards and decode steps (for benchmarks; set `RankEngine.timer`).

    CUDA events around each phase, read once at the end, so timing adds no synchronisation.
    """

    spans: dict[str, list[tuple[object, object]]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    host: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    counts: dict[str, int] = field(
        default_factory=lambda: {"prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0}
    )

    @contextmanager
    def phase(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self.host[name] += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.spans[name].append((start, end))

    def seconds(self) -> dict[str, float]:
        out = dict(self.host)
        for name, spans in self.spans.items():
            for start, end in spans:
                end.synchronize()  # type: ignore[attr-defined]
                out[name] += start.elapsed_time(end) / 1000  # type: ignore[attr-defined]
        return out


class PrefillGroup:
    """The prefill of requests admitted together, on states of their own, one forward at a time.

    A forward takes a contiguous run of the group's unfinished sequences, each with its next chunk
    of at most `chunk` tokens, up to `budget` tokens in all; the states of that run are views, so
    nothing is copied until the group is loaded into its slots.
    """

    def __init__(self, engine: RankCore, reqs: list[Request], chunk: int | None, budget: int | None) -> None:
        self.engine, self.reqs, self.chunk, self.budget = engine, reqs, chunk, budget
        self.done = [0] * len(reqs)
        self.states = engine.new_states(len(reqs), max(len(r.prompt) for r in reqs))
        V = engine.cfg.vocab_size
        last = engine.comm.info.is_last_stage
        self.logits = torch.empty(len(reqs), V, dtype=torch.float32, device=engine.device) if last else None

    @property
    def finished(self) -> bool:
        return all(d == len(r.prompt) for d, r in zip(self.done, self.reqs, strict=True))

    def _take(self, i: int) -> int:
        left = len(self.reqs[i].prompt) - self.done[i]
        return left if self.chunk is None else min(self.chunk, left)

    def step(self) -> None:
        """Run the next forward."""
        a = next(i for i, r in enumerate(self.reqs) if self.done[i] < len(r.prompt))
        b, total = a, 0
        while (
            b < len(self.reqs)
            and self._take(b) > 0  # a finished sequence ends the run: states are views of rows [a, b)
            and (b == a or self.budget is None or total + self._take(b) <= self.budget)
        ):
            total += self._take(b)
            b += 1
        chunks = [self.reqs[i].prompt[self.done[i] : self.done[i] + self._take(i)] for i in range(a, b)]
        starts = self.done[a:b]
        ends = [s + len(c) == len(self.reqs[a + j].prompt) for j, (s, c) in enumerate(zip(starts, chunks, strict=True))]
        offsets = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0).tolist()
        want = [offsets[j + 1] - 1 for j, e in enumerate(ends) if e]
        batch = self.engine.batch(chunks, starts, decode=False, logits_index=want)
        if self.engine.timer is not None:
            self.engine.timer.counts["prefill_tokens"] += sum(map(len, chunks))
        logits = self.engine.model.forward(batch, {i: st.rows(a, b) for i, st in self.states.items()})
        if logits is not None and self.logits is not None and want:
            rows = torch.tensor([a + j for j, e in enumerate(ends) if e], device=self.engine.device)
            self.logits[rows] = logits
        for j, c in enumerate(chunks):
            self.done[a + j] += len(c)


class GenerationLoop:
    """One `generate` call on one rank."""

    def __init__(
        self,
        engine: RankCore,
        runner: DecodeRunner,
        requests: list[Request],
        sampling: Sampling,
        eos: Sequence[int],
        stop: StopFn | None,
        on_token: OnToken | None,
        options: GenerateOptions,
        slots: int,
    ) -> None:
        self.engine, self.runner, self.sampling, self.options = engine, runner, sampling, options
        self.sched = Scheduler(requests, slots, eos, stop, on_token)
        self.requests = requests
        dev = engine.device
        pin = dev.type == "cuda"
        self.ring = torch.zeros(RING_ROWS, runner.slots, dtype=torch.long, pin_memory=pin)
        self.ring_next = 0
        self.group: PrefillGroup | None = None
        self.filling = False  # admitting groups until the free slots are used (see _worth_admitting)

    def run(self) -> None:
        sched, k = self.sched, self.options.sync_every
        while not sched.done:
            if self.group is None and sched.can_admit() and self._worth_admitting():
                reqs = sched.admit(self.engine.prefill_tokens)
                self.group = PrefillGroup(self.engine, reqs, self.engine.prefill_chunk, self.engine.prefill_tokens)
            if self.group is not None:
                with self._timed("prefill"):
                    self.group.step()
                if self.group.finished:
                    self._load(self.group)
                    self.group = None
            active = sched.active()
            if active:
                self._compact()
                waiting = self.group is not None or (sched.can_admit() and self._worth_admitting())
                burst = 1 if waiting else sched.burst(k)
                with self._timed("decode"):
                    for _ in range(burst):
                        self._decode_step()
                sched.drain_until(sched.steps - 1 - k)
            elif self.group is None:
                sched.drain_all()  # nothing left to run: wait for the tokens still in flight
            if len(sched.records) >= RING_ROWS - 2:
                sched.drain_until(sched.records[0].number)
        if self.engine.timer is not None:
            self.engine.timer.counts["generated_tokens"] += sum(len(r.tokens) for r in self.requests)

    # ---- pieces ----------------------------------------------------------------------------------
    def _worth_admitting(self) -> bool:
        """Refill once an eighth of the slots is free (or nothing else runs), then keep admitting
        groups until the slots are full again.  Small prefills are slow (H200, 1b: 111k tokens/s
        at 2,048 tokens, 188k at 32,768), while a few idle slots cost a large decode batch little
        (3.5 ms per step at 256 sequences, 1.5 ms at 64); refilling one slot at a time made GSM8K
        generation take 70 s where prefill and decode at those rates need about 26 s."""
        sched = self.sched
        if not sched.can_admit():
            self.filling = False
            return False
        if not self.filling:
            free = len(sched.free_slots())
            self.filling = not sched.active() or free >= min(len(sched.pending), max(1, len(sched.slot_owner) // 8))
        return self.filling

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        timer = self.engine.timer
        if timer is None:
            yield
            return
        with timer.phase(name, self.engine.device):
            yield

    def _ring_row(self, n: int) -> Tensor:
        row = self.ring[self.ring_next, :n]
        self.ring_next = (self.ring_next + 1) % RING_ROWS
        return row

    def _record(self, tokens: Tensor, owners: list[int | None], logits: Tensor | None) -> None:
        """Queue an asynchronous copy of `tokens` (device) for the host."""
        host = self._ring_row(tokens.shape[0])
        event = None
        if tokens.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(tokens)
        kept = None
        if self.options.return_logits:
            kept = self.engine.share(logits, (tokens.shape[0], self.engine.cfg.vocab_size), torch.float32).cpu()
        self.sched.record(host, event, owners, kept)

    def _load(self, group: PrefillGroup) -> None:
        """Sample the group's first tokens and put the group into its slots."""
        eng, reqs = self.engine, group.reqs
        n = len(reqs)
        first = None
        if group.logits is not None:
            keys = torch.tensor([r.key for r in reqs], dtype=torch.long, device=eng.device)
            steps = torch.zeros(n, dtype=torch.long, device=eng.device)
            first = select_tokens(group.logits, keys, steps, *self.sampling)
        first = eng.share(first, (n,), torch.long)
        slots = [r.slot for r in reqs if r.slot is not None]
        assert len(slots) == n
        self.runner.admit(slots, group.states, first, [len(r.prompt) for r in reqs], [r.key for r in reqs])
        for r in reqs:
            r.live = True
        self._record(first, [r.index for r in reqs], group.logits)
        self.sched.issue(reqs)

    def _decode_step(self) -> None:
        sched = self.sched
        B = self.runner.bucket(sched.high_water())
        owners = [o if o is not None and self.requests[o].issuing else None for o in sched.slot_owner[:B]]
        nxt, logits = self.runner.step(B, self.sampling)
        if self.engine.timer is not None:
            self.engine.timer.counts["decode_steps"] += 1
        self._record(nxt, owners, logits)
        sched.issue([self.requests[o] for o in owners if o is not None])

    def _compact(self) -> None:
        """With nobody waiting, move the highest live slots down so the decode batch shrinks."""
        sched = self.sched
        if sched.pending or self.group is not None:
            return
        live = sorted(r.slot for r in sched.active() if r.slot is not None)
        while live and self.runner.bucket(live[-1] + 1) > self.runner.bucket(len(live)):
            free = sched.free_slots()[0]
            src = live.pop()
            self.runner.move(src, free)
            sched.move(src, free)
            live = sorted([*live, free])


def make_requests(
    prompts: Sequence[Sequence[int]], max_new: Sequence[int], seed: int, keys: Sequence[int] | None
) -> list[Request]:
    """Requests in input order; sampling streams keyed on (seed, caller's request key)."""
    ids = range(len(prompts)) if keys is None else keys
    return [
        Request(i, list(p), int(m), request_key(seed, int(key)))
        for i, (p, m, key) in enumerate(zip(prompts, max_new, ids, strict=True))
    ]


def generate_job(rt: Any, prompts: list[list[int]], max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """`launch()` job (torchrun ranks): the tokens of `Runtime.generate`."""
    return rt.generate(prompts, max_new_tokens, **kwargs).tokens
