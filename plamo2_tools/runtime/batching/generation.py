"""The generation loop one rank runs: continuous batching over a pool of decode slots, for a closed
list of requests (`generate`) or for requests that arrive while it runs (`online`).

    while requests are open (or more may come):
        take in what arrived (online: the same arrivals and cancellations on every rank, at the
            same iteration, see `online`)
        admit waiting requests into free slots when it pays (the policy below): a group of at
            most `prefill_tokens` prompt tokens
        run the next forward of the group's prefill (its own states, so it never touches running
            sequences; at most `prefill_tokens` tokens), and load each sequence whose prompt is
            done into its slot with its first token
        run decode steps for every live slot (one step while a group is being prefilled, else up
            to `sync_every`), each leaving an asynchronous copy of its tokens
        drain the copies that are `sync_every` steps old: EOS ids and stop strings close
            requests (their slots are refilled next round); hand what changed to the callbacks

The admission policy (docs/batching.md has the measurements behind it): a prefill forward is
efficient only when it is large (H200, plamo-2-1b: 111k tokens/s at 2,048 tokens, 188k at 32,768),
while a few idle slots cost a large decode batch little (3.5 ms per step at 256 sequences, 1.5 ms
at 64).  So freed slots are refilled when (a) nothing decodes, or (b) at least an eighth of the
slots is free (or every waiting request fits), or (c) the free slots can take a full forward's
worth (`prefill_tokens`) of waiting prompts; a group then takes as many free slots as that budget
allows.  Decode steps stay pure decode (one captured CUDA graph each); prefill forwards are the
size the device wants, not the size of one request.

Each request's tokens depend only on its own prompt, its sampling settings and its sampling stream,
never on which requests share the batch or when they arrived (a sequence's prefill is cut into
forwards at positions that depend only on its own length and the budget), so results equal
one-at-a-time generation.  Every rank walks the same loop: token ids come from the last stage by
broadcast, and every decision is taken at a fixed step count from tokens all ranks hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...generation_request import sampling_settings
from .core import RankCore
from .graphs import DecodeRunner
from .sampling import covering_mode, mode_of, request_key, select_rows
from .scheduler import Request, Scheduler, StopFn, Update

Tensor = torch.Tensor
RING_ROWS = 64  # host rows for token copies in flight; must exceed 2 * sync_every + 2
REFILL_FRACTION = 1 / 8  # free slots that make a refill worth its (smaller) prefill
OnUpdates = Callable[[list[Update]], None]


@dataclass(frozen=True)
class GenerateOptions:
    """How one loop runs (none of it changes the tokens)."""

    max_batch: int | None = None  # decode slots; None: every prompt at once
    sync_every: int = 8  # decode steps between looks at the tokens (also the host's lag)
    return_logits: bool = False
    refill_fraction: float = REFILL_FRACTION


@dataclass
class LoopStats:
    """What the loop did (host counters, always kept; `RankEngine.stats` sums them over calls).

    `groups` holds, per admitted prefill group: (requests decoding when it was admitted, requests in
    it, requests still waiting after it).  Decode rows are the bucket rows computed; live rows
    those that belonged to a request still generating (the rest is padding).  `idle_slot_steps`
    counts free slots over decode steps taken while requests were waiting; `stalled_forwards` the
    prefill forwards that ran while sequences were decoding (each delays their next step)."""

    prefill_forwards: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0  # (sequence, forward) pairs
    forward_tokens: list[int] = field(default_factory=list)
    groups: list[tuple[int, int, int]] = field(default_factory=list)
    decode_steps: int = 0
    decode_rows: int = 0
    decode_live_rows: int = 0
    idle_slot_steps: int = 0
    stalled_forwards: int = 0
    generated_tokens: int = 0

    def merge(self, other: LoopStats) -> None:
        for name, value in vars(other).items():
            mine = getattr(self, name)
            setattr(self, name, mine + value)

    def summary(self) -> dict[str, Any]:
        fw = self.forward_tokens
        return {
            "prefill_forwards": self.prefill_forwards,
            "prefill_tokens": self.prefill_tokens,
            "tokens_per_forward": self.prefill_tokens / len(fw) if fw else 0.0,
            "smallest_forward": min(fw, default=0),
            "groups": len(self.groups),
            "mean_group": sum(g[1] for g in self.groups) / len(self.groups) if self.groups else 0.0,
            "groups_joining_decodes": sum(1 for g in self.groups if g[0] > 0),
            "decode_steps": self.decode_steps,
            "padding_fraction": 1 - self.decode_live_rows / self.decode_rows if self.decode_rows else 0.0,
            "idle_slot_steps": self.idle_slot_steps,
            "stalled_forwards": self.stalled_forwards,
            "generated_tokens": self.generated_tokens,
        }


@dataclass
class PhaseTimer:
    """Device time of prefill forwards and decode steps (for benchmarks; set `RankEngine.timer`).

    CUDA events around each phase, read once at the end, so timing adds no synchronisation.  Every
    prefill forward is also kept with its size and whether sequences were decoding meanwhile
    (`forwards`: (tokens, sequences, refill, start, end)), so a benchmark can tell the rate of
    the first fill from that of refills.
    """

    spans: dict[str, list[tuple[object, object]]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    host: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    counts: dict[str, int] = field(
        default_factory=lambda: {"prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0}
    )
    forwards: list[tuple[int, int, bool, Any, Any]] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, device: torch.device, info: tuple[int, int, bool] | None = None) -> Iterator[None]:
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            t1 = time.perf_counter()
            self.host[name] += t1 - t0
            if info is not None:
                self.forwards.append((*info, t0, t1))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.spans[name].append((start, end))
        if info is not None:
            self.forwards.append((*info, start, end))

    def seconds(self) -> dict[str, float]:
        out = dict(self.host)
        for name, spans in self.spans.items():
            for start, end in spans:
                end.synchronize()  # type: ignore[attr-defined]
                out[name] += start.elapsed_time(end) / 1000  # type: ignore[attr-defined]
        return out

    def forward_seconds(self) -> list[tuple[int, int, bool, float]]:
        """(tokens, sequences, refill, seconds) of every prefill forward."""
        out = []
        for tokens, seqs, refill, start, end in self.forwards:
            if isinstance(start, float):
                out.append((tokens, seqs, refill, end - start))
            else:
                end.synchronize()
                out.append((tokens, seqs, refill, start.elapsed_time(end) / 1000))
        return out


class PrefillGroup:
    """The prefill of requests admitted together, on states of their own, one forward at a time.

    A forward takes a contiguous run of the group's unfinished sequences, each with its next chunk
    (at most `chunk` tokens, cut from the sequence's start, so where a prompt is cut depends only
    on its own length), up to `budget` tokens in all; the states of that run are views, so nothing
    is copied until a sequence is loaded into its slot.
    """

    def __init__(self, engine: RankCore, reqs: list[Request], chunk: int | None, budget: int | None) -> None:
        self.engine, self.reqs, self.budget = engine, reqs, budget
        self.chunk = min((c for c in (chunk, budget) if c), default=None)
        self.done = [0] * len(reqs)
        self.loaded = [False] * len(reqs)
        self.states = engine.new_states(len(reqs), max(len(r.prompt) for r in reqs))
        V = engine.cfg.vocab_size
        last = engine.comm.info.is_last_stage
        self.logits = torch.empty(len(reqs), V, dtype=torch.float32, device=engine.device) if last else None

    @property
    def finished(self) -> bool:
        return all(self.loaded)

    def ready(self) -> list[int]:
        """Rows whose prompt is done and that are not loaded yet."""
        return [i for i, r in enumerate(self.reqs) if self.done[i] == len(r.prompt) and not self.loaded[i]]

    def _take(self, i: int) -> int:
        left = len(self.reqs[i].prompt) - self.done[i]
        return left if self.chunk is None else min(self.chunk, left)

    def next_forward(self) -> tuple[int, int]:
        """Rows [a, b) of the next forward."""
        a = next(i for i, r in enumerate(self.reqs) if self.done[i] < len(r.prompt))
        b, total = a, 0
        while (
            b < len(self.reqs)
            and self._take(b) > 0  # a finished sequence ends the run: states are views of rows [a, b)
            and (b == a or self.budget is None or total + self._take(b) <= self.budget)
        ):
            total += self._take(b)
            b += 1
        return a, b

    def step(self, rows: tuple[int, int] | None = None) -> int:
        """Run the next forward (rows from `next_forward`); returns its tokens."""
        a, b = rows or self.next_forward()
        chunks = [self.reqs[i].prompt[self.done[i] : self.done[i] + self._take(i)] for i in range(a, b)]
        starts = self.done[a:b]
        ends = [s + len(c) == len(self.reqs[a + j].prompt) for j, (s, c) in enumerate(zip(starts, chunks, strict=True))]
        offsets = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0).tolist()
        want = [offsets[j + 1] - 1 for j, e in enumerate(ends) if e]
        batch = self.engine.batch(chunks, starts, decode=False, logits_index=want)
        logits = self.engine.model.forward(batch, {i: st.rows(a, b) for i, st in self.states.items()})
        if logits is not None and self.logits is not None and want:
            rows_done = torch.tensor([a + j for j, e in enumerate(ends) if e], device=self.engine.device)
            self.logits[rows_done] = logits
        for j, c in enumerate(chunks):
            self.done[a + j] += len(c)
        return sum(map(len, chunks))


class Intake(Protocol):
    """Where an online loop's arrivals come from (`online`): the same commands on every rank."""

    def take(self, loop: GenerationLoop, block: bool) -> None:
        """Apply what arrived (submissions, cancellations, scores, stop) to `loop`."""
        ...


class GenerationLoop:
    """One rank's continuous-batching loop over one slot pool."""

    def __init__(
        self,
        engine: RankCore,
        runner: DecodeRunner,
        sched: Scheduler,
        options: GenerateOptions,
        intake: Intake | None = None,
        on_updates: OnUpdates | None = None,
        stats: LoopStats | None = None,
    ) -> None:
        self.engine, self.runner, self.sched, self.options = engine, runner, sched, options
        self.intake, self.on_updates = intake, on_updates
        self.stats = stats if stats is not None else LoopStats()
        self.stopping = intake is None  # no more arrivals: finish what is there
        pin = engine.device.type == "cuda"
        self.ring = torch.zeros(RING_ROWS, runner.slots, dtype=torch.long, pin_memory=pin)
        self.ring_next = 0
        self.group: PrefillGroup | None = None
        self.budget = engine.prefill_tokens
        self.refill_slots = max(1, math.ceil(len(sched.slot_owner) * options.refill_fraction))

    # ---- the loop --------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing to compute and nothing in flight: only an arrival can give work."""
        s = self.sched
        return self.group is None and not s.pending and not s.active() and not s.records

    def run(self) -> None:
        sched, k = self.sched, self.options.sync_every
        while True:
            if self.intake is not None:
                self.intake.take(self, block=self.idle() and not self.stopping)
                self._report()
            if self.stopping and sched.done and self.group is None and not sched.records:
                break
            if self.group is None and self._worth_admitting():
                reqs = sched.admit(self.budget)
                stamp(reqs, "scheduled")
                self.stats.groups.append((len(sched.active()), len(reqs), len(sched.pending)))
                self.group = PrefillGroup(self.engine, reqs, self.engine.prefill_chunk, self.budget)
            if self.group is not None and all(r.closed for r in self.group.reqs):
                for r in self.group.reqs:  # every request of the group was cancelled: drop it
                    sched.release(r)
                self.group = None
            if self.group is not None:
                self._prefill_step(self.group)
            active = sched.active()
            if active:
                self._compact()
                waiting = self.group is not None or self._worth_admitting()
                burst = 1 if waiting else sched.burst(k)
                mode = covering_mode({mode_of(r.temperature, r.top_p) for r in active})
                with self._timed("decode"):
                    for _ in range(burst):
                        self._decode_step(mode)
                sched.drain_until(sched.steps - 1 - k)
            elif self.group is None:
                sched.drain_all()  # nothing left to run: wait for the tokens still in flight
            if len(sched.records) >= RING_ROWS - 2:
                sched.drain_until(sched.records[0].number)
            self._report()
        if self.engine.timer is not None:
            self.engine.timer.counts["generated_tokens"] += self.stats.generated_tokens

    def _report(self) -> None:
        updates = self.sched.take_updates()
        self.stats.generated_tokens += sum(len(u.tokens) for u in updates)
        if updates and self.on_updates is not None:
            self.on_updates(updates)

    # ---- admission -------------------------------------------------------------------------------
    def _worth_admitting(self) -> bool:
        """The refill rule of the module doc: (a) nothing decodes, (b) an eighth of the slots is
        free or every waiting request fits, (c) the free slots take a full prefill forward."""
        sched = self.sched
        if self.group is not None or not sched.can_admit():
            return False
        if not sched.active():
            return True
        free = len(sched.free_slots())
        if free >= min(len(sched.pending), self.refill_slots):
            return True
        return self.budget is not None and sched.pending_tokens(free) >= self.budget

    def _prefill_step(self, group: PrefillGroup) -> None:
        rows = group.next_forward()
        decoding = bool(self.sched.active())
        tokens = sum(group._take(i) for i in range(*rows))
        with self._timed("prefill", (tokens, rows[1] - rows[0], decoding)):
            group.step(rows)
        st = self.stats
        st.prefill_forwards += 1
        st.prefill_tokens += tokens
        st.prefill_chunks += rows[1] - rows[0]
        st.forward_tokens.append(tokens)
        st.stalled_forwards += decoding
        if self.engine.timer is not None:
            self.engine.timer.counts["prefill_tokens"] += tokens
        ready = group.ready()
        if ready:
            self._load(group, ready)
        if group.finished:
            self.group = None

    @contextmanager
    def _timed(self, name: str, info: tuple[int, int, bool] | None = None) -> Iterator[None]:
        timer = self.engine.timer
        if timer is None:
            yield
            return
        with timer.phase(name, self.engine.device, info):
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

    def _load(self, group: PrefillGroup, rows: list[int]) -> None:
        """Sample the first tokens of these finished rows and put them into their slots (a row whose
        request was cancelled meanwhile gives its slot back instead)."""
        eng = self.engine
        for i in rows:
            group.loaded[i] = True
        keep = [i for i in rows if not group.reqs[i].closed]
        for i in rows:
            if group.reqs[i].closed:
                self.sched.release(group.reqs[i])
        if not keep:
            return
        reqs = [group.reqs[i] for i in keep]
        n = len(reqs)
        dev = eng.device
        index = torch.tensor(keep, dtype=torch.long, device=dev)
        first, logits = None, None
        if group.logits is not None:
            logits = group.logits[index]
            keys = torch.tensor([r.key for r in reqs], dtype=torch.long, device=dev)
            temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
            tops = torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=dev)
            mode = covering_mode({mode_of(r.temperature, r.top_p) for r in reqs})
            first = select_rows(logits, keys, torch.zeros(n, dtype=torch.long, device=dev), temps, tops, mode)
        first = eng.share(first, (n,), torch.long)
        contiguous = keep == list(range(keep[0], keep[0] + n))
        states = {
            layer: st.rows(keep[0], keep[0] + n) if contiguous else st.select(index)
            for layer, st in group.states.items()
        }
        slots = [r.slot for r in reqs]
        assert all(s is not None for s in slots)
        self.runner.admit(
            slots,
            states,
            first,
            [len(r.prompt) for r in reqs],
            [r.key for r in reqs],  # type: ignore[arg-type]
            [r.temperature for r in reqs],
            [r.top_p for r in reqs],
        )
        for r in reqs:
            r.live = True
        stamp(reqs, "prefilled")
        self._record(first, [r.index for r in reqs], logits)
        self.sched.issue(reqs)

    # ---- decode ----------------------------------------------------------------------------------
    def _decode_step(self, mode: str) -> None:
        sched = self.sched
        high = sched.high_water()
        B = self.runner.bucket(high)
        owners = [o if o is not None and sched.requests[o].issuing else None for o in sched.slot_owner[:B]]
        nxt, logits = self.runner.step(B, mode, live=high)
        st = self.stats
        st.decode_steps += 1
        st.decode_rows += B
        live = sum(o is not None for o in owners)
        st.decode_live_rows += live
        if sched.pending:
            st.idle_slot_steps += len(sched.free_slots())
        if self.engine.timer is not None:
            self.engine.timer.counts["decode_steps"] += 1
        self._record(nxt, owners, logits)
        sched.issue([sched.requests[o] for o in owners if o is not None])

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


def stamp(reqs: Sequence[Request], stage: str) -> None:
    """The time a traced request reached `stage` (a dict lookup per request when nothing is traced)."""
    now = None
    for r in reqs:
        if r.stamps is not None:
            now = now or time.monotonic()
            r.stamps.setdefault(stage, now)


def make_requests(
    prompts: Sequence[Sequence[int]],
    max_new: Sequence[int],
    seed: int,
    keys: Sequence[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: StopFn | None = None,
) -> list[Request]:
    """Requests in input order; sampling streams keyed on (seed, caller's request key)."""
    ids = range(len(prompts)) if keys is None else keys
    t, p = sampling_settings(temperature, top_p)
    return [
        Request(i, list(pr), int(m), request_key(seed, int(key)), temperature=t, top_p=p, stop=stop)
        for i, (pr, m, key) in enumerate(zip(prompts, max_new, ids, strict=True))
    ]


def generate_job(rt: Any, prompts: list[list[int]], max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """`launch()` job (torchrun ranks): the tokens of `Runtime.generate`."""
    return rt.generate(prompts, max_new_tokens, **kwargs).tokens
