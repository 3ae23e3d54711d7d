"""`plamo2-tools serve` on a TP2 x PP2 layout: the four ranks as threads of the server's process,
and (`--launch`) as four torchrun processes on gloo where rank 0 serves HTTP and the others follow
its loop.  Both answer as the in-process runtime does alone, and both exit 0 on SIGTERM, leaving
no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from real_serve import CliServer, Oracle

pytestmark = pytest.mark.slow
KEY = "layout-key"
PROMPTS = ["Hello world", "The cat sat on", "1 2 3 4 5", "日本語"]


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 2, 2, seed=3)


@pytest.fixture(scope="module")
def oracle(shard_dir: Path) -> Iterator[Oracle]:
    o = Oracle(shard_dir)
    yield o
    o.close()


def children(pid: int) -> set[int]:
    """Every descendant of `pid` now."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    parent = {int(c): int(p) for c, p in (line.split() for line in out.splitlines())}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("launch", [False, True], ids=["threads", "torchrun"])
def test_tp2_pp2_serves_the_runtimes_answers(shard_dir: Path, oracle: Oracle, launch: bool) -> None:
    # the API key reaches rank 0 as --api-key (torchrun: through launch's environment) or PLAMO2_API_KEY
    key = ("--api-key", KEY) if launch else ()
    server = CliServer(
        shard_dir,
        "--max-batch",
        "4",
        "--max-context",
        "256",
        *key,
        *(["--launch"] if launch else []),
        env=None if launch else {"PLAMO2_API_KEY": KEY},
    )
    ranks = children(server.proc.pid)
    try:
        assert "tp2×pp2" in server.output and ("torchrun ranks" in server.output) == launch
        with pytest.raises(openai.AuthenticationError):
            server.client().completions.create(model=server.model, prompt="x", max_tokens=1)
        client = server.client(api_key=KEY)
        r = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=24, temperature=0)
        assert [(c.text, c.finish_reason) for c in r.choices] == [oracle.complete(p, 24) for p in PROMPTS]
        chunks = list(
            client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == oracle.complete(PROMPTS[1], 30)[0]
        sampled = client.completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=12, temperature=0.8, seed=42
        )
        ids = oracle.ids(PROMPTS[0])
        assert sampled.choices[0].text == oracle.text(oracle.tokens(ids, 12, temperature=0.8, seed=42))[0]
    finally:
        rc = server.stop(signal.SIGTERM, timeout=120)
    assert rc == 0, server.output
    if launch:
        assert len(ranks) >= 5, ranks  # torchrun's agent and its four ranks
    alive = [p for p in ranks if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
    assert not alive, f"ranks left behind: {alive}"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
