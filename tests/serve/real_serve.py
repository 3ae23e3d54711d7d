"""The real thing, for the tests named test_real_*: `plamo2-tools serve SHARDS` as a subprocess (the
CLI a user runs, on the runtime, ranks as threads or torchrun ranks), on a free loopback port, and
the one-at-a-time greedy answers it must give (in-process `Runtime.generate`, one request per call,
so no batching can be shared with the server's).

The server binds port 0 and prints `serving MODEL on http://127.0.0.1:PORT (...)` on stderr once
it takes connections; `CliServer` reads the port from that line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.text import cut_at_stop, decode_kept_specials, stop_token_ids

ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"serving (\S+) on (http://[^\s,]+)")
START_TIMEOUT_S = 120.0  # --launch: torchrun, imports and loading in every rank on a busy 2-core machine


class CliServer:
    """`python -m plamo2_tools.cli serve SHARDS --port 0 ARGS...`, stopped by `stop()` (SIGTERM)."""

    def __init__(self, shards: Path, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "plamo2_tools.cli", "serve", str(shards), "--port", "0", *args]
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "NO_COLOR": "1",
            "COLUMNS": "250",
            **(env or {}),
        }
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.model = ""
        self.url = ""
        self._up = threading.Event()
        threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._up.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"serve did not start (exit {self.proc.returncode}):\n{self.output}")

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)
            m = SERVING.search(line)
            if m and not self._up.is_set():
                self.model, self.url = m.group(1), m.group(2)
                self._up.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples and `name{labels}` samples of /metrics, as numbers."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"serve did not exit within {timeout} s of {signal.Signals(sig).name}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class Oracle:
    """One-at-a-time answers of the in-process runtime: each request alone in its own `generate`
    call, EOS by the checkpoint's rule, text decoded with specials kept (the EOS that ended it
    shows none), cut at the earliest stop string."""

    def __init__(self, shards: Path) -> None:
        self.rt = Runtime(shards, mode="local")
        self.tok = self.rt.tokenizer
        self.decode = decode_kept_specials(self.tok)
        self.eos = stop_token_ids(shards, self.tok)

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def tokens(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        key: int = 0,
    ) -> list[int]:
        gen = self.rt.generate(
            [list(prompt)],
            max_tokens,
            eos_token_ids=self.eos,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            request_keys=[key],
        )
        return list(gen.tokens[0])

    def text(self, tokens: Sequence[int], stop: Sequence[str] = ()) -> tuple[str, str]:
        """(text, finish_reason) of these generated tokens under `stop`."""
        ended_by_eos = bool(tokens) and tokens[-1] in self.eos
        text, hit = cut_at_stop(self.decode(list(tokens[:-1] if ended_by_eos else tokens)), stop)
        return text, "stop" if hit or ended_by_eos else "length"

    def complete(self, prompt: str | Sequence[int], max_tokens: int, stop: Sequence[str] = ()) -> tuple[str, str]:
        ids = self.ids(prompt) if isinstance(prompt, str) else list(prompt)
        return self.text(self.tokens(ids, max_tokens), stop)

    def close(self) -> None:
        self.rt.close()
