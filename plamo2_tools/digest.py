"""sha256 of whole files and of the byte ranges (tensors) inside them.

`StreamDigest` hashes bytes as they are written front to back (convert lays every file out in the
order it writes it, so no byte has to be read back); `sha256_file` reads a finished file once.
hashlib releases the GIL on large buffers, so hashing threads run beside the copying thread.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

BLOCK = 16 * 2**20


class StreamDigest:
    """sha256 of the whole stream (optional) and of named [start, stop) ranges of it.

    Bytes must arrive in order; the first write anywhere but the next byte marks the stream
    out of order, and `result()` then returns None so the caller hashes the finished file instead.
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
    size = path.stat().st_size
    digest = StreamDigest(size, ranges or {})
    buf = bytearray(BLOCK)  # reused: a fresh 16 MiB object per read costs page faults on every block
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while got := f.readinto(buf):
            digest.update(pos, memoryview(buf)[:got])
            pos += got
    result = digest.result()
    if result is None:  # the file changed size while we read it
        raise OSError(f"{path}: changed while being hashed")
    return result  # type: ignore[return-value]


class HashWorker:
    """One thread that feeds (digest, offset, bytes) to digests in FIFO order.

    The queue is bounded so memory stays at a few chunks when hashing is slower than copying.
    """

    def __init__(self, name: str, depth: int = 16) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                digest, offset, data = item
                digest.update(offset, data)
            except BaseException as e:  # noqa: BLE001 - reported by drain()
                self.error = e
            finally:
                self.queue.task_done()

    def submit(self, digest: StreamDigest, offset: int, data: memoryview) -> None:
        self.queue.put((digest, offset, data))

    def drain(self) -> None:
        """Wait until everything submitted so far is hashed."""
        self.queue.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
