"""Writing the planned output tensors at copy speed, on every core.

Every output tensor is a run of byte segments in output order, each one of:

  copy     a verbatim byte range of a source file (rows of a tensor kept in its dtype: the bulk of
           the model, in_proj's regrouped heads and q/k/v included)
  gather   one column range of every row of a source tensor (the row-parallel weights)
  compute  values made in user space: transforms (A = -exp(A_log), norm offsets, casts), tensors of
           a shard source (rebuilt from pieces), constants
  zeros    vocab padding rows

Each tensor is one job for a pool of threads: it writes its segments at their planned offsets
and hashes its bytes in output order, so its digest needs no second read.  Copies go through the
kernel (`--copy auto`): `os.copy_file_range` moves page cache to page cache without a trip
through our memory, and the range it has just read is hashed through a read-only mmap of the
source's page cache: one copy and one hash pass per byte.  `copy_file_range` refuses some pairs
of files (across filesystems since Linux 5.19, on some network filesystems): `auto` then uses
`os.sendfile` (a kernel copy too), then `pread`/`pwrite` (user space, two copies; `--copy user`
forces it).  Gathers read the source through mmap and write one contiguous buffer.  Memory: each
worker maps or buffers at most one WINDOW at a time, and compute reads CHUNK_BYTES of rows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..digest import Hasher, hash_range, mapped_windows, new_hash
from ..dtypes import FLOAT32, DType
from ..errors import CheckpointError, EnvironmentLimitError
from ..model.layout import OutputTensor, Transform, apply_values
from ..safetensors_io import PartialFile, pread_into, tensor_bytes
from .sources import Source

WINDOW = 8 * 2**20  # bytes copied, mapped or buffered per step of a job
CHUNK_BYTES = 8 * 2**20  # source rows read per step of a compute segment
# A gather whose column range of a row is at least this many bytes is copied inside the kernel, one
# copy_file_range per row, and hashed from the output's page cache: for plamo-2-1b's 16 KiB
# ranges (TP2) that cost 0.75 s of system time per 1.5 GiB against 1.25-1.9 s through mmap + pwrite
# (this VM).  PLAMO2_GATHER_ROW_COPY=0 keeps every gather in user space, for measuring.
ROW_COPY_MIN = 8192 if os.environ.get("PLAMO2_GATHER_ROW_COPY", "1") != "0" else 2**62
COPY_MODES = ("auto", "copy_file_range", "sendfile", "user")
STATS = ("copy_file_range", "sendfile", "user", "gather", "compute", "zeros")
# Transforms that only say how pieces are arranged: the bytes stay verbatim.
LAYOUT_ONLY = {"regroup_in_proj", "pad_vocab"}
# copy_file_range/sendfile refusing this pair of files (not an I/O error): fall back.
_REFUSED = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


@dataclass(frozen=True)
class Copy:
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Gather:
    path: Path
    offset: int  # of the source tensor's first row
    rows: int
    row_bytes: int
    col_offset: int  # within a row
    col_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.col_bytes


@dataclass(frozen=True)
class Compute:
    index: int  # which piece of the tensor (-1: the whole tensor, a constant)
    nbytes: int


@dataclass(frozen=True)
class Zeros:
    nbytes: int


Segment = Copy | Gather | Compute | Zeros


def segments(t: OutputTensor, source: Source) -> list[Segment]:
    """The tensor's bytes as segments in output order."""
    if t.source not in source.tensors:  # a constant (`Family.extras`): no source rows
        return [Compute(-1, t.nbytes)]
    st = source.tensors[t.source]
    where = source.locate(t.source)
    verbatim = where is not None and t.dtype == st.dtype and all(x.name in LAYOUT_ONLY for x in t.transforms)
    out_row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
    out: list[Segment] = []
    for i, p in enumerate(t.pieces):
        if p.dim == 1 and len(t.pieces) != 1:
            raise AssertionError(f"{t.key}: a column piece must be the tensor's only piece")
        nbytes = t.nbytes if p.dim == 1 else p.length * out_row
        if p.source is None:
            out.append(Zeros(nbytes))
        elif not verbatim or where is None:
            out.append(Compute(i, nbytes))
        elif p.dim == 0:
            path, info = where
            out.append(Copy(path, info.offset + p.start * info.row_bytes, p.length * info.row_bytes))
        else:
            path, info = where
            elem = t.dtype.itemsize
            if p.length * elem == info.row_bytes:  # every column (TP1's row-parallel weights): whole rows
                out.append(Copy(path, info.offset, info.rows * info.row_bytes))
            else:
                out.append(Gather(path, info.offset, info.rows, info.row_bytes, p.start * elem, p.length * elem))
    if sum(s.nbytes for s in out) != t.nbytes:
        raise AssertionError(f"{t.key}: segments cover {sum(s.nbytes for s in out)} of {t.nbytes} bytes")
    return out


@dataclass
class Job:
    """One output tensor: where it goes and how its bytes are made."""

    part: PartialFile
    tensor: OutputTensor
    offset: int
    segments: list[Segment]


class Cancelled(Exception):
    """A job stopped because another one failed or the run was interrupted."""


@dataclass
class Writer:
    """Runs jobs; shared by the pool's threads (everything here is safe to share)."""

    source: Source
    algorithm: str
    mode: str = "auto"
    progress: Callable[[int], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))  # bytes by how they were made
    _kernel: str = ""  # the kernel copy in use: copy_file_range, then sendfile, then "" (user space)
    _fds: dict[Path, int] = field(default_factory=dict)
    _replicas: dict[tuple, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _local: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        if self.mode not in COPY_MODES:
            raise ValueError(f"copy mode {self.mode!r} is not one of {COPY_MODES}")
        self._kernel = {"auto": "copy_file_range", "user": ""}.get(self.mode, self.mode)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ---- a job ------------------------------------------------------------------------------
    def run(self, job: Job) -> str:
        """Write one tensor and return its digest."""
        t = job.tensor
        # Replicas (same source pieces, transforms and dtype on several ranks, e.g. a tied
        # embedding on the first and last stage) are the same bytes: hashed once.
        key = (t.source, t.pieces, t.transforms, t.dtype)
        with self._lock:
            known = self._replicas.get(key)
        h = None if known is not None else new_hash(self.algorithm)
        pos = job.offset
        for seg in job.segments:
            if isinstance(seg, Copy):
                self._copy(seg, job.part, pos, h)
            elif isinstance(seg, Gather):
                self._gather(seg, job.part, pos, h)
            elif isinstance(seg, Compute):
                self._compute(seg, job, pos, h)
            else:
                self._emit(job.part, pos, memoryview(bytes(seg.nbytes)), h, "zeros")
            pos += seg.nbytes
        if h is None:
            return known  # type: ignore[return-value]
        digest = h.hexdigest()
        with self._lock:
            self._replicas.setdefault(key, digest)
        return digest

    def _step(self, nbytes: int, kind: str) -> None:
        if self.cancel.is_set():
            raise Cancelled
        with self._lock:
            self.stats[kind] += nbytes
        if self.progress is not None:
            self.progress(nbytes)

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def _buffer(self, nbytes: int) -> memoryview:
        """A per-thread buffer, reused: fresh memory for every window would cost page faults."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(max(nbytes, WINDOW))
        return memoryview(buf)[:nbytes]

    def _emit(self, part: PartialFile, pos: int, data: memoryview, h: Hasher | None, kind: str) -> None:
        """Bytes made in our memory: hash, write."""
        if h is not None:
            h.update(data)
        part.write_at(pos, data)
        start_writeback(part.fd, pos, len(data))
        self._step(len(data), kind)

    # ---- segments ---------------------------------------------------------------------------
    def _copy(self, seg: Copy, part: PartialFile, pos: int, h: Hasher | None) -> None:
        src = self._fd(seg.path)
        for done in range(0, seg.nbytes, WINDOW):
            n = min(WINDOW, seg.nbytes - done)
            src_off, dst_off = seg.offset + done, pos + done
            kind = self._kernel_copy(src, src_off, part, dst_off, n, seg.path) if self._kernel else ""
            if kind:
                start_writeback(part.fd, dst_off, n)
                if h is not None:  # the range was just read into the page cache: hash it there
                    hash_range(src, src_off, src_off + n, [h])
                self._step(n, kind)
            else:
                view = self._buffer(n)
                pread_into(src, view, src_off, seg.path)
                self._emit(part, dst_off, view, h, "user")

    def _kernel_copy(self, src: int, src_off: int, part: PartialFile, dst_off: int, n: int, path: Path) -> str:
        """Copy n bytes inside the kernel; returns the method used, or "" when the kernel refused
        and the mode allows user space."""
        while self._kernel:
            kind = self._kernel
            try:
                if kind == "copy_file_range":
                    done = 0
                    while done < n:
                        got = os.copy_file_range(src, part.fd, n - done, src_off + done, dst_off + done)
                        if got == 0:
                            raise CheckpointError(f"{path}: truncated while being read (file shrank?)")
                        done += got
                else:
                    _sendfile(src, src_off, part, dst_off, n, path)
                return kind
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise EnvironmentLimitError(f"{part.partial}: no space left on device") from None
                if e.errno not in _REFUSED:
                    raise EnvironmentLimitError(f"{part.partial}: {kind}: {e.strerror or e}") from None
                if self.mode != "auto":
                    raise EnvironmentLimitError(
                        f"{part.partial}: --copy {self.mode} is refused here ({e.strerror}); use --copy auto"
                    ) from None
                with self._lock:  # fall back for the rest of the run (nothing was written: redo)
                    if self._kernel == kind:
                        self._kernel = "sendfile" if kind == "copy_file_range" else ""
        return ""

    def _gather(self, seg: Gather, part: PartialFile, pos: int, h: Hasher | None) -> None:
        """Columns [col_offset, col_offset + col_bytes) of every row: read through a mapping of the
        rows, collected into one buffer, written with one call."""
        src = self._fd(seg.path)
        step = max(1, WINDOW // seg.row_bytes)
        first = 0
        if self._kernel == "copy_file_range" and seg.col_bytes >= ROW_COPY_MIN:
            first = self._gather_in_kernel(seg, src, part, pos, h, step)
        for a in range(first, seg.rows, step):
            b = min(seg.rows, a + step)
            out = self._buffer((b - a) * seg.col_bytes)
            lo, hi = seg.offset + a * seg.row_bytes, seg.offset + b * seg.row_bytes
            for view in mapped_windows(src, lo, hi, window=hi - lo + mmap.ALLOCATIONGRANULARITY):  # one mapping
                rows = np.frombuffer(view, dtype=np.uint8).reshape(b - a, seg.row_bytes)
                cols = rows[:, seg.col_offset : seg.col_offset + seg.col_bytes]
                np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(b - a, seg.col_bytes), cols)
                del rows, cols  # the mapping closes when the loop moves on: no array may still view it
            self._emit(part, pos + a * seg.col_bytes, out, h, "gather")

    def _gather_in_kernel(self, seg: Gather, src: int, part: PartialFile, pos: int, h: Hasher | None, step: int) -> int:
        """One kernel copy per row, a window of rows at a time, hashed from the output just written
        (contiguous there); returns the first row not done (the kernel refused: user space goes on)."""
        for a in range(0, seg.rows, step):
            b = min(seg.rows, a + step)
            for r in range(a, b):
                if self._kernel != "copy_file_range":  # refused here: sendfile would open a file per row
                    return a
                where = seg.offset + r * seg.row_bytes + seg.col_offset
                kind = self._kernel_copy(src, where, part, pos + r * seg.col_bytes, seg.col_bytes, seg.path)
                if not kind:
                    return a  # nothing of rows [r, b) counted yet; rows [a, r) are rewritten alike
            lo, hi = pos + a * seg.col_bytes, pos + b * seg.col_bytes
            start_writeback(part.fd, lo, hi - lo)
            if h is not None:
                hash_range(part.fd, lo, hi, [h])
            self._step(hi - lo, "gather")
        return seg.rows

    def _compute(self, seg: Compute, job: Job, pos: int, h: Hasher | None) -> None:
        t = job.tensor
        if seg.index < 0:  # a constant: its chain starts from float32 (a `fill`)
            values = transformed(np.empty(t.shape, np.float32), FLOAT32, t.transforms, t.dtype)
            self._emit(job.part, pos, tensor_bytes(values), h, "compute")
            return
        p = t.pieces[seg.index]
        st = self.source.tensors[p.source]  # type: ignore[index]
        step = max(1, CHUNK_BYTES // max(1, st.row_bytes))
        first, stop = (p.start, p.start + p.length) if p.dim == 0 else (0, st.rows)
        for a in range(first, stop, step):
            b = min(a + step, stop)
            rows = self.source.read_rows(p.source, a, b)  # type: ignore[arg-type]
            if p.dim == 1:
                rows = rows[:, p.start : p.start + p.length]
            data = tensor_bytes(transformed(rows, st.dtype, t.transforms, t.dtype))
            self._emit(job.part, pos, data, h, "compute")
            pos += len(data)


def transformed(x: np.ndarray, src: DType, transforms: tuple[Transform, ...], dtype: DType) -> np.ndarray:
    """A compute segment's values (layout.apply_values; tests/convert/test_numpy_path.py puts the
    torch formulation here to compare the two)."""
    return apply_values(x, src, transforms, dtype)


def _sendfile(src: int, src_off: int, part: PartialFile, dst_off: int, n: int, path: Path) -> None:
    """sendfile writes at the output's file position: a private descriptor per call, so that
    threads writing the same file never share one."""
    fd = os.open(part.partial, os.O_WRONLY)
    try:
        os.lseek(fd, dst_off, os.SEEK_SET)
        done = 0
        while done < n:
            got = os.sendfile(fd, src, src_off + done, n - done)
            if got == 0:
                raise CheckpointError(f"{path}: truncated while being read (file shrank?)")
            done += got
    finally:
        os.close(fd)


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        f = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: the kernel's own writeback does it later
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    f.restype = ctypes.c_int
    return f


# PLAMO2_NO_EARLY_WRITEBACK=1 leaves writeback to the kernel: only for measuring what it buys.
_SYNC_FILE_RANGE = None if os.environ.get("PLAMO2_NO_EARLY_WRITEBACK") else _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing these freshly written bytes to disk now (Linux sync_file_range; Python has no
    binding, ctypes releases the GIL).  The kernel would otherwise wait for its dirty-page
    thresholds (gigabytes on a big machine) and leave it all to the fsync at the end of the file,
    which would then add the whole write time after the copying instead of overlapping it."""
    if _SYNC_FILE_RANGE is not None and nbytes:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: a failure costs only speed


def default_workers() -> int:
    """Threads for the jobs: one per core, at least 4 (a copy often waits for the disk, not a
    core), at most 16 (each holds up to two windows; beyond that the disk is the limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(4, min(16, cores))
