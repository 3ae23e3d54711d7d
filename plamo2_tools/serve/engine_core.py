"""The model process's side of `plamo2-tools serve` (docs/serve.md, "Two processes"): the online
loop, fed over a pipe by the HTTP process (`front`) and answering with one message per drain.

Why a process of its own: the HTTP layer (parsing, JSON, SSE writes for hundreds of streams) and
the loop (hundreds of small host calls per decode step, each of which lets go of the GIL) shared
one interpreter.  Every time the loop gave the GIL away, getting it back from a busy HTTP thread
could take Python's switch interval (5 ms) against decode steps of 1.5-3.5 ms on a GPU; and a
collection of the cyclic GC over the whole start-up heap held both for ~0.6 s.  Here the loop's
thread shares its interpreter only with two threads that do almost nothing: a reader that hands
what arrives to the loop's inbox, and a writer that sends what the loop made.

    core = EngineCore(runtime, options, pipe)
    core.start()                 # the loop, one warm-up request, the heap frozen
    core.ready(info, banner)     # the HTTP process may now serve
    core.serve()                 # until the HTTP process says stop (or goes away)
    core.close()
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from ..errors import UserError
from ..runtime.batching.engine import Runtime
from ..runtime.batching.online import Event, OnlineStats
from .engine_api import EngineError, ModelInfo
from .loop_engine import freeze_heap
from .pipe import Message, Pipe, request_from
from .runtime_engine import WARM_UP_TIMEOUT_S, LoopOptions, scores_of, warm_up_request
from .trace import TRACE_ENV

log = logging.getLogger(__name__)
_CLOSE = ("close",)  # the writer's end marker (never sent)


def wire(e: Event) -> tuple[Any, ...]:
    return (e.request_id, e.token_ids, e.finished, e.finish_reason, e.stop_reason, e.error, e.stamps)


class EngineCore:
    def __init__(self, runtime: Runtime, options: LoopOptions, pipe: Pipe) -> None:
        self.runtime, self.pipe = runtime, pipe
        self.loop = options.build(runtime, on_batch=self._on_batch)
        self.loop.trace = bool(os.environ.get(TRACE_ENV))
        self.loop.on_stats = self._on_stats
        self.outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name="plamo2-serve-writer", daemon=True)
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plamo2-serve-score")
        self.stopping = False
        self.stats = (0, 0)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, info: ModelInfo) -> None:
        """Start the loop, run the warm-up request through it, and freeze the heap."""
        self.writer.start()
        self.loop.start()
        threading.Thread(target=self._watch, name="plamo2-serve-watch", daemon=True).start()
        final = self.loop.submit(warm_up_request(info)).result(WARM_UP_TIMEOUT_S)
        if final.error is not None:
            raise EngineError(f"the generation loop failed at start: {final.error}")
        freeze_heap()

    def ready(self, info: ModelInfo, banner: str) -> None:
        self._post(("ready", asdict(info), banner))

    def serve(self) -> None:
        """Apply what the HTTP process sends until it says stop or goes away (on this thread)."""
        while True:
            try:
                msg = self.pipe.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "submit":
                self._submit(msg[1])
            elif kind == "cancel":
                self.loop.cancel(msg[1])
            elif kind == "score":
                self.scorer.submit(self._score, *msg[1:])
            elif kind == "stop":
                return

    def close(self) -> None:
        """Stop the loop (cancelling what runs), tell the HTTP process, stop the writer.  Raises the
        loop's own error if it died."""
        self.stopping = True
        try:
            self.loop.close(cancel=True)
        finally:
            self.scorer.shutdown(wait=False, cancel_futures=True)
            self._post(("stopped",))
            self.outbox.put(_CLOSE)
            self.writer.join(30)

    # ---- requests --------------------------------------------------------------------------------
    def _submit(self, fields: Any) -> None:
        request = request_from(fields)
        try:
            self.loop.submit(request, on_event=self._on_event)
        except UserError as e:
            self._post(("events", [(request.request_id, (), True, None, None, str(e), None)], *self.stats))

    def _score(self, job: int, seqs: list[list[int]], starts: list[int], top_k: int) -> None:
        try:
            got = self.loop.token_scores(seqs, starts, top_k)
        except (UserError, TimeoutError) as e:
            self._post(("scored", job, None, f"scoring the sequence failed: {e}"))
            return
        except BaseException as e:  # noqa: BLE001 - the HTTP side must hear of it, or the request waits forever
            self._post(("scored", job, None, f"scoring the sequence failed: {e!r}"))
            return
        scores = [scores_of(t) for t in got]
        self._post(("scored", job, [(s.logprobs, s.top_ids, s.top_logprobs) for s in scores], None))

    # ---- called on the loop's thread ---------------------------------------------------------------
    def _on_batch(self, events: list[Event]) -> None:
        self._post(("events", [wire(e) for e in events], *self.stats))

    def _on_event(self, event: Event) -> None:
        """Only what never comes in a batch: a request refused by a stopping loop, or failed with it."""
        if event.error is not None:
            self._post(("events", [wire(event)], *self.stats))

    def _on_stats(self, stats: OnlineStats) -> None:
        self.stats = (stats.waiting, stats.running)
        self._post(("stats", *self.stats))

    def _watch(self) -> None:
        thread = self.loop.thread
        assert thread is not None
        thread.join()
        if not self.stopping:
            why = f"the generation loop died: {self.loop.error!r}" if self.loop.error else "the generation loop stopped"
            log.error("%s", why)
            self._post(("failed", why))

    # ---- the writer --------------------------------------------------------------------------------
    def _post(self, msg: Message) -> None:
        self.outbox.put(msg)

    def _write(self) -> None:
        """Send what the loop posted, in order; a gone HTTP process drops the rest (the reader sees it)."""
        while (msg := self.outbox.get()) is not _CLOSE:
            try:
                self.pipe.send(msg)
            except OSError:
                return
