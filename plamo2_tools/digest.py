"""sha256 of whole files and of the byte ranges (tensors) inside them, in one sequential read."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 16 * 2**20


def sha256_file(path: Path, ranges: dict[str, tuple[int, int]] | None = None) -> tuple[str, dict[str, str]]:
    """(file sha256, {name: sha256 of bytes [start, stop)}) with each byte read once.

    hashlib releases the GIL on large buffers, so this runs in parallel with other threads.
    """
    whole = hashlib.sha256()
    ranges = ranges or {}
    order = sorted(ranges.items(), key=lambda kv: kv[1][0])
    parts = {name: hashlib.sha256() for name in ranges}
    i = 0  # first range that may still overlap the current block
    buf = bytearray(BLOCK)  # reused: a fresh 16 MiB object per read costs page faults on every block
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while got := f.readinto(buf):
            view = memoryview(buf)[:got]
            whole.update(view)
            end = pos + got
            while i < len(order) and order[i][1][1] <= pos:
                i += 1
            j = i
            while j < len(order) and order[j][1][0] < end:
                name, (start, stop) = order[j]
                lo, hi = max(start, pos), min(stop, end)
                if lo < hi:
                    parts[name].update(view[lo - pos : hi - pos])
                j += 1
            pos = end
    return whole.hexdigest(), {name: h.hexdigest() for name, h in parts.items()}

