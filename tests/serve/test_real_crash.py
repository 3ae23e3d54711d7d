"""The runtime failing under a real `plamo2-tools serve`: the requests in flight get 500 (or an
in-stream error once streaming began) and the process exits non-zero by
itself instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import real_serve

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=3)


@pytest.mark.slow
def test_a_dead_loop_fails_requests_and_exits_nonzero(shard_dir: Path) -> None:
    cmd = [
        sys.executable,
        str(HERE / "serve_crash_main.py"),
        "5",
        "serve",
        str(shard_dir),
        "--port",
        "0",
        "--max-batch",
        "4",
        "--max-context",
        "128",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(real_serve.ROOT), str(HERE)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        lines: list[str] = []
        assert proc.stderr is not None
        while url is None:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            m = real_serve.SERVING.search(line)
            url = m.group(2) if m else None
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 5], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200  # decode steps 1-4 still work (warm-up and this request)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 6], "max_tokens": 40, "temperature": 0}, timeout=60)
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["error"]["type"] == "server_error" and "injected" in body["error"]["message"]
        rc = proc.wait(60)  # by itself: no signal sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines) + (proc.stderr.read() if proc.stderr else "")
    assert rc != 0, err  # by itself, soon: never a hung server
    assert "injected: the device fell over" in err
    assert rc == 70 and "bug: plamo2-tools" in err  # a failure of the runtime is reported as a bug, with its traceback
