"""Servers `verify` must cope with that cannot run here, on a loopback port (standard library only).

The first path segment of a request picks the behaviour, so one server serves every case:

* `/garbage/...`: 200 with an HTML page (a proxy's error page, a wrong port).
* `/deep/...`: 200 with JSON nested 100,000 levels deep.
* `/types/...`: 200 with JSON of the wrong types (`{"data": "x"}` for the model list).
* `/slow/...`: answers after `SLOW_S` seconds (longer than the test's --timeout).
* `/llama/...`: llama-server's documented behaviour in front of a real `plamo2-tools serve`:
  `echo` refused with HTTP 500 and llama.cpp's own message ("Only no echo is supported",
  tools/server/utils.hpp `oaicompat_completion_params_parse`), vLLM's extension fields ignored,
  and generated-token logprobs in llama.cpp's `content` shape (`id`, `token`, `logprob`,
  `top_logprobs: [{id, token, logprob}]`).  Every number is the real server's.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SLOW_S = 5.0
LLAMA_ECHO_ERROR = {"error": {"code": 500, "message": "Only no echo is supported", "type": "server_error"}}


class OddServer:
    """start() -> base URL of the server; `upstream` is the real server behind /llama."""

    def __init__(self, upstream: str | None = None, upstream_key: str | None = None) -> None:
        self.upstream = upstream
        self.upstream_key = upstream_key
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                owner.handle(self, None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                owner.handle(self, self.rfile.read(length))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- behaviours ----------------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        mode, _, rest = h.path.lstrip("/").partition("/")
        if mode == "garbage":
            return _send(h, 200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
        if mode == "deep":
            return _send(h, 200, b"[" * 100_000 + b"]" * 100_000)
        if mode == "types":
            return _send(h, 200, json.dumps({"object": "list", "data": "x"}).encode())
        if mode == "slow":
            time.sleep(SLOW_S)
            return _send(h, 200, json.dumps({"data": [{"id": "m"}]}).encode())
        if mode == "llama":
            return self.llama(h, "/" + rest, body)
        return _send(h, 404, json.dumps({"error": {"message": "no such route"}}).encode())

    def llama(self, h: BaseHTTPRequestHandler, path: str, body: bytes | None) -> None:
        if path == "/v1/completions" and body is not None:
            req = json.loads(body)
            if req.get("echo"):
                return _send(h, 500, json.dumps(LLAMA_ECHO_ERROR).encode())
            for key in ("return_tokens_as_token_ids", "return_token_ids"):
                req.pop(key, None)  # llama-server ignores fields it does not know
            status, answer = self.forward(path, {**req, "return_tokens_as_token_ids": True})
            if status == 200:
                for choice in answer["choices"]:
                    choice["logprobs"] = _llama_logprobs(choice["logprobs"])
            return _send(h, status, json.dumps(answer).encode())
        status, answer = self.forward(path, json.loads(body) if body is not None else None)
        return _send(h, status, json.dumps(answer).encode())

    def forward(self, path: str, req: Any) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self.upstream_key:
            headers["Authorization"] = f"Bearer {self.upstream_key}"
        data = json.dumps(req).encode() if req is not None else None
        r = urllib.request.Request(self.upstream + path, data=data, headers=headers, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(r, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


def _llama_logprobs(legacy: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's legacy logprobs (tokens named "token_id:N") -> llama.cpp's `content` list."""

    def tid(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    content = []
    for name, lp, top in zip(legacy["tokens"], legacy["token_logprobs"], legacy["top_logprobs"], strict=True):
        alts = [{"id": tid(k), "token": f"<{tid(k)}>", "logprob": v} for k, v in (top or {}).items()]
        content.append({"id": tid(name), "token": f"<{tid(name)}>", "logprob": lp, "bytes": [], "top_logprobs": alts})
    return {"content": content}


def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, kind: str = "application/json") -> None:
    try:
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
        pass
