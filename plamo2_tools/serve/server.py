"""Running the app: `serve_forever`, uvicorn with a graceful shutdown that exits 0.

On the first SIGTERM or SIGINT: /health and new generation requests answer 503 (load balancers
stop sending), the listening socket closes, running requests may finish for up to
`shutdown_timeout` seconds, then the rest are cancelled (their engine sequences with them), the
engine is stopped (lifespan shutdown) and the function returns 0.  A second SIGINT skips the wait.

uvicorn's own signal handling re-raises the signal after shutting down, so the process would die
of it (exit -15, not 0); we install our own handlers instead, which only ask uvicorn to exit.

An engine that can no longer serve (`engine.failed` set: its scheduler died) stops the server the
same way, and the function returns 1: running requests have failed with 500s or error events, and
a supervisor restarts a process that exits non-zero, never one that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from .signals import stop_signals_handled

log = logging.getLogger(__name__)
DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the API has no key by default
CUT_GRACE_S = 5.0  # between the app's cut of running answers and uvicorn's cancelling of their tasks


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any, on_started: Callable[[list[Any]], None] | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.on_started = on_started
        self.failed: str | None = None
        self.cut_after = (
            max(0.0, config.timeout_graceful_shutdown - CUT_GRACE_S) if config.timeout_graceful_shutdown else 0.0
        )

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started([s.getsockname() for server in self.servers for s in server.sockets])

    async def on_tick(self, counter: int) -> bool:
        state = self._state()
        failed = getattr(getattr(state, "engine", None), "failed", None)
        if failed and self.failed is None:
            self.failed = str(failed)
            state.draining = True
            log.error("stopping: %s", failed)
            self.should_exit = True
        return await super().on_tick(counter)

    def _state(self) -> Any:
        return getattr(getattr(self.app, "state", None), "serve", None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, with the answers still running at `cut_after` seconds ended by
        the app itself (an error event and [DONE], `ServerState.cut_all`) before uvicorn's own deadline
        (CUT_GRACE_S later) would cancel their tasks mid-write."""
        state = self._state()
        timer = None
        if state is not None and hasattr(state, "cut_all"):
            timer = asyncio.get_running_loop().call_later(self.cut_after, state.cut_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return stop_signals_handled(self.on_signal)

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for running requests
        self.should_exit = True
        state = self._state()
        if state is not None:
            state.draining = True
        log.warning("%s: finishing running requests, then exiting", signal.Signals(sig).name)


def bind_socket(host: str = DEFAULT_HOST, port: int = 0) -> socket.socket:
    """A listening TCP socket for `serve_forever(sock=...)` (port 0: the kernel picks a free one).

    Created with proto=IPPROTO_TCP on purpose: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on sockets whose proto says TCP, and with Nagle on, uvicorn's separate header and body
    writes wait for the client's delayed ACK: 40 ms added to every keep-alive response.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve_forever(
    app: Any,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    *,
    sock: socket.socket | None = None,
    log_level: str = "info",
    on_started: Callable[[list[Any]], None] | None = None,
) -> int:
    """Serve `app` until SIGTERM/SIGINT, shut down gracefully, return 0 (the exit code); 1 when the
    app did not start (its engine's start failed) or its engine failed while serving.

    `sock`: a socket from `bind_socket` to serve on instead of (host, port) (e.g. port 0 in tests).
    `on_started(addresses)`: called once listening, with the bound (host, port) pairs.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout + CUT_GRACE_S,  # the app cuts at shutdown_timeout itself
        lifespan="on",
        access_log=False,
    )
    server = _GracefulServer(config, app, on_started)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    except SystemExit as e:  # uvicorn's answer to a failed lifespan startup
        return int(e.code) if isinstance(e.code, int) and e.code else 1
    if server.failed is not None:
        return 1
    return 0 if server.started else 1
