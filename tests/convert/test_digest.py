"""Stream hashing: the digests convert records without reading its files back."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from plamo2_tools.digest import HashWorker, StreamDigest, sha256_file

DATA = bytes(range(256)) * 41 + b"tail"
RANGES = {"a": (0, 10), "b": (10, 4000), "c": (4000, len(DATA)), "empty": (7, 7)}


def expected() -> tuple[str, dict[str, str]]:
    return hashlib.sha256(DATA).hexdigest(), {k: hashlib.sha256(DATA[s:e]).hexdigest() for k, (s, e) in RANGES.items()}


@pytest.mark.parametrize("block", [1, 3, 10, 997, len(DATA)])
def test_in_order_writes_give_the_plain_sha256(block: int) -> None:
    d = StreamDigest(len(DATA), RANGES)
    for off in range(0, len(DATA), block):
        d.update(off, memoryview(DATA)[off : off + block])
    assert d.result() == expected()


def test_out_of_order_or_short_stream_gives_up() -> None:
    d = StreamDigest(len(DATA), RANGES)
    d.update(0, memoryview(DATA)[:100])
    d.update(200, memoryview(DATA)[200:300])  # skipped bytes 100..200
    d.update(100, memoryview(DATA)[100:200])
    assert d.result() is None
    short = StreamDigest(len(DATA), RANGES)
    short.update(0, memoryview(DATA)[:100])
    assert short.result() is None


def test_worker_and_file_hash_agree(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(DATA)
    assert sha256_file(path, RANGES) == expected()
    worker = HashWorker("test")
    d = StreamDigest(len(DATA), RANGES)
    for off in range(0, len(DATA), 512):
        worker.submit(d, off, memoryview(DATA)[off : off + 512])
    worker.drain()
    worker.close()
    assert d.result() == expected()
