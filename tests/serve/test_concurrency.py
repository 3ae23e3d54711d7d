"""Many clients at once, and clients that leave: every stream gets its own answer, and a client
that disconnects cancels its engine sequences (seen by the engine and in /metrics)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import openai
from serve_fake_engine import FakeEngine, encode, greedy_text
from serve_harness import Server, wait_until
from serve_prom import parse_exposition

from plamo2_tools.serve.app import ServerConfig

CLIENTS = 64


def sample(server: Server, family: str, **labels: str) -> float:
    """A series' value in /metrics now (0 when the series does not exist yet)."""
    fam = parse_exposition(server.metrics())[family]
    return next((v for name, lab, v in fam.samples if name == family and lab == labels), 0.0)


def finished(server: Server, reason: str) -> float:
    return sample(server, "plamo2_sequences_finished_total", reason=reason)


def gauge(server: Server, name: str) -> float:
    return parse_exposition(server.metrics())[name].value()


def test_64_concurrent_streaming_clients_get_their_own_answers(serve: Any) -> None:
    server = serve(ServerConfig(max_queue=CLIENTS), max_batch=16, delay=0.002)
    prompts = [f"client {i:02d} says hello" for i in range(CLIENTS)]
    ask = {"model": "fake-plamo", "max_tokens": 24, "temperature": 0}

    async def streamed(client: openai.AsyncOpenAI, prompt: str) -> str:
        parts = []
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **ask):
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def whole(client: openai.AsyncOpenAI, prompt: str) -> str:
        return (await client.completions.create(prompt=prompt, **ask)).choices[0].text

    async def main() -> tuple[list[str], float, list[str]]:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=CLIENTS))
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60, http_client=http
        ) as client:
            t0 = time.monotonic()
            got = await asyncio.gather(*(streamed(client, p) for p in prompts))
            elapsed = time.monotonic() - t0
            return got, elapsed, await asyncio.gather(*(whole(client, p) for p in prompts))

    got, elapsed, reference = asyncio.run(main())
    assert got == reference  # each stream is its own answer, not a neighbour's
    if isinstance(server.engine, FakeEngine):
        assert got == [greedy_text(encode(p), 24) for p in prompts]
    assert gauge(server, "plamo2_admitted_sequences") == 0 and gauge(server, "plamo2_running_sequences") == 0
    assert elapsed < 30


def _open_stream(server: Server, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """A raw HTTP/1.1 streaming request; returns the socket once the first SSE event is in."""
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    got = b""
    while b"data: {" not in got:
        got += sock.recv(65536)
    return sock, got


def test_disconnect_mid_stream_cancels_the_engine_sequences(serve: Any) -> None:
    server = serve(delay=0.02)
    cancelled_before = finished(server, "cancelled")
    sock, head = _open_stream(server, {"prompt": "abc", "max_tokens": 200, "n": 3, "stream": True})
    assert b"200 OK" in head
    wait_until(lambda: gauge(server, "plamo2_running_sequences") == 3)
    sock.close()  # the client goes away mid-stream
    wait_until(lambda: finished(server, "cancelled") == cancelled_before + 3)
    wait_until(lambda: gauge(server, "plamo2_running_sequences") == 0)
    assert gauge(server, "plamo2_admitted_sequences") == 0
    if hasattr(server.engine, "cancelled"):
        ids = server.engine.cancelled[-3:]
        assert len(set(ids)) == 3 and all(i.startswith("cmpl-") for i in ids)
        assert {r.request_id for r in server.engine.submitted[-3:]} == set(ids)


def test_disconnect_with_httpx_closing_the_stream(serve: Any) -> None:
    server = serve(delay=0.02)
    before = finished(server, "cancelled")
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 200, "stream": True}, timeout=10
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first event: the with-block closes the connection
    wait_until(lambda: finished(server, "cancelled") == before + 1)


def test_disconnect_before_a_non_streamed_answer_cancels_and_counts_499(serve: Any) -> None:
    server = serve(delay=0.05)
    before = finished(server, "cancelled")
    try:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 200}, timeout=0.3)
        raise AssertionError("the request should have timed out")
    except httpx.TimeoutException:
        pass  # httpx closes the connection: the client is gone
    wait_until(lambda: finished(server, "cancelled") == before + 1)
    wait_until(lambda: sample(server, "plamo2_http_requests_total", endpoint="/v1/completions", status="499") == 1)


def test_disconnect_while_queued_before_the_first_token(serve: Any) -> None:
    """A stream still waiting for a decode slot (no 200 sent yet) is cancelled too."""
    server = serve(ServerConfig(max_queue=4), max_batch=1, delay=0.02)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 100, "stream": True}, timeout=10
    ) as first:
        assert first.status_code == 200
        payload = json.dumps({"prompt": "cd", "max_tokens": 100, "stream": True}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        queued = socket.create_connection((host, int(port)), timeout=10)
        queued.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        wait_until(lambda: gauge(server, "plamo2_queue_length") == 1)
        before = finished(server, "cancelled")
        queued.close()
        wait_until(lambda: finished(server, "cancelled") == before + 1)
        wait_until(lambda: gauge(server, "plamo2_queue_length") == 0)
    wait_until(lambda: gauge(server, "plamo2_admitted_sequences") == 0)
