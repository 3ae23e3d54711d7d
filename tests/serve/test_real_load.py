"""Load on `plamo2-tools serve` (the runtime's continuous batching behind real HTTP): 64 concurrent
clients with ragged prompts and lengths each get their one-at-a-time greedy answer; clients that
leave mid-stream give their slots back (seen in /metrics); SIGTERM under load lets every running
request finish and exits 0.  Bounded: tiny model, at most a few hundred tokens per client."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_serve import CliServer, Oracle

pytestmark = pytest.mark.slow
CLIENTS = 64


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=3)


@pytest.fixture(scope="module")
def oracle(shard_dir: Path) -> Iterator[Oracle]:
    o = Oracle(shard_dir)
    yield o
    o.close()


def ragged_requests(seed: int, count: int) -> list[dict[str, Any]]:
    """Distinct prompts of 1..40 token ids (BOS first), 1..48 new tokens; half of them streamed."""
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [1, 4 + i] + [rnd.randrange(4, 1000) for _ in range(rnd.randrange(0, 39))]  # 4 + i: all distinct
        out.append(
            {
                "prompt": prompt,
                "max_tokens": rnd.randrange(1, 49),
                "temperature": 0,
                "stream": i % 2 == 1,
                "return_token_ids": True,
                "user": f"client-{i}",
            }
        )
    return out


def post(url: str, body: dict[str, Any]) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of one completion, streamed or not."""
    with httpx.Client(base_url=url, timeout=300) as h:
        if not body["stream"]:
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["text"], c["token_ids"], c["finish_reason"]
        text, ids, finish = "", [], None
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            c = json.loads(line.removeprefix("data: "))["choices"][0]
            text += c["text"]
            ids += c.get("token_ids") or []
            finish = c["finish_reason"] or finish
        return text, ids, finish


def test_64_concurrent_clients_get_their_one_at_a_time_answers(shard_dir: Path, oracle: Oracle) -> None:
    reqs = ragged_requests(11, CLIENTS)
    server = CliServer(shard_dir, "--max-batch", "16", "--max-context", "128")  # 16 slots: most clients wait
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            t0 = time.monotonic()
            got = list(pool.map(lambda b: post(server.url, b), reqs))
            seconds = time.monotonic() - t0
        m = server.metrics()
    finally:
        assert server.stop() == 0, server.output
    for body, (text, ids, finish) in zip(reqs, got, strict=True):
        want = oracle.tokens(body["prompt"], body["max_tokens"])
        assert ids == want, body["user"]
        assert (text, finish) == oracle.text(want), body["user"]
    assert m['plamo2_http_requests_total{endpoint="/v1/completions",status="200"}'] == CLIENTS  # none lost or doubled
    assert m["plamo2_generation_tokens_total"] == sum(len(g[1]) for g in got)
    assert m["plamo2_running_sequences"] == 0 and m["plamo2_queue_length"] == 0
    assert seconds < 120


def test_clients_leaving_mid_stream_free_their_slots(shard_dir: Path, oracle: Oracle) -> None:
    server = CliServer(shard_dir, "--max-batch", "8", "--max-queue", "8", "--max-context", "4096")
    try:
        release = threading.Event()

        def leave_after_first_chunk(i: int) -> None:
            body = {"prompt": [1, 10 + i], "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200  # (a queued stream's 200 comes with its first tokens)
                lines = r.iter_lines()  # kept: a dropped generator closes the response (the client leaves)
                next(lines)
                if i < 8:
                    assert release.wait(120)  # the 8 decoding clients hold their slots until all 16 are in

        threads = [threading.Thread(target=leave_after_first_chunk, args=(i,)) for i in range(16)]
        for t in threads[:8]:
            t.start()
        deadline = time.monotonic() + 60
        while server.metrics().get("plamo2_running_sequences", 0) < 8:
            assert time.monotonic() < deadline, f"8 streams never ran at once: {server.metrics()}"
            time.sleep(0.05)
        for t in threads[8:]:
            t.start()
        while server.metrics().get("plamo2_admitted_sequences", 0) < 16:
            assert time.monotonic() < deadline, "the queued streams were never admitted"
            time.sleep(0.05)
        while server.metrics().get("plamo2_queue_length", 0) < 8:  # the loop takes them at its next iteration
            assert time.monotonic() < deadline, "the queued streams never reached the loop's queue"
            time.sleep(0.05)
        release.set()  # the first 8 leave now; the queued 8 take their slots, read one chunk, leave
        for t in threads:
            t.join(120)
        # The handlers count a cancellation when they see the client leave; the engine frees the slot at
        # its next iteration, so the gauges may lag the counter by a step: wait for the whole idle state
        # (a slot that is never freed still fails at the deadline).
        idle = {
            'plamo2_sequences_finished_total{reason="cancelled"}': 16,
            "plamo2_running_sequences": 0,
            "plamo2_admitted_sequences": 0,
            "plamo2_queue_length": 0,
        }
        settle = time.monotonic() + 30  # from here: the joins above may take long on a loaded machine
        while True:  # at least one look, however long the joins took
            m = server.metrics()
            if all(m.get(k) == v for k, v in idle.items()) or time.monotonic() > settle:
                break
            time.sleep(0.05)
        assert {k: m.get(k) for k in idle} == idle, m
        assert m["plamo2_generation_tokens_total"] < 16 * 4000 / 4, "cancelled sequences kept decoding"
        # the freed slots serve at once
        text, ids, finish = post(
            server.url,
            {"prompt": [1, 7, 8], "max_tokens": 5, "temperature": 0, "stream": False, "return_token_ids": True},
        )
        assert ids == oracle.tokens([1, 7, 8], 5)
    finally:
        assert server.stop() == 0, server.output


def test_sigterm_under_load_drains_and_exits_0(shard_dir: Path, oracle: Oracle) -> None:
    reqs = [{**r, "max_tokens": 200 + i % 20} for i, r in enumerate(ragged_requests(5, 16))]
    server = CliServer(shard_dir, "--max-batch", "4", "--max-context", "300", "--shutdown-timeout", "120")
    firsts = threading.Semaphore(0)

    def client(body: dict[str, Any]) -> tuple[str, list[int], str | None]:
        firsts.release()
        return post(server.url, body)

    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = [pool.submit(client, b) for b in reqs]
        for _ in reqs:
            firsts.acquire()
        # Every request received before the signal: admitted now or already finished (on a busy machine
        # the first ones can end before the last one arrives, so the admitted gauge alone may never
        # reach 16).  Some must still be unfinished, or there is nothing to drain.
        deadline = time.monotonic() + 120
        while True:
            m = server.metrics()
            admitted = m.get("plamo2_admitted_sequences", 0)
            ended = sum(v for k, v in m.items() if k.startswith("plamo2_sequences_finished_total"))
            if admitted + ended >= len(reqs):
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        server.proc.send_signal(15)
        assert admitted > 0, m
        time.sleep(0.5)
        late = None
        with contextlib.suppress(httpx.TransportError):  # refused: the listening socket is closed, as it should be
            late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        got = [f.result(300) for f in futures]
    rc = server.proc.wait(120)
    assert rc == 0, server.output
    assert late is None or late.status_code == 503
    for body, (text, ids, finish) in zip(reqs, got, strict=True):
        want = oracle.tokens(body["prompt"], body["max_tokens"])
        assert ids == want and (text, finish) == oracle.text(want), body["user"]
