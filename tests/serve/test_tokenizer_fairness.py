"""Tokenizing never stalls other clients: a request is counted (and its oversized texts refused)
before any of it is tokenized, and the tokenizer thread serves requests in turn, one text each, so
one request with many prompts never makes a one-prompt request wait for all of them."""

from __future__ import annotations

import asyncio
import threading

import httpx
from serve_fake_engine import FakeEngine
from serve_harness import running_server

from plamo2_tools.serve.prompts import TokenizerThread


class CountingEngine(FakeEngine):
    """The fake, counting every text it is asked to tokenize."""

    def __init__(self) -> None:
        super().__init__(max_batch=8)
        self.tokenized = 0

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self.tokenized += 1
        return super().tokenize(text, add_special_tokens)


def test_a_million_prompts_are_refused_before_one_is_tokenized() -> None:
    """Seen failing before the count moved ahead of tokenizing: 1,000,000 texts tokenized, then the 400."""
    engine = CountingEngine()
    with running_server(engine) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["ab"] * 10**6, "max_tokens": 1}, timeout=120)
        assert r.status_code == 400 and "needs 1000000 sequences" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["ab"] * 5, "n": 60, "max_tokens": 1})
        assert r.status_code == 400 and "needs 300 sequences" in r.json()["error"]["message"], r.text
        assert engine.tokenized == 0
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and engine.tokenized == 1


class GatedEngine(FakeEngine):
    """Tokenizing "slow" waits for the test's permission; each text is logged when tokenized."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.gate = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if text.startswith("slow"):
            self.entered.release()
            assert self.gate.acquire(timeout=30), "the test never let the tokenizer go on"
        self.order.append(text)
        return super().tokenize(text, add_special_tokens)


def test_requests_take_turns_on_the_tokenizer_thread() -> None:
    """While request A's first text is being tokenized, B (one text) arrives: B is tokenized next, before
    the rest of A.  Seen failing with the thread pool it replaced (first in, first out: B last)."""

    async def run() -> list[str]:
        engine = GatedEngine()
        tok = TokenizerThread(engine)
        a = asyncio.ensure_future(tok.encode(["slow-a0", "slow-a1", "slow-a2"], True))
        await asyncio.get_running_loop().run_in_executor(None, engine.entered.acquire)  # A's first is running
        b = asyncio.ensure_future(tok.encode(["b"], True))
        await asyncio.sleep(0)  # B queued behind the running text
        for _ in range(3):
            engine.gate.release()
        await asyncio.wait_for(asyncio.gather(a, b), 30)
        tok.close()
        return engine.order

    assert asyncio.run(run()) == ["slow-a0", "b", "slow-a1", "slow-a2"]


def test_an_abandoned_request_is_not_tokenized_further() -> None:
    """A client gone mid-request (its handler cancelled) leaves the rest of its texts untokenized."""

    async def run() -> list[str]:
        engine = GatedEngine()
        tok = TokenizerThread(engine)
        a = asyncio.ensure_future(tok.encode(["slow-a0", "a1", "a2"], True))
        await asyncio.get_running_loop().run_in_executor(None, engine.entered.acquire)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)  # the handler is gone
        engine.gate.release()
        ok = await asyncio.wait_for(tok.encode(["c"], True), 30)  # the thread goes on with others
        tok.close()
        assert ok == [engine.tokenize("c", True)]
        return engine.order

    assert asyncio.run(run())[:2] == ["slow-a0", "c"]
