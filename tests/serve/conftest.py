"""Fixtures of the server tests (helpers in serve_harness.py).  Tests that need the fake
engine's exact outputs take `fake_only` and are skipped when PLAMO2_SERVE_TEST_ENGINE names
another engine."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from serve_harness import ENGINE_ENV, Server, make_engine, running_server

from plamo2_tools.serve.app import ServerConfig

ServerFactory = Callable[..., Any]


@pytest.fixture
def serve() -> Iterator[ServerFactory]:
    """serve(engine_kwargs..., config=ServerConfig(...)) -> a running Server, stopped after the test."""
    stack: list[Any] = []

    def start(config: ServerConfig | None = None, **engine_kwargs: Any) -> Server:
        cm = running_server(make_engine(**engine_kwargs), config)
        stack.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One fast server shared by a module's tests (no delay, default limits)."""
    with running_server(make_engine()) as s:
        yield s


@pytest.fixture
def fake_only() -> None:
    if os.environ.get(ENGINE_ENV):
        pytest.skip("checks the fake engine's exact outputs")
