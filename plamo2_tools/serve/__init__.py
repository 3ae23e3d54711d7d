"""An OpenAI-compatible HTTP server in front of an engine (docs/serve.md).

`engine_api` is the contract an engine implements; `create_app(engine, ServerConfig(...))` builds
the FastAPI app and `serve_forever(app, host, port, shutdown_timeout)` runs it.  This package
imports the runtime only in `runtime_engine` (the engine over the runtime's online loop), `batch`
(batch generation from files) and `service` (what every rank runs for `plamo2-tools serve`).
Nothing is imported eagerly: `plamo2-tools --help` imports neither FastAPI nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

API_KEY_ENV = "PLAMO2_API_KEY"  # serve's --api-key; how torchrun ranks get it (never written to a file)
_LAZY = {"ServerConfig": "app", "create_app": "app", "serve_forever": "server", "DEFAULT_HOST": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
