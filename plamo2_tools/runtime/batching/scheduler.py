"""Host-side bookkeeping of continuous batching: which request sits in which decode slot, which
tokens belong to whom, and when a request is finished.  No tensors are computed here.

The device runs ahead of the host.  Every decode step (and every prefill's first token) leaves a
`Record`: the step's token ids being copied asynchronously to host memory, an event that marks the
copy done, and a snapshot of which request each row belonged to.  The host drains records in order
*at fixed step counts* (`drain_until`), so every rank of an SPMD run sees the same tokens at the
same step and takes the same decisions, and no step waits for the device unless the host is more
than `lag` steps ahead.

Finishing:
* by length: known on the host when the step is issued, so the slot is freed (and can be refilled)
  at once, without looking at any token;
* by an EOS id or a stop string: found when the record is drained, up to `lag` steps late.  The
  slot kept computing for the request in between; those tokens are simply dropped, so the result
  is exactly that of checking after every token (the first EOS is kept, a stop string is checked
  at every prefix through `first_stop`);
* by cancellation (`cancel`): at once; a request still waiting never runs, one being prefilled
  keeps its slot until its group is loaded (then gives it back), one decoding gives its slot back
  and its tokens in flight are dropped.

Requests may arrive while the loop runs (`add`); each drain reports what changed as `Update`s,
once per request per drain, for the callbacks of `generation.GenerationLoop`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Tensor = torch.Tensor
StopFn = Callable[[int, list[int]], bool]
OnToken = Callable[[int, int], None]
FinishReason = str  # "stop" (EOS id or stop string), "length", "cancelled"


class ChunkStop(Protocol):
    """A stop callback that can also check many new tokens at once (see `first_stop`)."""

    def __call__(self, i: int, tokens: list[int]) -> bool: ...

    def first_hit(self, i: int, tokens: list[int], checked: int) -> int | None: ...


def first_stop(stop: StopFn, i: int, tokens: list[int], checked: int) -> int | None:
    """The smallest n in (checked, len(tokens)] with stop(i, tokens[:n]), or None.

    Callbacks with a `first_hit` method answer for the whole span at once (one decode of a tail);
    plain ones are asked once per new token, exactly as a token-by-token loop would.
    """
    if checked >= len(tokens):
        return None
    fast = getattr(stop, "first_hit", None)
    if fast is not None:
        return fast(i, tokens, checked)
    return next((n for n in range(checked + 1, len(tokens) + 1) if stop(i, tokens[:n])), None)


@dataclass
class Request:
    index: int  # the loop's id of the request (generate: position in the caller's list)
    prompt: list[int]
    max_new: int
    key: int  # sampling stream (see sampling.request_key)
    temperature: float = 0.0  # <= 0: greedy
    top_p: float = 1.0
    stop: StopFn | None = None  # this request's stop(index, tokens) (else the scheduler's)
    tag: Any = None  # the caller's handle (online: the request id)
    eos: frozenset[int] | None = None  # this request's EOS ids (else the scheduler's; empty: ignore EOS)
    tokens: list[int] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)
    issued: int = 0  # tokens the device was asked to produce
    slot: int | None = None
    live: bool = False  # prefilled and loaded into its slot
    closed: bool = False  # the final tokens are known
    checked: int = 0  # tokens already tested against the stop callback
    reported: int = 0  # tokens already handed to the callbacks
    final_reported: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the EOS id that ended it (stop strings: see `stop_hit`)
    stop_hit: bool = False  # ended by the stop callback
    stamps: dict[str, float] | None = None  # traced requests only (serve's PLAMO2_SERVE_TRACE): stage -> time

    @property
    def issuing(self) -> bool:
        return self.live and self.slot is not None and self.issued < self.max_new and not self.closed


@dataclass(frozen=True)
class Update:
    """What one drain found for one request: its new tokens, and how it ended if it did."""

    index: int
    tag: Any
    tokens: tuple[int, ...]  # new since the last update (EOS and a stop string's last token included)
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the EOS id, when that ended it
    stop_hit: bool = False  # ended by the stop callback (a stop string)
    stamps: dict[str, float] | None = None  # a traced request's stage times, with its first update only


@dataclass
class Record:
    """One device step's token ids on their way to the host."""

    number: int
    tokens: Tensor  # (rows,) int64, host memory (pinned on CUDA)
    event: Any  # torch.cuda.Event, or None when the copy was synchronous
    owners: list[int | None]  # request index of each row, None for rows nobody reads
    logits: Tensor | None = None  # (rows, V) float32 on the CPU, when asked for


class Scheduler:
    """Requests, slots and records of one generation loop (the same on every rank)."""

    def __init__(
        self,
        requests: Sequence[Request],
        slots: int,
        eos: Sequence[int],
        stop: StopFn | None,
        on_token: OnToken | None = None,
        keep_finished: bool = True,
    ) -> None:
        self.requests: dict[int, Request] = {}
        self.by_tag: dict[Any, int] = {}  # the caller's handle -> index (requests that have one)
        self.pending: deque[int] = deque()
        self.slot_owner: list[int | None] = [None] * slots
        self.eos, self.stop, self.on_token = set(eos), stop, on_token
        self.keep_finished = keep_finished  # False (online): forget a request once it was reported
        self.records: deque[Record] = deque()
        self.steps = 0  # records made so far (their numbers)
        self.updates: list[Update] = []  # found since the last `take_updates`
        self.add(requests)

    # ---- state -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.pending and all(r.closed for r in self.requests.values())

    @property
    def running(self) -> int:
        """Requests holding a slot (being prefilled or decoding)."""
        return sum(o is not None for o in self.slot_owner)

    def free_slots(self) -> list[int]:
        return [s for s, owner in enumerate(self.slot_owner) if owner is None]

    def active(self) -> list[Request]:
        """Requests whose slot still issues tokens, in slot order."""
        reqs = [self.requests[o] for o in self.slot_owner if o is not None]
        return [r for r in reqs if r.issuing]

    def high_water(self) -> int:
        """1 + the highest slot in use (the decode batch must cover it)."""
        used = [s for s, owner in enumerate(self.slot_owner) if owner is not None]
        return used[-1] + 1 if used else 0

    def can_admit(self) -> bool:
        return bool(self.pending) and None in self.slot_owner

    def pending_tokens(self, n: int) -> int:
        """Prompt tokens of the next n waiting requests."""
        return sum(len(self.requests[i].prompt) for i in list(self.pending)[:n])

    # ---- arrivals, admission, cancellation -----------------------------------------------------
    def add(self, requests: Sequence[Request]) -> None:
        """New requests, waiting in arrival order (one with nothing to generate is closed at once)."""
        for r in requests:
            if r.index in self.requests:
                raise ValueError(f"request {r.index} is already in the loop")
            self.requests[r.index] = r
            if r.tag is not None:
                self.by_tag[r.tag] = r.index
            if r.max_new > 0:
                self.pending.append(r.index)
            else:
                self._close(r, 0, "length")
                self._report(r)

    def admit(self, token_budget: int | None) -> list[Request]:
        """Next requests for the free slots (lowest first), at most `token_budget` prompt tokens
        together (always at least one request)."""
        group: list[Request] = []
        total = 0
        for slot in self.free_slots():
            if not self.pending:
                break
            req = self.requests[self.pending[0]]
            if group and token_budget is not None and total + len(req.prompt) > token_budget:
                break
            self.pending.popleft()
            req.slot = slot
            self.slot_owner[slot] = req.index
            total += len(req.prompt)
            group.append(req)
        return group

    def cancel(self, index: int) -> bool:
        """End a request now; False if it is unknown or already finished."""
        r = self.requests.get(index)
        if r is None or r.closed:
            return False
        if index in self.pending:
            self.pending.remove(index)
        self._close(r, len(r.tokens), "cancelled")
        self._report(r)
        return True

    def issue(self, reqs: Sequence[Request]) -> None:
        """One more token was asked of each request; a request that reached its limit gives its
        slot back now (its tokens are still on their way)."""
        for r in reqs:
            r.issued += 1
            if r.issued >= r.max_new:
                self._release(r)

    def burst(self, k: int) -> int:
        """How many decode steps to run before looking again: at most k, no more than any live
        request still needs, and, when requests are waiting, no more than until the first slot is
        freed by length."""
        left = [r.max_new - r.issued for r in self.active()]
        if not left:
            return 0
        return max(1, min(k, min(left) if self.pending else max(left)))

    def move(self, src: int, dst: int) -> None:
        owner = self.slot_owner[src]
        assert owner is not None and self.slot_owner[dst] is None
        self.slot_owner[dst], self.slot_owner[src] = owner, None
        self.requests[owner].slot = dst

    def release(self, r: Request) -> None:
        """Give back the slot of a request that will not be loaded (cancelled in its group)."""
        self._release(r)

    def _release(self, r: Request) -> None:
        if r.slot is not None and self.slot_owner[r.slot] == r.index:
            self.slot_owner[r.slot] = None
        r.slot = None

    # ---- records -------------------------------------------------------------------------------
    def record(self, tokens: Tensor, event: Any, owners: list[int | None], logits: Tensor | None = None) -> None:
        self.records.append(Record(self.steps, tokens, event, owners, logits))
        self.steps += 1

    def drain_until(self, number: int) -> None:
        """Take in every record numbered <= `number` (waiting for its copy if need be), then check
        the stop callbacks on the new tokens."""
        touched: dict[int, int] = {}  # request -> tokens it had before (for on_token)
        while self.records and self.records[0].number <= number:
            rec = self.records.popleft()
            if rec.event is not None:
                rec.event.synchronize()
            values = rec.tokens.tolist()
            for row, owner in enumerate(rec.owners):
                if owner is None:
                    continue
                r = self.requests.get(owner)
                if r is None or r.closed:
                    continue
                touched.setdefault(owner, len(r.tokens))
                self._accept(r, values[row], None if rec.logits is None else rec.logits[row])
        for owner, before in touched.items():
            r = self.requests[owner]
            self._check_stop(r)
            if self.on_token is not None:
                for t in r.tokens[before:]:
                    self.on_token(r.index, t)
            self._report(r)

    def drain_all(self) -> None:
        self.drain_until(self.steps)

    def take_updates(self) -> list[Update]:
        """What changed since the last call; finished requests are forgotten unless kept."""
        out, self.updates = self.updates, []
        if not self.keep_finished:
            for u in out:
                if u.finished:
                    self.requests.pop(u.index, None)
                    if u.tag is not None and self.by_tag.get(u.tag) == u.index:
                        del self.by_tag[u.tag]
        return out

    def _report(self, r: Request) -> None:
        new = tuple(r.tokens[r.reported :])
        if r.final_reported or (not new and not r.closed):
            return
        stamps = r.stamps if r.reported == 0 and not r.final_reported else None
        r.reported, r.final_reported = len(r.tokens), r.closed
        self.updates.append(Update(r.index, r.tag, new, r.closed, r.finish_reason, r.stop_reason, r.stop_hit, stamps))

    def _accept(self, r: Request, token: int, logits: Tensor | None) -> None:
        r.tokens.append(token)
        if logits is not None:
            r.logits.append(logits)
        if token in (self.eos if r.eos is None else r.eos):
            r.stop_reason = token
            self._close(r, len(r.tokens), "stop")
        elif len(r.tokens) >= r.max_new:
            self._close(r, len(r.tokens), "length")

    def _check_stop(self, r: Request) -> None:
        stop = r.stop if r.stop is not None else self.stop
        if stop is None:
            return
        # A request closed by EOS or length still has its last tokens checked: the original loop
        # asked the stop callback about every token it kept.
        hit = first_stop(stop, r.index, r.tokens, r.checked)
        r.checked = len(r.tokens)
        if hit is not None:
            r.stop_reason, r.stop_hit = None, True
            self._close(r, hit, "stop")

    def _close(self, r: Request, keep: int, reason: FinishReason) -> None:
        del r.tokens[keep:]
        del r.logits[keep:]
        r.checked = min(r.checked, keep)
        r.closed = True
        r.finish_reason = reason
        if r.live or r.slot is None:
            self._release(r)
        # else: cancelled in its prefill group, which gives the slot back when it loads
