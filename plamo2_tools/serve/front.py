"""The HTTP process of `plamo2-tools serve` (docs/serve.md, "Two processes"): FastAPI and uvicorn,
tokenizing, text, JSON and SSE, in an interpreter of their own; the model and its loop stay in the
process that loaded them (`engine_core`), which starts this one:

    python -m plamo2_tools.serve.front CONFIG_JSON      # inherits the pipe and the listening socket

`ProcessEngine` is `engine_api.Engine` over the pipe (`pipe.py`): a submission is one message out,
each drain of the loop one message back (every sequence's new tokens), read by one thread that
hands the batch to asyncio in one call.  This process never imports torch.

Its life: wait for the model process's "ready" (the loop is warm), serve on the inherited socket
until SIGTERM / SIGINT (forwarded by the model process, whose terminal group this one is not in),
drain (docs/serve.md, "Shutdown"), tell the model process to stop, exit with `serve_forever`'s code.
The model process gone (killed, crashed) reads as EOF: the engine fails every request and the
server stops with exit 1, so no HTTP process outlives its model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import fields
from typing import Any

from ..errors import Plamo2Error
from ..runtime.batching.text import decode_kept_specials, load_text_tokenizer
from . import API_KEY_ENV
from .engine_api import EngineError, EngineStats, GenerationRequest, ModelInfo
from .loop_engine import LoopEngine, LoopEvent, Scores, freeze_heap
from .pipe import Message, Pipe, request_fields
from .trace import TRACE_ENV

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 60.0  # how long the model process may take to close its loop once told to stop


class ProcessEngine(LoopEngine):
    """`engine_api.Engine` whose loop runs in another process, across `pipe`."""

    def __init__(self, pipe: Pipe, info: ModelInfo, tokenizer: Any) -> None:
        super().__init__(info, tokenizer, decode_kept_specials(tokenizer))
        self.pipe = pipe
        self.tracing = bool(os.environ.get(TRACE_ENV))
        self._stats = EngineStats(0, 0)
        self.jobs: dict[int, asyncio.Future[list[Scores]]] = {}
        self.job_ids = itertools.count()
        self.stopped: asyncio.Future[None] | None = None
        self.reader = threading.Thread(target=self._read, name="plamo2-serve-reader", daemon=True)
        self.gone = False

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """The model process warmed its loop up before it said ready: start listening to it."""
        self.aio = asyncio.get_running_loop()
        self.stopped = self.aio.create_future()
        self.reader.start()

    async def stop(self) -> None:
        """Tell the model process to close its loop (what still runs is cancelled) and wait for it."""
        if not self.gone:
            with contextlib.suppress(OSError):
                self.pipe.send(("stop",))
            assert self.stopped is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.stopped), STOP_TIMEOUT_S)
        self.pipe.close()

    def _alive(self) -> bool:
        return not self.gone and self.reader.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    # ---- out -------------------------------------------------------------------------------------
    def _send_submit(self, request: GenerationRequest) -> None:
        self._send(("submit", request_fields(request)))

    def _send_cancel(self, request_id: str) -> None:
        with contextlib.suppress(EngineError):
            self._send(("cancel", request_id))

    def _send(self, message: Message) -> None:
        if self.gone:
            raise EngineError(self.failed or "the model process is gone")
        try:
            self.pipe.send(message)
        except OSError as e:
            raise EngineError(f"the model process is gone: {e}") from None

    async def _token_scores(self, seqs: list[list[int]], starts: list[int], top_k: int) -> list[Scores]:
        assert self.aio is not None
        job = next(self.job_ids)
        future: asyncio.Future[list[Scores]] = self.aio.create_future()
        self.jobs[job] = future
        try:
            self._send(("score", job, seqs, starts, top_k))
            return await future
        finally:
            self.jobs.pop(job, None)

    # ---- in: one thread reads, the asyncio thread applies -------------------------------------------
    def _read(self) -> None:
        assert self.aio is not None
        while True:
            try:
                msg = self.pipe.recv()
            except (EOFError, OSError):
                msg = ("gone",)
            try:
                self.aio.call_soon_threadsafe(self._apply, msg)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                return
            if msg[0] in ("gone", "stopped"):
                return

    def _apply(self, msg: Message) -> None:
        kind = msg[0]
        if kind == "events":
            self._stats = EngineStats(msg[2], msg[3])
            self.deliver(LoopEvent(*e) for e in msg[1])
        elif kind == "stats":
            self._stats = EngineStats(msg[1], msg[2])
        elif kind == "scored":
            future = self.jobs.get(msg[1])
            if future is not None and not future.done():
                if msg[3] is not None:
                    future.set_exception(EngineError(msg[3]))
                else:
                    future.set_result(
                        [Scores(list(a), [list(r) for r in b], [list(r) for r in c]) for a, b, c in msg[2]]
                    )
        elif kind == "failed":
            self._lost(msg[1])
        elif kind == "stopped":
            self.gone = True
            self._resolve_stopped()
        elif kind == "gone":
            self._lost("the model process is gone")

    def _lost(self, why: str) -> None:
        """The loop can no longer serve: fail what waits, and let the server stop (`failed`)."""
        log.error("%s", why)
        self.gone = self.gone or why == "the model process is gone"
        self.fail_all(why)
        for future in self.jobs.values():
            if not future.done():
                future.set_exception(EngineError(why))
        if self.gone:  # else the model process still answers our stop with "stopped"
            self._resolve_stopped()

    def _resolve_stopped(self) -> None:
        if self.stopped is not None and not self.stopped.done():
            self.stopped.set_result(None)


# ---- the process --------------------------------------------------------------------------------------
def front_config(
    pipe_fd: int,
    listen_fd: int,
    shards: str,
    trust_remote_code: bool,
    server: dict[str, Any],
    shutdown_timeout: float,
    log_level: str,
) -> str:
    """The JSON this process takes as its argument (no secrets: the API key comes in the environment)."""
    return json.dumps(
        {
            "pipe_fd": pipe_fd,
            "listen_fd": listen_fd,
            "shards": shards,
            "trust_remote_code": trust_remote_code,
            "server": server,
            "shutdown_timeout": shutdown_timeout,
            "log_level": log_level,
        }
    )


def run(config: dict[str, Any]) -> int:
    from .app import ServerConfig, create_app
    from .server import serve_forever

    logging.basicConfig(
        level=logging.INFO if config["log_level"] == "info" else logging.WARNING, format="%(levelname)s: %(message)s"
    )
    pipe = Pipe.from_fd(config["pipe_fd"])
    sock = socket.socket(fileno=config["listen_fd"])
    tokenizer = load_text_tokenizer(config["shards"], config["trust_remote_code"])
    msg: Message = ("",)
    while msg[0] != "ready":  # the model process is loading and warming up meanwhile (its gauges come too)
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            return 1  # it failed to start, and says why itself
    names = {f.name for f in fields(ModelInfo)}
    info = ModelInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in msg[1].items() if k in names})
    banner: str = msg[2]
    server = dict(config["server"])
    server["api_key"] = os.environ.get(API_KEY_ENV) or None
    server["served_model_names"] = tuple(server.get("served_model_names", ()))
    engine = ProcessEngine(pipe, info, tokenizer)
    app = create_app(engine, ServerConfig(**server))
    freeze_heap()

    def started(addresses: list[Any]) -> None:
        where = ", ".join(_url(a) for a in addresses)
        print(banner.format(where=where), file=sys.stderr, flush=True)

    return serve_forever(
        app, sock=sock, shutdown_timeout=config["shutdown_timeout"], log_level=config["log_level"], on_started=started
    )


def _url(address: Any) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    try:
        return run(json.loads(argv[0]))
    except Plamo2Error as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    finally:
        log.debug("the HTTP process ran %.1f s", time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
