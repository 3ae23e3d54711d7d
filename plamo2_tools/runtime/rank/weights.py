"""One rank's tensors, read from its shard files straight into the device's memory, each file's
digest taken from the very bytes that were loaded, while they are loaded (issue 33).

The files' headers, sizes and side files are checked against the manifest before this runs
(shards/integrity.py `verify_shard_files(..., digests=False)`); the digests, which need every byte,
are computed here instead of in a pass of their own before the load, so the bytes are read once:

  * each file is read in order with `preadv` (the page cache's speed, or the disk's with the
    kernel's read-ahead asked for up front), in pieces of at most CHUNK bytes: on the CPU into the
    tensors' own memory, on CUDA into pinned staging buffers whose contents go to the device with
    asynchronous copies (STAGES buffers, so that reading, hashing and the DMA overlap);
  * a hashing thread takes each piece as it lands and feeds it to its tensor's digest (XXH3-128
    per tensor, then the file's digest from the header and the tensor digests: shard format v2/v3;
    or one SHA-256 of the whole file: v1), in parallel with the next piece's read;
  * only when a file's digest equals the manifest's are its tensors kept: a mismatch raises one
    CheckpointError line naming the file (the words of `verify_shard_files`), and the tensors
    loaded so far are dropped, so nothing ever runs on weights that failed their digest.

`verify=False` (`--no-verify`) skips the hashing only.  A file that changes size while it is read is
refused too (a short read).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...digest import new_hash
from ...errors import CheckpointError, os_error
from ...safe_files import open_regular
from ...safetensors_io import SafetensorsFile, TensorInfo, read_header
from ...shards.formats import combine_file_digest, header_bytes
from ...shards.integrity import digest_mismatch
from ...shards.manifest import Manifest

CHUNK = 32 << 20  # bytes read (and hashed, and copied to the device) at a time
STAGES = 3  # pinned staging buffers on CUDA


def load_rank_weights(
    manifest: Manifest, rank: int, device: torch.device, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors of one global rank on `device`, every file's digest checked on the loaded bytes
    unless `verify` is off."""
    weights: dict[str, torch.Tensor] = {}
    stage = Staging(device) if device.type == "cuda" else None
    for name in manifest.rank_files(rank):
        path = Path(manifest.path) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest for rank {rank})")
        weights.update(load_file(manifest, name, device, verify, stage))
    expected = set(manifest.entries[rank])
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise CheckpointError(f"rank {rank}: shard keys differ from the manifest (missing {missing}, extra {extra})")
    return weights


@dataclass
class Piece:
    """Bytes [start, stop) of a file, all inside one tensor's payload."""

    tensor: TensorInfo
    start: int
    stop: int


def pieces(header: SafetensorsFile, chunk: int = CHUNK) -> Iterator[Piece]:
    """The file's payload in offset order, cut at tensor boundaries and every `chunk` bytes."""
    for info in sorted(header.tensors.values(), key=lambda t: t.offset):
        for start in range(info.offset, info.offset + info.nbytes, chunk):
            yield Piece(info, start, min(start + chunk, info.offset + info.nbytes))


class FileDigest:
    """The manifest's digest of one file, fed the payload pieces in offset order (on one thread)."""

    def __init__(self, manifest: Manifest, header: SafetensorsFile) -> None:
        self.algorithm, self.combined = manifest.hash, manifest.format.combined
        self.head = header_bytes(header)
        self.whole = None if self.combined else new_hash(self.algorithm)
        if self.whole is not None:
            self.whole.update(self.head)
        self.tensor_hash: Any = None
        self.current: TensorInfo | None = None
        self.digests: list[str] = []

    def update(self, piece: Piece, data: memoryview) -> None:
        if self.whole is not None:
            self.whole.update(data)
            return
        if piece.tensor is not self.current:
            self._close()
            self.current, self.tensor_hash = piece.tensor, new_hash(self.algorithm)
        self.tensor_hash.update(data)

    def _close(self) -> None:
        if self.current is not None:
            self.digests.append(self.tensor_hash.hexdigest())
            self.current = None

    def hexdigest(self) -> str:
        if self.whole is not None:
            return self.whole.hexdigest()
        self._close()
        return combine_file_digest(self.head, self.digests, self.algorithm)


class Hasher(threading.Thread):
    """Hashes pieces as the reader hands them over; `release` is called once a piece is hashed
    (the reader may then reuse its buffer)."""

    def __init__(self, digest: FileDigest | None) -> None:
        super().__init__(name="plamo2-load-digest", daemon=True)
        self.digest = digest
        self.todo: queue.Queue[tuple[Piece, memoryview, threading.Semaphore | None] | None] = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        while (item := self.todo.get()) is not None:
            piece, data, release = item
            try:
                if self.digest is not None and self.error is None:
                    self.digest.update(piece, data)
            except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
                self.error = e
            finally:
                if release is not None:
                    release.release()

    def submit(self, piece: Piece, data: memoryview, release: threading.Semaphore | None = None) -> None:
        if self.digest is None:
            if release is not None:
                release.release()
            return
        self.todo.put((piece, data, release))

    def finish(self) -> str | None:
        self.todo.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest() if self.digest is not None else None


class Staging:
    """Pinned host buffers that take turns: read into one, copy it to the device asynchronously,
    reuse it once both the copy and its hashing are done."""

    def __init__(self, device: torch.device, stages: int = STAGES, size: int = CHUNK) -> None:
        self.device = device
        self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(stages)]
        self.events: list[torch.cuda.Event | None] = [None] * stages
        self.hashed = [threading.Semaphore(1) for _ in range(stages)]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, threading.Semaphore, int]:
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        self.hashed[i].acquire()  # its previous piece is hashed
        event = self.events[i]
        if event is not None:
            event.synchronize()  # and copied to the device
        return self.buffers[i], self.hashed[i], i

    def copied(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[i] = event

    def drain(self) -> None:
        for i, sem in enumerate(self.hashed):
            sem.acquire()
            sem.release()
            if self.events[i] is not None:
                self.events[i].synchronize()  # type: ignore[union-attr]


def load_file(
    manifest: Manifest, name: str, device: torch.device, verify: bool = True, stage: Staging | None = None
) -> dict[str, torch.Tensor]:
    """One shard file's tensors on `device`, its digest checked on the loaded bytes (`verify`)."""
    path = Path(manifest.path) / name
    header = read_header(path)
    flat = {key: torch.empty(info.nbytes, dtype=torch.uint8, device=device) for key, info in header.tensors.items()}
    hasher = Hasher(FileDigest(manifest, header) if verify else None)
    hasher.start()
    try:
        fd = open_regular(path)
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None
    try:
        if os.fstat(fd).st_size != header.size:
            raise CheckpointError(f"{path}: changed size while it was being loaded")
        _advise(fd)
        for piece in pieces(header, CHUNK):
            key = piece.tensor.name
            lo, hi = piece.start - piece.tensor.offset, piece.stop - piece.tensor.offset
            if stage is None:  # the CPU: straight into the tensor's memory
                view = memoryview(flat[key].numpy())[lo:hi]
                _read_exactly(fd, view, piece.start, path)
                hasher.submit(piece, view)
            else:
                buf, hashed, i = stage.next()
                view = memoryview(buf.numpy())[: piece.stop - piece.start]
                try:
                    _read_exactly(fd, view, piece.start, path)
                except BaseException:
                    hashed.release()  # nobody will hash it: the buffer is free again
                    raise
                hasher.submit(piece, view, hashed)
                flat[key][lo:hi].copy_(buf[: hi - lo], non_blocking=True)
                stage.copied(i)
            if hasher.error is not None:
                break
    finally:
        os.close(fd)
        digest = hasher.finish()
        if stage is not None:
            stage.drain()
    if verify and digest != manifest.file_digest(name):
        flat.clear()  # never handed out
        raise CheckpointError(
            f"{manifest.path}: {digest_mismatch(manifest, name)}: the shards do not match their manifest "
            f"(`plamo2-tools check {manifest.path}` shows everything)"
        )
    return {key: _typed(flat[key], info) for key, info in header.tensors.items()}


def _typed(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    dtype = info.dtype.torch
    if raw.numel() == 0:
        return torch.empty(info.shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).reshape(info.shape)


def _read_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise os_error(e, f"{path}: cannot read") from None
        if n == 0:
            raise CheckpointError(f"{path}: ended early while it was being loaded (truncated meanwhile?)")
        done += n


def _advise(fd: int) -> None:
    """Ask the kernel to read ahead the whole file (a cold cache then streams at the disk's speed)."""
    for advice in ("POSIX_FADV_SEQUENTIAL", "POSIX_FADV_WILLNEED"):
        if hasattr(os, advice):
            with contextlib.suppress(OSError):  # advice only
                os.posix_fadvise(fd, 0, 0, getattr(os, advice))
