"""serve_forever in a real process: SIGTERM/SIGINT stop new connections, let running requests
finish (up to the timeout, then cancel them), stop the engine and exit 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class ServerProcess:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "serve_shutdown_main.py"), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the server did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
        self.port = json.loads(line)["port"]
        self.url = f"http://127.0.0.1:{self.port}"

    def finish(self, timeout: float) -> tuple[int, dict[str, Any], str]:
        out, err = self.proc.communicate(timeout=timeout)
        report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        return self.proc.returncode, report, err

    def refuses_connections(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return False
        except OSError:
            return True


@pytest.fixture
def start() -> Iterator[Any]:
    procs: list[ServerProcess] = []

    def run(*args: str) -> ServerProcess:
        procs.append(ServerProcess(*args))
        return procs[-1]

    yield run
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """A streaming client reading to the end; `first` is set once its first event arrived."""
    result: dict[str, Any] = {"text": "", "done": False, "finish": None}
    first = threading.Event()

    def read() -> None:
        body = {"prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        result["done"] = True
                    elif line.startswith("data: ") and '"error"' in line[:20]:
                        result["error_event"] = json.loads(line[6:])["error"]
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        result["text"] += choice["text"]
                        result["finish"] = choice["finish_reason"] or result["finish"]
                        first.set()
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        first.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, result, first


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_running_requests_finish_then_exit_0(start: Any, sig: signal.Signals) -> None:
    server = start("--delay", "0.03", "--shutdown-timeout", "20")
    thread, result, first = stream_in_thread(server.url, 40)  # ~1.2 s of tokens
    assert first.wait(10)
    t0 = time.monotonic()
    server.proc.send_signal(sig)
    deadline = time.monotonic() + 5
    while not server.refuses_connections():  # new connections are refused at once
        assert time.monotonic() < deadline, "still accepting connections after the signal"
        time.sleep(0.02)
    assert thread.is_alive(), "the running stream must still be going"
    rc, report, err = server.finish(timeout=20)
    thread.join(5)
    assert rc == 0, err
    assert result["done"] and result["finish"] == "length" and len(result["text"]) == 40, result
    assert report == {"rc": 0, "stopped": True, "cancelled": []}
    assert time.monotonic() - t0 < 10


def test_requests_past_the_timeout_are_cut_the_way_clients_know_and_exit_is_still_0(start: Any) -> None:
    """The cut stream ends with OpenAI's error event and then [DONE] (before: the connection just
    closed, no [DONE], and uvicorn logged the cancelled task's traceback); seen failing without
    `ServerState.cut_all` (done False, a traceback on stderr)."""
    server = start("--delay", "0.05", "--shutdown-timeout", "0.5")
    thread, result, first = stream_in_thread(server.url, 1000)  # ~50 s: far beyond the timeout
    assert first.wait(10)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc, report, err = server.finish(timeout=15)
    elapsed = time.monotonic() - t0
    thread.join(5)
    assert rc == 0, err
    assert elapsed < 5, f"took {elapsed:.1f} s for a 0.5 s shutdown timeout"
    assert report["stopped"] and len(report["cancelled"]) == 1, report  # the engine sequence was cancelled
    assert result["finish"] is None and result["done"], result  # no finish reason, but [DONE] after the error
    assert result["error_event"]["code"] == 503 and "shutdown-timeout" in result["error_event"]["message"]
    assert "Traceback" not in err and "cut by the shutdown timeout" in err, err


def test_idle_server_exits_0_at_once(start: Any) -> None:
    server = start()
    assert httpx.get(f"{server.url}/health").status_code == 200
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc, report, err = server.finish(timeout=10)
    assert rc == 0 and report["stopped"], err
    assert time.monotonic() - t0 < 3
