"""Hashing: the algorithms the shard format names, and byte ranges of files hashed in place.

SHA-256 stays where it is the thing compared (a Hugging Face cache blob is named by its SHA-256;
format version 1 records it); XXH3-128 (the `xxhash` package, ~10x faster per core) is what format
version 2 records.  Ranges are hashed straight out of the page cache through a read-only mmap
window: no copy into our memory, and the window is unmapped before the next one, so resident
memory stays at one window per thread.  Both libraries release the GIL on large buffers, so
hashing threads run on every core beside the copying.

`StreamDigest` hashes bytes that arrive in order (a whole file and named ranges of it in one pass,
what format version 1 needs).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import xxhash


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


SHA256 = "sha256"
XXH3_128 = "xxh3-128"
HASHES: dict[str, Callable[[], Hasher]] = {SHA256: hashlib.sha256, XXH3_128: xxhash.xxh3_128}
WINDOW = 16 * 2**20  # bytes mapped at a time: big enough that mapping costs nothing, small in RSS
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the whole window in with one call (Linux)


def new_hash(name: str) -> Hasher:
    try:
        return HASHES[name]()
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r} (known: {', '.join(HASHES)})") from None


def mapped_windows(fd: int, start: int, stop: int, window: int | None = None) -> Iterable[memoryview]:
    """Bytes [start, stop) of an open file as consecutive read-only views of the page cache.

    Each view is valid only until the next one is requested (its mapping is closed then).  The
    file must not shrink meanwhile (a mapped page past the end would be a SIGBUS): callers check
    sizes first."""
    window = window or WINDOW
    pos = start
    while pos < stop:
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        end = min(stop, base + window)
        m = mmap.mmap(fd, end - base, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=base)
        view = memoryview(m)
        part = view[pos - base : end - base]
        try:
            yield part
        finally:  # every view released first: an mmap with exported buffers cannot be closed
            part.release()
            view.release()
            m.close()
        pos = end


def hash_range(fd: int, start: int, stop: int, hashers: Iterable[Hasher]) -> None:
    """Feed bytes [start, stop) of an open file to every hasher, each byte read once."""
    hashers = list(hashers)
    for view in mapped_windows(fd, start, stop):
        for h in hashers:
            h.update(view)


def hash_file(path: Path, algorithms: Iterable[str]) -> dict[str, str]:
    """{algorithm: hex digest of the whole file}, all algorithms from one pass over the bytes."""
    hashers = {a: new_hash(a) for a in algorithms}
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_range(fd, 0, os.fstat(fd).st_size, hashers.values())
    finally:
        os.close(fd)
    return {a: h.hexdigest() for a, h in hashers.items()}


class StreamDigest:
    """sha256 of the whole stream (optional) and of named [start, stop) ranges of it.

    Bytes must arrive in order; the first write anywhere but the next byte marks the stream
    out of order, and `result()` then returns None.
    """

    def __init__(self, size: int, ranges: dict[str, tuple[int, int]], whole: bool = True) -> None:
        self.size = size
        self.whole = hashlib.sha256() if whole else None
        self.order = sorted(ranges.items(), key=lambda kv: kv[1][0])
        self.parts = {name: hashlib.sha256() for name in ranges}
        self.cursor = 0
        self.in_order = True
        self._i = 0  # first range that may still overlap the next bytes

    def update(self, offset: int, data: memoryview) -> None:
        if not self.in_order:
            return
        if offset != self.cursor:
            self.in_order = False
            return
        if self.whole is not None:
            self.whole.update(data)
        start, end = offset, offset + len(data)
        while self._i < len(self.order) and self.order[self._i][1][1] <= start:
            self._i += 1
        j = self._i
        while j < len(self.order) and self.order[j][1][0] < end:
            name, (lo, hi) = self.order[j]
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                self.parts[name].update(data[lo - start : hi - start])
            j += 1
        self.cursor = end

    def result(self) -> tuple[str | None, dict[str, str]] | None:
        if not self.in_order or self.cursor != self.size:
            return None
        return (self.whole.hexdigest() if self.whole else None), {n: h.hexdigest() for n, h in self.parts.items()}


def sha256_file(path: Path, ranges: dict[str, tuple[int, int]] | None = None) -> tuple[str, dict[str, str]]:
    """(file sha256, {name: sha256 of bytes [start, stop)}) with each byte read once."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        digest = StreamDigest(size, ranges or {})
        pos = 0
        for view in mapped_windows(fd, 0, size):
            digest.update(pos, view)
            pos += len(view)
    finally:
        os.close(fd)
    result = digest.result()
    if result is None:  # cannot happen for a file of constant size; kept as a guard
        raise OSError(f"{path}: changed while being hashed")
    return result  # type: ignore[return-value]
