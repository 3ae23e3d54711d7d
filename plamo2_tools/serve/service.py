"""What every rank runs for `plamo2-tools serve` (a `runtime/process/jobs.py` job, so the same
function serves ranks that are threads of this process and real torchrun ranks).

* rank 0: the online loop (`engine_core.EngineCore`) in this process, and HTTP (the app, uvicorn on
  HOST:PORT) in a child process of its own (`front`), until SIGTERM / SIGINT (forwarded to the child,
  which drains: docs/serve.md) or until the loop dies (non-zero exit); with
  PLAMO2_SERVE_HTTP_PROCESS=0, the app on this process's main thread over `RuntimeEngine` instead;
* every other torchrun rank: the same online loop with no HTTP; it takes rank 0's arrivals at
  every iteration (`online.RankIntake`) and ends when rank 0 closes its loop.  These ranks ignore
  SIGINT and SIGTERM: rank 0 decides when the loop ends, and a rank that left early would leave the
  others waiting in a collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from ..errors import Plamo2Error, UserError
from ..runtime.batching.engine import Runtime
from . import API_KEY_ENV
from .engine_api import ModelInfo
from .engine_core import EngineCore
from .front import front_config
from .pipe import Pipe
from .pipe import pair as pipe_pair
from .runtime_engine import LoopOptions, RuntimeEngine, model_info
from .signals import stop_signals_handled

# The HTTP thread (asyncio) and the generation loop's thread share the GIL, which Python hands over
# every 5 ms by default: a busy HTTP thread can delay the loop's next decode launch by that much,
# against GPU decode steps of 1.5-3.5 ms.  A shorter interval (e.g. 0.0005) is the A/B knob of
# `python -m bench serving` on the GPU with PLAMO2_SERVE_SWITCH_INTERVAL=0.0005; unset: Python's.
SWITCH_INTERVAL_ENV = "PLAMO2_SERVE_SWITCH_INTERVAL"
# "0": HTTP on a thread of the model's process (the design before the split; the A/B of the benchmark).
HTTP_PROCESS_ENV = "PLAMO2_SERVE_HTTP_PROCESS"


class ServerFailed(Plamo2Error):
    """The server stopped because its generation loop failed (the loop's own error is raised when
    it has one)."""

    exit_code = 1


def serve_job(
    rt: Runtime,
    model_id: str,
    host: str,
    port: int,
    loop: dict[str, Any],
    server: dict[str, Any],
    shutdown_timeout: float,
    log_level: str = "warning",
    api_key: str | None = None,
    sock: socket.socket | None = None,
    chat_template: str | None = None,
) -> int:
    """Serve `rt` (rank 0) or follow rank 0's loop (the others); 0 after a graceful stop.

    The API key comes as `api_key` in-process and through the environment (API_KEY_ENV) to torchrun
    ranks; `sock` is a listening socket made before the model loaded (else HOST:PORT is bound);
    `chat_template` replaces the checkpoint's (`serve --chat-template FILE`)."""
    options = LoopOptions(**loop)
    if not rt.is_main:
        follow(rt, options)
        return 0
    interval = switch_interval()
    if interval is not None:
        sys.setswitchinterval(interval)
    config = dict(server)
    config["served_model_names"] = list(config.get("served_model_names", ()))
    key = api_key or os.environ.get(API_KEY_ENV) or None
    if http_process():
        return _serve_two_processes(
            rt, model_id, host, port, options, config, shutdown_timeout, log_level, key, sock, chat_template
        )
    return _serve_one_process(
        rt, model_id, host, port, options, config, shutdown_timeout, log_level, key, sock, chat_template
    )


def http_process() -> bool:
    """Whether HTTP runs in a process of its own (the default; HTTP_PROCESS_ENV=0: a thread here)."""
    value = os.environ.get(HTTP_PROCESS_ENV, "1")
    if value not in ("0", "1"):
        raise UserError(f"{HTTP_PROCESS_ENV}={value!r}: must be 0 or 1")
    return value == "1"


def _banner(rt: Runtime, model_id: str, info: ModelInfo, api_key: str | None) -> str:
    """The start line, with `{where}` for the addresses (docs/serve.md; tests and benchmarks read it)."""
    mapping = rt.manifest.mapping
    layout = f"tp{mapping.tp}×pp{mapping.pp}" + (" torchrun ranks" if rt.mode == "dist" else "")
    chat = "on" if info.chat_template else "off: no chat template"
    return (
        f"serving {model_id} on {{where}} ({info.max_batch} slots of {info.max_context} tokens, {layout}, "
        f"{rt.engines[0].device}; chat {chat}{'; API key required' if api_key else ''})"
    )


def _serve_one_process(
    rt: Runtime,
    model_id: str,
    host: str,
    port: int,
    options: LoopOptions,
    config: dict[str, Any],
    shutdown_timeout: float,
    log_level: str,
    api_key: str | None,
    sock: socket.socket | None,
    chat_template: str | None,
) -> int:
    """HTTP on this process's main thread, the loop a thread beside it (HTTP_PROCESS_ENV=0)."""
    from .app import ServerConfig, create_app
    from .server import serve_forever

    engine = RuntimeEngine(rt, model_id, options, chat_template=chat_template)
    app = create_app(
        engine,
        ServerConfig(**{**config, "served_model_names": tuple(config["served_model_names"]), "api_key": api_key}),
    )
    banner = _banner(rt, model_id, engine.info, api_key)

    def started(addresses: list[Any]) -> None:
        print(banner.format(where=", ".join(_url(a) for a in addresses)), file=sys.stderr, flush=True)

    rc = serve_forever(app, host, port, shutdown_timeout, sock=sock, log_level=log_level, on_started=started)
    state = app.state.serve
    if state.startup_error is not None:
        raise state.startup_error
    if rc != 0:
        if engine.loop.error is not None and not isinstance(engine.loop.error, KeyboardInterrupt):
            raise engine.loop.error
        raise ServerFailed(engine.failed or f"the server stopped with exit code {rc}")
    return 0


def _serve_two_processes(
    rt: Runtime,
    model_id: str,
    host: str,
    port: int,
    options: LoopOptions,
    config: dict[str, Any],
    shutdown_timeout: float,
    log_level: str,
    api_key: str | None,
    sock: socket.socket | None,
    chat_template: str | None,
) -> int:
    """The loop here, HTTP in a child process (`front`) started first, so that its imports overlap
    the warm-up; signals to this process are forwarded to it, which drains and then tells the loop
    to stop (docs/serve.md, "Two processes")."""
    from .server import bind_socket

    listener = sock if sock is not None else bind_socket(host, port)
    ours, theirs = pipe_pair()
    front_args = front_config(
        theirs.fileno(), listener.fileno(), str(rt.path), rt.trust_remote_code, config, shutdown_timeout, log_level
    )
    env = {**os.environ, **({API_KEY_ENV: api_key} if api_key else {})}
    child = subprocess.Popen(
        [sys.executable, "-m", "plamo2_tools.serve.front", front_args],
        env=env,
        pass_fds=(theirs.fileno(), listener.fileno()),
        process_group=0,
    )
    theirs.close()
    listener.close()  # the child's now: once it stops listening, connections are refused, not left queued
    signals: list[int] = []

    def forward(sig: int, frame: Any) -> None:
        signals.append(sig)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sig)

    core = EngineCore(rt, options, Pipe(ours))
    try:
        with stop_signals_handled(forward):
            info = model_info(rt, core.loop, model_id, int(time.time()), chat_template=chat_template)
            core.start(info)
            core.ready(info, _banner(rt, model_id, info, api_key))
            core.serve()  # until the HTTP process has drained and says stop, or is gone
            try:
                core.close()  # "stopped" goes out; raises the loop's own error if it died (a bug: exit 70)
            finally:
                rc = child.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait()
        with contextlib.suppress(BaseException):
            core.close()
        raise
    if rc != 0 and not (signals and rc in (-signal.SIGTERM, -signal.SIGINT)):
        raise ServerFailed(f"the HTTP process exited with code {rc}")
    return 0


def switch_interval() -> float | None:
    """SWITCH_INTERVAL_ENV's value (checked by the command before the model loads), or None."""
    text = os.environ.get(SWITCH_INTERVAL_ENV)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise UserError(f"{SWITCH_INTERVAL_ENV}={text!r}: must be seconds in (0, 1]")
    return value


def follow(rt: Runtime, options: LoopOptions) -> None:
    """A torchrun rank other than 0: run the online loop until rank 0 closes it."""
    loop = options.build(rt)
    with stop_signals_handled(signal.SIG_IGN):
        loop.start()
        loop.join()


def _url(address: Any) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"
