"""Hashing primitives: byte ranges hashed in place through mmap windows, and the in-order stream
digest format version 1 needs, against hashlib/xxhash on the plain bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import xxhash

from plamo2_tools import digest as digest_module
from plamo2_tools.digest import StreamDigest, hash_file, hash_range, new_hash, sha256_file

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


@pytest.mark.parametrize("window", [4096, 8192, 2**20])
def test_file_hashes_through_small_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    """Windows smaller than the file, ranges starting off page boundaries and crossing windows."""
    data = os.urandom(3 * 8192 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    monkeypatch.setattr(digest_module, "WINDOW", window)
    assert sha256_file(path, {"x": (5, 9000), "y": (9000, len(data))}) == (
        hashlib.sha256(data).hexdigest(),
        {"x": hashlib.sha256(data[5:9000]).hexdigest(), "y": hashlib.sha256(data[9000:]).hexdigest()},
    )
    assert hash_file(path, ["sha256", "xxh3-128"]) == {
        "sha256": hashlib.sha256(data).hexdigest(),
        "xxh3-128": xxhash.xxh3_128(data).hexdigest(),
    }
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, stop in [(0, 0), (4095, 4097), (1, len(data)), (8191, 3 * 8192 + 1)]:
            h = new_hash("xxh3-128")
            hash_range(fd, start, stop, [h])
            assert h.hexdigest() == xxhash.xxh3_128(data[start:stop]).hexdigest(), (start, stop)
    finally:
        os.close(fd)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        new_hash("md5")
