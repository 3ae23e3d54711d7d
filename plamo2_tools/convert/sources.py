"""What convert and merge read from: an HF checkpoint, or a shard directory made by this tool seen
as the HF checkpoint it came from (so shards can be resharded without the original)."""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..dtypes import DType
from ..errors import CheckpointError, UserError
from ..model.checkpoint import HFCheckpoint
from ..model.layout import invert_values
from ..safe_files import ensure_inside_source
from ..safetensors_io import TensorInfo, read_array, read_header
from ..shards.formats import HASH, WRITTEN
from ..shards.integrity import verify_shard_files
from ..shards.journal import JOURNAL_NAME
from ..shards.manifest import MANIFEST_NAME, Manifest, load_manifest
from ..shards.owned import ensure_readable_checkpoint
from ..tokenizer.vocab import check_vocab_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".partial", ".tmp")
NOT_COPIED = ("model.safetensors.index.json", MANIFEST_NAME)


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class Source(Protocol):
    path: Path
    config: Any  # the typed config of the model's family
    kind: str  # "hf" | "shards"

    @property
    def tensors(self) -> dict[str, SourceTensor]: ...

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a source tensor, held as its `DType.storage` (numerics.py)."""
        ...

    def locate(self, name: str) -> tuple[Path, TensorInfo] | None:
        """Where a source tensor's bytes lie verbatim (file, header entry), or None when it has
        to be rebuilt (read_rows) first: convert copies verbatim bytes inside the kernel."""
        ...

    def input_files(self) -> list[Path]: ...

    def close(self) -> None: ...


def side_files(directory: Path) -> list[Path]:
    """Config, tokenizer, remote code ...: every plain file that is not weights or our bookkeeping.
    A symlink among them must stay inside the directory or its Hugging Face cache repository
    (refused otherwise: a link to a private file must not be copied into the shards)."""
    return sorted(
        ensure_inside_source(directory, p)
        for p in directory.iterdir()
        if p.is_file()
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and p.name not in NOT_COPIED
        and not p.name.startswith(".")
    )


def source_side_files(source: Source) -> list[Path]:
    """The side files a conversion or merge copies: a shard source's are the ones its manifest
    recorded (and `verify` checked), never whatever else lies in the directory."""
    if isinstance(source, ShardSource):
        return [source.path / name for name in source.manifest.copied_files]
    return side_files(source.path)


class HFSource:
    kind = "hf"

    def __init__(self, path: Path) -> None:
        ensure_readable_checkpoint(path)
        self.ckpt = HFCheckpoint(path)
        self.ckpt.check_inventory()
        self.path = self.ckpt.path
        if (self.path / "tokenizer.jsonl").is_file():  # a tokenizer no run can load is not copied
            check_vocab_file(self.path / "tokenizer.jsonl")
        self.config = self.ckpt.config
        self._tensors = {n: SourceTensor(n, i.dtype, i.shape) for n, i in self.ckpt.tensors.items()}

    @property
    def tensors(self) -> dict[str, SourceTensor]:
        return self._tensors

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.ckpt.read_array(name, start, stop)

    def locate(self, name: str) -> tuple[Path, TensorInfo] | None:
        return self.ckpt.file_of(name).path, self.ckpt.tensors[name]

    def input_files(self) -> list[Path]:
        return [f.path for f in self.ckpt.files]

    def close(self) -> None:
        self.ckpt.close()


class ShardSource:
    """A shard directory presented as its HF checkpoint: each HF tensor is rebuilt from the pieces
    the manifest records, with the value transforms inverted."""

    kind = "shards"

    def __init__(self, path: Path) -> None:
        self.manifest: Manifest = load_manifest(path)
        self.path = path
        self.config = self.manifest.config
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()  # convert's jobs read rows from several threads
        # For every HF tensor: (piece, rank file, key, row offset in the output tensor, entry).
        self._pieces: dict[str, list] = {}
        seen: set[tuple] = set()
        for rank in sorted(self.manifest.entries):
            for entry in self.manifest.entries[rank].values():
                offset = 0
                for piece in entry.tensor.pieces:
                    rows = entry.tensor.shape[0] if piece.dim == 1 else piece.length
                    if piece.source is not None and (piece, entry.tensor.source) not in seen:
                        seen.add((piece, entry.tensor.source))
                        self._pieces.setdefault(piece.source, []).append((piece, entry, offset))
                    offset += rows
        self._tensors: dict[str, SourceTensor] = {}
        for name, rec in self.manifest.source_tensors.items():
            dtype = rec.dtype
            shard_dtypes = {
                e.tensor.dtype
                for _, e, _ in self._pieces.get(name, [])
                if not any(t.name == "neg_exp_f32" for t in e.tensor.transforms)
            }
            # Precision cannot come back: a tensor cast on the way in stays in the cast dtype.
            if len(shard_dtypes) == 1:
                dtype = shard_dtypes.pop()
            self._tensors[name] = SourceTensor(name, dtype, rec.shape)

    @property
    def tensors(self) -> dict[str, SourceTensor]:
        return self._tensors

    def _file(self, name: str) -> tuple[int, dict[str, TensorInfo]]:
        with self._fds_lock:
            if name not in self._fds:
                path = self.path / name
                if not path.is_file():
                    raise CheckpointError(f"{path}: listed in the manifest but missing")
                header = read_header(path)
                self._headers[name] = header.tensors
                self._fds[name] = os.open(path, os.O_RDONLY)
            return self._fds[name], self._headers[name]

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        src = self._tensors[name]
        out = np.zeros((stop - start, *src.shape[1:]), dtype=src.dtype.np)
        for piece, entry, offset in self._pieces.get(name, []):
            fd, infos = self._file(entry.file)
            info = infos[entry.tensor.key]
            if piece.dim == 0:
                lo, hi = max(start, piece.start), min(stop, piece.start + piece.length)
                if lo >= hi:
                    continue
                first = offset + lo - piece.start
                rows = read_array(fd, info, first, first + hi - lo, self.path / entry.file)
                out[lo - start : hi - start] = invert_values(rows, info.dtype, entry.tensor.transforms, src.dtype)
            else:
                rows = read_array(fd, info, start, stop, self.path / entry.file)
                out[:, piece.start : piece.start + piece.length] = invert_values(
                    rows, info.dtype, entry.tensor.transforms, src.dtype
                )
        return out

    def locate(self, name: str) -> tuple[Path, TensorInfo] | None:
        return None  # rebuilt from pieces with the transforms inverted: never verbatim

    def input_files(self) -> list[Path]:
        return [self.path / f for f in sorted(self.manifest.files)]

    def verify(self, pool: Executor | None = None) -> dict[str, dict[str, Any]]:
        """Every shard file against its manifest (shards/integrity.py: presence, header, digest).
        Reading shards back checks only headers, so without this a damaged shard would be resharded
        or merged into output whose own manifest then vouches for it.  Returns convert's input
        record: {name: {size, digest}} by the rule and algorithm we write (for an older format,
        or another algorithm, that is a second digest of each file)."""
        m = self.manifest
        verify_shard_files(m, range(m.mapping.world_size), digests=True)  # side files included
        same = (m.format, m.hash) == (WRITTEN, HASH)
        return {
            name: {"size": rec.size, "digest": rec.digest if same else WRITTEN.digests(m.path / name, HASH, pool)[0]}
            for name, rec in sorted(m.files.items())
        }

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def open_source(path: str | Path) -> Source:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a directory")
    if (path / MANIFEST_NAME).exists() or (path / JOURNAL_NAME).exists():
        return ShardSource(path)  # with only a journal: refused as an unfinished conversion
    return HFSource(path)
