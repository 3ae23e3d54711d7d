"""The app's side of the engine contract: engines that break it fail one request (500), never
hang or leak admission slots; start/stop come from the lifespan; signals set draining."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from serve_fake_engine import FakeEngine
from serve_harness import running_server

from plamo2_tools.serve.app import create_app
from plamo2_tools.serve.engine_api import Engine, GenerationRequest, TokenEvent
from plamo2_tools.serve.server import _GracefulServer


class RaisesAtSubmit(FakeEngine):
    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:  # type: ignore[override]
        raise RuntimeError("submit blew up")


class EndsWithoutFinish(FakeEngine):
    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:  # type: ignore[override]
        yield TokenEvent((70,), "a")


def test_the_fake_is_an_engine() -> None:
    assert isinstance(FakeEngine(), Engine)


@pytest.mark.parametrize("engine_class", [RaisesAtSubmit, EndsWithoutFinish])
@pytest.mark.parametrize("stream", [False, True])
def test_broken_engines_fail_the_request(engine_class: type[FakeEngine], stream: bool) -> None:
    """500 before anything was sent; an error event once a stream has begun."""
    with running_server(engine_class()) as server:
        for _ in range(3):
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": stream})
            if stream and engine_class is EndsWithoutFinish:
                assert r.status_code == 200 and "without a finish reason" in r.text
                assert r.text.endswith("data: [DONE]\n\n")
            else:
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert server.app.state.serve.admission.admitted == 0


def test_lifespan_starts_and_stops_the_engine() -> None:
    engine = FakeEngine()
    with running_server(engine):
        assert engine.started and not engine.stopped
    assert engine.stopped


def test_a_signal_sets_draining_and_a_second_sigint_forces() -> None:
    app = create_app(FakeEngine())
    server = _GracefulServer(uvicorn.Config(app), app)
    server.on_signal(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit and app.state.serve.draining
    server.on_signal(signal.SIGINT, None)
    assert server.force_exit


def test_default_bind_is_loopback() -> None:
    import inspect

    from plamo2_tools.serve import DEFAULT_HOST, serve_forever

    assert DEFAULT_HOST == "127.0.0.1"
    assert inspect.signature(serve_forever).parameters["host"].default == "127.0.0.1"
