"""The ASGI middleware in front of every route: API key, body size limit, request counting.

It runs before FastAPI parses anything, so a refused request costs no JSON decoding, and it sees
every response (including FastAPI's own 404/405 and our 499) to count it by endpoint and status.
The body is read here once, up to the limit, and replayed to the app; after the replay, `receive`
is the server's own again, which is how the handlers notice a client that disconnects.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import ServerMetrics
from .protocol import error_body

ENDPOINTS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/version",
    }
)
ARRIVAL = "plamo2_arrival"  # request.state key: time.monotonic() when the request's headers were in
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key (vLLM's rule too)


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: ServerMetrics,
        api_key: str | None,
        max_body_bytes: int,
        open_paths: Collection[str] = OPEN_PATHS,
    ) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVAL] = time.monotonic()  # the request's clock starts before its body
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        send = self._counting(send, endpoint)
        if not self._authorized(scope):
            await _refuse(
                send,
                401,
                "a valid API key is needed: send it as `Authorization: Bearer KEY`",
                "invalid_request_error",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send)
            return
        body = await self._read_body(receive)
        if body is None:  # the client left while sending
            return
        if len(body) > self.max_body_bytes:
            await self._too_large(send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or scope["path"] in self.open_paths:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)  # constant time: no key guessing by timing

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or what exceeds the limit by one chunk (enough to refuse it)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            parts.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send: Send) -> None:
        await _refuse(
            send,
            413,
            f"the request body is larger than {self.max_body_bytes} bytes",
            "invalid_request_error",
            "request_too_large",
            {"connection": "close"},
        )

    def _counting(self, send: Send, endpoint: str) -> Send:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.inc(endpoint=endpoint, status=str(message["status"]))
            await send(message)

        return counted


def _content_length(scope: Scope) -> int | None:
    raw = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None  # the server (h11/httptools) refuses a malformed one before we get here


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, status: int, message: str, type: str, code: str, headers: dict[str, str]) -> None:
    payload = json.dumps(error_body(message, type, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
