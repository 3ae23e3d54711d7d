"""Requests that arrive while the loop runs: the thread-safe, synchronous core an asyncio server
(`serve/engine_api.py`'s `Engine`) wraps.

    loop = OnlineLoop(runtime, max_batch="auto", max_context=4096)
    loop.start()
    handle = loop.submit(GenerationRequest("r1", prompt_ids, max_tokens=64, temperature=0.7, stop=("\\n\\n",)))
    for event in handle:            # or on_event= / on_batch= callbacks, called on the loop's thread
        ...                         # event.token_ids, event.finished, event.finish_reason, event.stop_reason
    loop.cancel("r1")               # frees the slot at the loop's next iteration
    loop.close()

One loop: `OnlineLoop` runs the same `generation.GenerationLoop` as `Runtime.generate`, with an
intake instead of a closed list of requests.  Per request: its own sampling settings
(temperature, top_p, seed, stream; one decode graph per bucket and sampling *mode* serves every
mix, see `sampling`), stop strings, max_tokens, and prompt logprobs (computed by the `score` path,
`RankEngine.token_scores`, when the request arrives).  Events come per drained batch of tokens
(every `sync_every` decode steps), never per token; `on_batch` gets each drain's events at once.

SPMD: every rank runs the loop and must see the same arrivals at the same iteration.  Only rank 0
(the process that serves HTTP) receives requests; at the top of every loop iteration it takes what
arrived and hands the same list of commands to the other ranks: to thread ranks through a shared
board (`LocalBoard`), to torchrun ranks by a broadcast on a gloo group (`RankEngine.control`;
while idle, rank 0 sends an empty list every `heartbeat` seconds so the others never time out).
Commands carry everything as data (request ids, token ids, settings, the seed rank 0 picked for a
request without one), so the ranks' schedules, and therefore their collectives, stay identical.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch.distributed as dist

from ...errors import UserError
from ...generation_request import GenerationRequest, sampling_settings
from .engine import RankEngine, Runtime, TokenScores
from .generation import GenerationLoop, LoopStats
from .memory import BatchPlan
from .sampling import request_key
from .scheduler import Request, Update
from .text import StopStringWatcher, decode_kept_specials, earliest_stop, stop_token_ids

FinishReason = Literal["stop", "length", "cancelled"]
DEFAULT_MAX_CONTEXT = 4096
HEARTBEAT_S = 1.0


# ---- what crosses the API ------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptLogprobs:
    """Per prompt position p >= 1: log p(prompt[p] | prompt[:p]) and the top-k (id, logprob) pairs
    from the same float32 log-softmax (position 0 has none)."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class Event:
    """New tokens of one request, found at one drain; the last event has `finished` set."""

    request_id: str
    token_ids: tuple[int, ...]  # in order; EOS and a stop string's last token included
    finished: bool = False
    finish_reason: FinishReason | None = None  # "stop" (EOS id or stop string), "length", "cancelled"
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # first event of a request that asked
    error: str | None = None  # the loop failed; the request is over
    stamps: dict[str, float] | None = None  # `OnlineLoop.trace`: when the loop took, scheduled, prefilled, drained it


@dataclass(frozen=True)
class OnlineStats:
    waiting: int  # accepted, not yet holding a slot
    running: int  # holding a slot (being prefilled or decoding)


class RequestHandle:
    """A submitted request: its events in a queue (iterate it), its tokens so far, and `result()`."""

    def __init__(self, request: GenerationRequest, on_event: Callable[[Event], None] | None) -> None:
        self.request, self.on_event = request, on_event
        self.events: queue.Queue[Event] = queue.Queue()
        self.tokens: list[int] = []
        self.final: Event | None = None
        self.done = threading.Event()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _push(self, event: Event) -> None:
        self.tokens.extend(event.token_ids)
        if event.finished:
            self.final = event
        self.events.put(event)
        if self.on_event is not None:
            self.on_event(event)
        if event.finished:
            self.done.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> Event:
        """The last event (after waiting for it); `tokens` holds every token."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        assert self.final is not None
        return self.final


# ---- commands: what rank 0 hands every rank ------------------------------------------------------
@dataclass
class Submit:
    request: GenerationRequest
    index: int  # the loop's id for it, the same on every rank
    seed: int
    watcher: Any = field(default=None, compare=False)  # built once per process (thread ranks share it)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "watcher": None}


@dataclass
class Cancel:
    request_id: str


@dataclass
class Score:
    job: int
    seqs: list[list[int]]
    starts: list[int]
    top_k: int


@dataclass
class Stop:
    cancel: bool  # cancel what is still running (else finish it first)


Command = Submit | Cancel | Score | Stop


class Inbox:
    """Rank 0's queue of commands, filled by any thread."""

    def __init__(self) -> None:
        self.items: list[Command] = []
        self.cond = threading.Condition()

    def put(self, cmd: Command) -> None:
        with self.cond:
            self.items.append(cmd)
            self.cond.notify_all()

    def take(self, block: bool, timeout: float | None) -> list[Command]:
        with self.cond:
            if block and not self.items:
                self.cond.wait_for(lambda: bool(self.items), timeout)
            out, self.items = self.items, []
            return out


class LocalBoard:
    """Thread ranks: rank 0 publishes each iteration's commands, the other ranks read them."""

    def __init__(self, readers: int, failed: threading.Event | None) -> None:
        self.readers, self.failed = readers, failed
        self.batches: dict[int, list[Command]] = {}
        self.reads: dict[int, int] = {}
        self.cond = threading.Condition()

    def publish(self, n: int, cmds: list[Command]) -> None:
        if self.readers == 0:
            return
        with self.cond:
            self.batches[n], self.reads[n] = cmds, 0
            self.cond.notify_all()

    def read(self, n: int) -> list[Command]:
        with self.cond:
            while n not in self.batches:
                if self.failed is not None and self.failed.is_set():
                    raise threading.BrokenBarrierError("another rank failed")
                self.cond.wait(0.5)
            cmds = self.batches[n]
            self.reads[n] += 1
            if self.reads[n] == self.readers:
                del self.batches[n], self.reads[n]
            return cmds


class RankIntake:
    """One rank's side of the intake (`generation.Intake`): the same commands at the same iteration
    on every rank, applied to its loop."""

    def __init__(self, host: OnlineLoop, engine: RankEngine) -> None:
        self.host, self.engine = host, engine
        self.rank = engine.comm.info.rank
        self.iteration = 0

    def _exchange(self, block: bool) -> list[Command]:
        host, n = self.host, self.iteration
        self.iteration += 1
        if self.engine.control is not None:  # torchrun ranks
            box: list[Any] = [None]
            if self.rank == 0:
                box[0] = host.inbox.take(block, host.heartbeat if block else None)
            dist.broadcast_object_list(box, src=0, group=self.engine.control)
            return box[0]
        if self.rank == 0:
            cmds = host.inbox.take(block, None)
            host.board.publish(n, cmds)
            return cmds
        return host.board.read(n)

    def take(self, loop: GenerationLoop, block: bool) -> None:
        if self.rank == 0:  # what the loop holds now: an idle loop blocks next, and its gauges must read 0 meanwhile
            self.host._publish_stats(loop)
        for cmd in self._exchange(block):
            if isinstance(cmd, Submit):
                self._submit(loop, cmd)
            elif isinstance(cmd, Cancel):
                index = loop.sched.by_tag.get(cmd.request_id)
                if index is not None:
                    loop.sched.cancel(index)
            elif isinstance(cmd, Score):
                scores = self.engine.token_scores(cmd.seqs, cmd.starts, cmd.top_k)
                if self.rank == 0:
                    self.host._scored(cmd.job, scores)
            elif isinstance(cmd, Stop):
                loop.stopping = True
                if cmd.cancel:
                    for index in [*loop.sched.pending, *(o for o in loop.sched.slot_owner if o is not None)]:
                        loop.sched.cancel(index)
        if self.rank == 0:
            self.host._publish_stats(loop)

    def _submit(self, loop: GenerationLoop, cmd: Submit) -> None:
        req = cmd.request
        if loop.stopping:  # arrived after a stop: refused the same way on every rank
            if self.rank == 0:
                self.host._refuse(req.request_id, "the loop is stopping")
            return
        if req.prompt_logprobs is not None:
            scores = self.engine.token_scores([list(req.prompt_token_ids)], [1], req.prompt_logprobs)[0]
            if self.rank == 0:
                self.host._prompt_logprobs(req.request_id, scores)
        stop = None
        if req.stop:
            if cmd.watcher is None:
                cmd.watcher = StopStringWatcher(self.host.decode, req.stop)
            stop = cmd.watcher
        t, p = sampling_settings(req.temperature, req.top_p)
        key = request_key(cmd.seed, req.stream)
        stamps = {"taken": time.monotonic()} if self.rank == 0 and self.host.trace else None
        loop.sched.add(
            [
                Request(
                    cmd.index,
                    list(req.prompt_token_ids),
                    int(req.max_tokens),
                    key,
                    temperature=t,
                    top_p=p,
                    stop=stop,
                    tag=req.request_id,
                    eos=frozenset() if req.ignore_eos else None,
                    stamps=stamps,
                )
            ]
        )


# ---- the host side ---------------------------------------------------------------------------------
class OnlineLoop:
    """The continuous-batching loop taking requests while it runs (see the module doc).

    Every method is thread-safe.  Callbacks (`on_event` per request, `on_batch` per drain) run on
    the loop's thread and must not block; `cancel`, `stats` and `submit` never wait for the device.
    Under torchrun every rank builds and starts its own `OnlineLoop`; only rank 0's takes requests,
    the others run until rank 0 closes (`join`).
    """

    def __init__(
        self,
        runtime: Runtime,
        max_batch: int | str = "auto",
        max_context: int | None = None,
        sync_every: int = 8,
        eos_token_ids: Sequence[int] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        on_batch: Callable[[list[Event]], None] | None = None,
        memory_budget: int | None = None,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        self.runtime = runtime
        positions = int(runtime.config.max_position_embeddings)
        self.capacity = min(int(max_context or DEFAULT_MAX_CONTEXT), positions)
        if max_batch == "auto":
            self.plan: BatchPlan | None = runtime.auto_batch_size(self.capacity, memory_budget)
            self.max_batch = self.plan.slots
        else:
            self.plan, self.max_batch = None, int(max_batch)
        if self.max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {self.max_batch}")
        self.sync_every = max(1, int(sync_every))
        self._tokenizer: Any = None
        if eos_token_ids is None:
            eos_token_ids = stop_token_ids(runtime.path, runtime.tokenizer)
        self.eos = tuple(int(t) for t in eos_token_ids)
        self.decode = decode or decode_kept_specials(runtime.tokenizer)
        self.on_batch, self.heartbeat = on_batch, heartbeat
        self.trace = False  # stamp every request's stages (Event.stamps, first event): serve's PLAMO2_SERVE_TRACE
        self.on_stats: Callable[[OnlineStats], None] | None = None  # on the loop's thread when `stats()` changes
        self.inbox = Inbox()
        world = getattr(runtime, "world", None)
        readers = len(runtime.engines) - 1 if runtime.mode != "dist" else 0
        self.board = LocalBoard(readers, getattr(world, "failed", None))
        self.lock = threading.Lock()
        self.handles: dict[str, RequestHandle] = {}
        self.jobs: dict[int, tuple[threading.Event, list[Any]]] = {}
        self.counter = itertools.count()
        self.job_counter = itertools.count()
        self._stats = OnlineStats(0, 0)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.closed = False

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def loop_stats(self) -> LoopStats:
        """What this loop did so far (rank 0's counters; the same on every rank)."""
        return self.runtime.engines[0].serving_stats

    def start(self) -> OnlineLoop:
        if self.thread is not None:
            raise RuntimeError("the online loop was started already")
        if self.runtime.online is not None:
            raise UserError("another online loop serves this runtime")
        self.runtime.online = self
        self.thread = threading.Thread(target=self._main, name="plamo2-online", daemon=True)
        self.thread.start()
        return self

    def _main(self) -> None:
        rt = self.runtime
        try:
            rt._spmd(
                "serve",
                lambda engine: RankIntake(self, engine),
                self.max_batch,
                self.capacity,
                self.eos,
                self.sync_every,
                self._deliver,
            )
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            self.error = e
            self._fail_all(f"the generation loop failed: {e!r}")
        finally:
            rt.online = None
            self._fail_all("the generation loop stopped")

    def close(self, cancel: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; `cancel` ends the running ones now, else they finish first.  Waits
        for the loop's thread (rank 0; other torchrun ranks: `join`)."""
        if self.thread is None:
            self.runtime.online = None if self.runtime.online is self else self.runtime.online
            return
        with self.lock:
            self.closed = True
        if self.is_main:
            self.inbox.put(Stop(cancel))
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError("the online loop did not stop in time")
        if self.error is not None and not isinstance(self.error, KeyboardInterrupt):
            raise self.error

    def __enter__(self) -> OnlineLoop:
        return self.start() if self.thread is None else self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(cancel=True)

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None] | None = None) -> RequestHandle:
        """Queue a request (rank 0 only); its events arrive in the returned handle (and on_event)."""
        if not self.is_main:
            raise UserError("requests go to rank 0's online loop")
        prompt = tuple(int(t) for t in request.prompt_token_ids)
        request.check(self.runtime.config.vocab_size, self.capacity)  # the rule the server applies too
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        with self.lock:
            if self.closed or self.error is not None or not self.alive:
                raise UserError("the online loop is not running")
            if request.request_id in self.handles:
                raise UserError(f"request id {request.request_id!r} is already running")
            handle = RequestHandle(request, on_event)
            self.handles[request.request_id] = handle
            self.inbox.put(Submit(replace(request, prompt_token_ids=prompt), next(self.counter), seed))
        return handle

    def cancel(self, request_id: str) -> None:
        """End a request at the loop's next iteration (its slot is free for the next one); a no-op
        for an unknown or finished id.  Never blocks."""
        with self.lock:
            if request_id in self.handles:
                self.inbox.put(Cancel(request_id))

    def token_scores(
        self, seqs: Sequence[Sequence[int]], starts: Sequence[int], top_k: int = 0, timeout: float | None = None
    ) -> list[TokenScores]:
        """`Runtime.token_scores` run inside the loop between two of its iterations (prompt
        logprobs for echo / loglikelihood); blocks the calling thread until done."""
        with self.lock:
            if self.closed or not self.alive:
                raise UserError("the online loop is not running")
            job = next(self.job_counter)
            done, box = threading.Event(), []
            self.jobs[job] = (done, box)
            self.inbox.put(Score(job, [list(s) for s in seqs], list(starts), int(top_k)))
        if not done.wait(timeout):
            raise TimeoutError("scoring did not finish in time")
        if not box:
            raise UserError("the online loop stopped before scoring")
        return box[0]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise UserError(
            "Runtime.generate cannot run while an online loop serves the runtime: submit the "
            "requests to the loop (OnlineLoop.submit) or close it first"
        )

    def stats(self) -> OnlineStats:
        return self._stats

    # ---- called on the loop's thread (rank 0) ----------------------------------------------------
    def _publish_stats(self, loop: GenerationLoop) -> None:
        stats = OnlineStats(len(loop.sched.pending), loop.sched.running)
        if stats != self._stats:
            self._stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)

    def _deliver(self, updates: list[Update]) -> None:
        events = []
        for u in updates:
            handle = self.handles.get(u.tag)
            if handle is None:
                continue
            reason: str | int | None = u.stop_reason
            if u.stop_hit and handle.request.stop:
                text = self.decode([*handle.tokens, *u.tokens])
                reason = earliest_stop(text, handle.request.stop)
            stamps = None
            if u.stamps is not None:
                stamps = {**u.stamps, "drained": time.monotonic()}
            event = Event(u.tag, u.tokens, u.finished, u.finish_reason, reason, stamps=stamps)  # type: ignore[arg-type]
            if u.finished:
                with self.lock:
                    self.handles.pop(u.tag, None)
            handle._push(event)
            events.append(event)
        if events and self.on_batch is not None:
            self.on_batch(events)

    def _prompt_logprobs(self, request_id: str, scores: TokenScores) -> None:
        handle = self.handles.get(request_id)
        if handle is None:
            return
        top = tuple(
            tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True))
            for ids, vals in zip(scores.top_ids, scores.top_logprobs, strict=True)
        )
        lp = PromptLogprobs(tuple(float(x) for x in scores.logprobs.tolist()), top)
        event = Event(request_id, (), prompt_logprobs=lp)
        handle._push(event)
        if self.on_batch is not None:
            self.on_batch([event])

    def _scored(self, job: int, scores: list[TokenScores]) -> None:
        with self.lock:
            done, box = self.jobs.pop(job)
        box.append(scores)
        done.set()

    def _refuse(self, request_id: str, why: str) -> None:
        with self.lock:
            handle = self.handles.pop(request_id, None)
        if handle is not None:
            handle._push(Event(request_id, (), True, "cancelled", error=why))

    def _fail_all(self, why: str) -> None:
        with self.lock:
            handles, self.handles = list(self.handles.values()), {}
            jobs, self.jobs = list(self.jobs.values()), {}
            self.closed = True
        for h in handles:
            h._push(Event(h.request_id, (), True, None, error=why))
        for done, _ in jobs:
            done.set()
