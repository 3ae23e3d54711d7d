"""Running the engine sequences of one HTTP request, and noticing when its client goes away.

`Run` fans one request's sequences into the engine and merges their events in arrival order.
Whatever way it ends (all finished, an engine error, the client gone, the server shutting down)
it cancels every sequence the engine has not finished, frees their admission slots and counts
them in /metrics; the cancel happens in the `finally` of the iterator, so it runs whether the
iterator is exhausted, closed (``aclose``) or cancelled at an ``await`` inside it.

A client that disconnects is seen by waiting on the ASGI ``receive`` channel once the body has been
read: uvicorn answers it with ``http.disconnect`` when the connection drops.  Starlette's own
check only happens when a chunk is sent, which for a slow first token can be long after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .engine_api import Engine, EngineError, GenerationRequest, TokenEvent
from .metrics import SequenceClock, ServerMetrics
from .protocol import ApiError
from .trace import RequestTrace

log = logging.getLogger(__name__)
T = TypeVar("T")
_DONE = object()  # a pump's end-of-stream marker
QUEUE_PER_SEQUENCE = 16  # events a sequence may run ahead of a slow client before its pump waits


class ClientGone(Exception):
    """The client disconnected before the response was sent."""


class Admission:
    """How many sequences are in the engine on behalf of clients; refuses beyond `capacity`.

    Counted here rather than asked of the engine: requests arriving together would all see the
    same engine queue length before any of them is submitted."""

    def __init__(self, capacity: int, retry_after: int) -> None:
        self.capacity, self.retry_after, self.admitted = capacity, retry_after, 0

    def check_size(self, n: int) -> None:
        """A request of `n` sequences that could never be admitted: 400 (before anything else is done
        for it, tokenizing included)."""
        if n > self.capacity:
            raise ApiError(
                400, f"this request needs {n} sequences (prompts x n); the server holds at most {self.capacity} at once"
            )

    def admit(self, n: int) -> Lease:
        self.check_size(n)
        if self.admitted + n > self.capacity:
            raise ApiError(
                429,
                f"the server is at capacity ({self.admitted} of {self.capacity} sequences admitted); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.admitted += n
        return Lease(self, n)


class Lease:
    """The admission slots of one request, given back one by one as its sequences end."""

    def __init__(self, admission: Admission, n: int) -> None:
        self.admission, self.left = admission, n

    def release(self, n: int = 1) -> None:
        n = min(n, self.left)
        self.left -= n
        self.admission.admitted -= n

    def release_all(self) -> None:
        self.release(self.left)


class Run:
    """The sequences of one request: `events()` yields (choice index, event) as they come."""

    def __init__(
        self,
        engine: Engine,
        requests: list[GenerationRequest],
        metrics: ServerMetrics,
        lease: Lease,
        arrival: float,
        trace: RequestTrace | None = None,
    ) -> None:
        self.engine, self.requests, self.metrics, self.lease = engine, requests, metrics, lease
        self.arrival, self.trace = arrival, trace
        self.clocks = [SequenceClock(metrics, arrival) for _ in requests]
        self.finished: set[int] = set()
        self.completion_tokens = [0] * len(requests)
        self.was_cut = False  # ended by the server's shutdown (`cut`), not by the engine

    def cut(self) -> None:
        """End this run now (the shutdown timeout): its engine sequences are cancelled, so their
        iterators end without a finish reason, which `events` reports as an EngineError."""
        self.was_cut = True
        for i, r in enumerate(self.requests):
            if i not in self.finished:
                try:
                    self.engine.cancel(r.request_id)
                except Exception:  # a broken cancel must not stop the others' cut
                    log.exception("engine.cancel(%s) failed", r.request_id)

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        if len(self.requests) == 1:  # the common case: the engine's own iterator, no pump task per chunk
            async for item in self._one():
                yield item
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(QUEUE_PER_SEQUENCE * len(self.requests))
        pumps = [asyncio.ensure_future(self._pump(i, r, queue)) for i, r in enumerate(self.requests)]
        try:
            live = len(pumps)
            while live:
                i, item = await queue.get()
                if item is _DONE:
                    live -= 1
                    if i not in self.finished:
                        raise EngineError(
                            f"the engine ended request {self.requests[i].request_id} without a finish reason"
                        )
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._account(i, item)
                yield i, item
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
        except EngineError:
            self._end_unfinished("error")
            raise
        finally:
            self._end_unfinished("cancelled")
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self.lease.release_all()

    async def _one(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """`events` of a one-sequence request, the same rules without the pump: one hand-over (and
        one task switch) less for every chunk a stream sends."""
        stream: Any = None
        try:
            try:
                stream = self.engine.submit(self.requests[0])
                async for event in stream:
                    self._account(0, event)
                    yield 0, event
                    if event.finish_reason is not None:
                        break
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"engine failed: {e!r}") from e
            if 0 not in self.finished:
                raise EngineError(f"the engine ended request {self.requests[0].request_id} without a finish reason")
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
        except EngineError:
            self._end_unfinished("error")
            raise
        finally:
            self._end_unfinished("cancelled")
            close = getattr(stream, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            self.lease.release_all()

    def _account(self, i: int, event: TokenEvent) -> None:
        if self.trace is not None and event.stamps is not None:
            self.trace.merge(event.stamps)
        n = len(event.token_ids)
        self.completion_tokens[i] += n
        self.clocks[i].tokens(n)
        if event.finish_reason is not None:
            self.finished.add(i)
            self.metrics.finished.inc(reason=event.finish_reason)
            self.lease.release()

    def _end_unfinished(self, reason: str) -> None:
        """Cancel in the engine every sequence that has not finished (idempotent)."""
        for i, r in enumerate(self.requests):
            if i not in self.finished:
                self.finished.add(i)
                self.metrics.finished.inc(reason=reason)
                try:
                    self.engine.cancel(r.request_id)
                except Exception:  # a broken cancel must not hide the reason we are here
                    log.exception("engine.cancel(%s) failed", r.request_id)

    async def _pump(self, i: int, request: GenerationRequest, queue: asyncio.Queue[tuple[int, Any]]) -> None:
        stream: Any = None
        try:
            stream = self.engine.submit(request)  # inside the try: a submit that raises is an engine error too
            async for event in stream:
                await queue.put((i, event))
                if event.finish_reason is not None:
                    break
        except Exception as e:  # handed to the consumer, which raises it in the handler's task
            await queue.put((i, e if isinstance(e, EngineError) else EngineError(f"engine failed: {e!r}")))
            return
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        await queue.put((i, _DONE))


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (call only after the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


class EventStream(StreamingResponse):
    """Server-sent events that stop (and run `on_close`) as soon as the client disconnects, and
    close their iterator however the response ends, so that no engine sequence outlives it."""

    def __init__(
        self, chunks: AsyncIterator[str], on_close: Callable[[], None], trace: RequestTrace | None = None
    ) -> None:
        super().__init__(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.chunks, self.on_close, self.trace = chunks, on_close, trace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._send_all(send))
        except (ClientGone, OSError):
            pass  # nobody left to tell
        finally:
            close = getattr(self.chunks, "aclose", None)
            if close is not None:
                await close()
            self.on_close()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            if self.trace is not None:
                self.trace.mark("written")  # the first chunk carries the first token (respond waited for it)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the rest (a stream whose first item was awaited before the response began)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        close = getattr(rest, "aclose", None)
        if close is not None:
            await close()
