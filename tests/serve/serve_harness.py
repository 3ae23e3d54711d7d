"""Real uvicorn servers on free loopback ports, each in a thread of its own, talked to with the
official `openai` client and raw httpx (helpers; the fixtures are in conftest.py).

The engine behind them comes from `make_engine`: the deterministic fake of serve_fake_engine.py,
or, once the runtime has an online engine, whatever `PLAMO2_SERVE_TEST_ENGINE=module:factory`
names (a callable taking the fake's keyword arguments it understands, returning an Engine).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from serve_fake_engine import FakeEngine

from plamo2_tools.serve.app import ServerConfig, create_app
from plamo2_tools.serve.engine_api import Engine
from plamo2_tools.serve.server import bind_socket

ENGINE_ENV = "PLAMO2_SERVE_TEST_ENGINE"


def make_engine(**kwargs: Any) -> Engine:
    spec = os.environ.get(ENGINE_ENV)
    if not spec:
        return FakeEngine(**kwargs)
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    engine: Any
    app: Any

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30, **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


@contextmanager
def running_server(engine: Engine, config: ServerConfig | None = None) -> Iterator[Server]:
    """create_app + uvicorn on 127.0.0.1:<free port> in a daemon thread, stopped on exit."""
    app = create_app(engine, config)
    sock = bind_socket("127.0.0.1", 0)  # the kernel picks a free port: no race between tests
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)
