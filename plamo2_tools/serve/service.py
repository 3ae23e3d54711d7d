"""What every rank runs for `plamo2-tools serve` (a `runtime/process/jobs.py` job, so the same
function serves ranks that are threads of this process and real torchrun ranks).

* rank 0: the `RuntimeEngine` over an online loop, the app, uvicorn on HOST:PORT until SIGTERM /
  SIGINT (graceful: docs/serve.md) or until the loop dies (non-zero exit);
* every other torchrun rank: the same online loop with no HTTP; it takes rank 0's arrivals at
  every iteration (`online.RankIntake`) and ends when rank 0 closes its loop.  These ranks ignore
  SIGINT and SIGTERM: rank 0 decides when the loop ends, and a rank that left early would leave the
  others waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from ..errors import Plamo2Error, UserError
from ..runtime.serving.engine import Runtime
from . import API_KEY_ENV
from .runtime_engine import LoopOptions, RuntimeEngine
from .signals import stop_signals_handled

# The HTTP thread (asyncio) and the generation loop's thread share the GIL, which Python hands over
# every 5 ms by default: a busy HTTP thread can delay the loop's next decode launch by that much,
# against GPU decode steps of 1.5-3.5 ms.  A shorter interval (e.g. 0.0005) is the A/B knob of
# `python -m bench serving` on the GPU with PLAMO2_SERVE_SWITCH_INTERVAL=0.0005; unset: Python's.
SWITCH_INTERVAL_ENV = "PLAMO2_SERVE_SWITCH_INTERVAL"


class ServerFailed(Plamo2Error):
    """The server stopped because its generation loop failed (the loop's own error is raised when
    it has one)."""

    exit_code = 1


def serve_job(rt: Runtime, model_id: str, host: str, port: int, loop: dict[str, Any], server: dict[str, Any],
              shutdown_timeout: float, log_level: str = "warning", api_key: str | None = None,
              sock: socket.socket | None = None) -> int:  # fmt: skip
    """Serve `rt` (rank 0) or follow rank 0's loop (the others); 0 after a graceful stop.

    The API key comes as `api_key` in-process and through the environment (API_KEY_ENV) to torchrun
    ranks; `sock` is a listening socket made before the model loaded (else HOST:PORT is bound)."""
    options = LoopOptions(**loop)
    if not rt.is_main:
        follow(rt, options)
        return 0
    from .app import ServerConfig, create_app
    from .server import serve_forever

    interval = switch_interval()
    if interval is not None:
        sys.setswitchinterval(interval)

    config = dict(server)
    config["api_key"] = api_key or os.environ.get(API_KEY_ENV) or None
    config["served_model_names"] = tuple(config.get("served_model_names", ()))
    engine = RuntimeEngine(rt, model_id, options)
    app = create_app(engine, ServerConfig(**config))
    info = engine.info
    mapping = rt.manifest.mapping

    def started(addresses: list[Any]) -> None:
        where = ", ".join(_url(a) for a in addresses)
        layout = f"tp{mapping.tp}×pp{mapping.pp}" + (" torchrun ranks" if rt.mode == "dist" else "")
        print(f"serving {model_id} on {where} ({info.max_batch} slots of {info.max_context} tokens, {layout}, "
              f"{rt.engines[0].device}; chat {'on' if info.chat_template else 'off: no chat template'}"
              f"{'; API key required' if config['api_key'] else ''})", file=sys.stderr, flush=True)  # fmt: skip

    rc = serve_forever(app, host, port, shutdown_timeout, sock=sock, log_level=log_level, on_started=started)
    state = app.state.serve
    if state.startup_error is not None:
        raise state.startup_error
    if rc != 0:
        if engine.loop.error is not None and not isinstance(engine.loop.error, KeyboardInterrupt):
            raise engine.loop.error
        raise ServerFailed(engine.failed or f"the server stopped with exit code {rc}")
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
