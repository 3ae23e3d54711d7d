"""The shard format in one module (docs/shard-format.md): file names, header metadata, and the
manifest `plamo2_shards.json`, its writer and its reader.  The manifest is written last; its
presence means the conversion is complete.  Everything that reads shards (check, merge, reshard,
the runtime, eval, inspect) goes through `load_manifest`, which parses a directory's manifest once
per process.

Format versions (docs/shard-format.md): 1 records SHA-256 digests under `sha256` keys; 2 names its
algorithm once (`hash`, XXH3-128 when we write it) and records every digest under `digest`, with a
file's digest built from its header and its tensors' digests (`combine_file_digest`), so that no
byte is hashed twice.  Both versions are read and checked; only version 2 is written."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..digest import HASHES, SHA256, XXH3_128, hash_range, new_hash, sha256_file
from ..dtypes import dtype_name, parse_dtype
from ..errors import CheckpointError
from ..model import family_of, load_config
from ..model.layout import OutputTensor, Piece, parse_transform
from ..parallel import Mapping
from ..safetensors_io import SafetensorsFile, atomic_write_text, read_header
from .lock import ensure_not_being_written

MANIFEST_NAME = "plamo2_shards.json"
JOURNAL_NAME = ".plamo2_convert.journal.jsonl"
FORMAT = "plamo2-shards"
FORMAT_VERSION = 2  # what convert writes
READABLE_VERSIONS = (1, 2)  # what every reader accepts (and `check` verifies)
HASH = XXH3_128  # the algorithm version 2 records when we write it
VERSION_1_HASH = SHA256  # version 1 has no `hash` field: SHA-256 throughout


def file_name(rank: int, part: int) -> str:
    return f"model-rank-{rank}-part-{part}.safetensors"


def file_metadata(mapping: Mapping, rank: int) -> dict[str, str]:
    """The safetensors header metadata of every file of a rank (vLLM's loaders want format=pt)."""
    tp_rank, pp_rank = mapping.ranks(rank)
    return {
        "format": "pt",
        "plamo2_tools_version": __version__,
        "tp_rank": str(tp_rank),
        "tp_size": str(mapping.tp),
        "pp_rank": str(pp_rank),
        "pp_size": str(mapping.pp),
    }


@dataclass(frozen=True)
class TensorEntry:
    """One output tensor as the manifest records it."""

    rank: int
    file: str
    tensor: OutputTensor
    digest: str  # of the tensor's data bytes, in the manifest's algorithm (Manifest.hash)


@dataclass(frozen=True)
class Manifest:
    path: Path  # the shard directory
    raw: dict[str, Any]
    config: Any  # the typed config of the model's family (model/registry.py)
    mapping: Mapping
    entries: dict[int, dict[str, TensorEntry]]  # rank -> key -> entry

    @property
    def version(self) -> int:
        return int(self.raw["format_version"])

    @property
    def hash(self) -> str:
        """The algorithm of every digest this manifest records."""
        return self.raw.get("hash", VERSION_1_HASH) if self.version >= 2 else VERSION_1_HASH

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.raw["files"]

    def file_digest(self, name: str) -> str:
        """The recorded digest of one shard file (version 1: its sha256)."""
        return self.raw["files"][name][_DIGEST_KEY[self.version]]

    def digests_of(self, path: Path, pool: Executor | None = None) -> tuple[str, dict[str, str]]:
        """(file digest, {tensor key: digest}) of a file on disk, computed the way this manifest's
        version defines them (what `check`, resume and the runtime compare)."""
        return file_digests(path, self.version, self.hash, pool)

    def rank_files(self, rank: int) -> list[str]:
        return self.raw["mapping"]["ranks"][rank]["files"]

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the runtime computes in: convert's --dtype, or with "auto" that of the family's
        activation tensor (its decoder weights) as converted."""
        chosen = self.raw["options"]["dtype"]
        if chosen != "auto":
            return parse_dtype(chosen)
        suffix = family_of(self.config).activation_tensor
        for entries in self.entries.values():
            for key, e in entries.items():
                if key.endswith(suffix):
                    return e.tensor.dtype
        raise CheckpointError(f"{self.path}: no {suffix} in the manifest: cannot tell the activation dtype")

    @property
    def source_tensors(self) -> dict[str, dict[str, Any]]:
        """HF name -> {dtype, shape} of the checkpoint the shards were made from."""
        return self.raw["source"]["tensors"]


_DIGEST_KEY = {1: "sha256", 2: "digest"}  # where each version records a digest


def tensor_record(t: OutputTensor, file: str, digest: str) -> dict[str, Any]:
    return {
        "file": file,
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "digest": digest,
        "source": t.source,
        "transforms": [str(x) for x in t.transforms],
        "pieces": [[p.source, p.dim, p.start, p.length] for p in t.pieces],
    }


def build_manifest(
    *,
    fingerprint: str,
    source: dict[str, Any],
    config: Any,
    mapping: Mapping,
    out_dtype: torch.dtype | None,
    max_part_size: int,
    files: list[tuple[str, int, int, dict[str, Any]]],
    tensors: list[tuple[int, str, OutputTensor, str]],
    copied: list[str],
) -> dict[str, Any]:
    """The manifest of a finished conversion.

    `source`: path, kind, files ({name: {size, digest[, sha256]}}), config_sha256, tensors
    ({name: {dtype, shape}}); `files`: (name, rank, part, {size, digest}); `tensors`: (rank, file,
    tensor, digest).  Every `digest` is in the algorithm HASH, named in the manifest."""
    records: dict[str, dict[str, Any]] = {}
    for rank, file, t, digest in tensors:
        records.setdefault(str(rank), {})[t.key] = tensor_record(t, file, digest)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "hash": HASH,
        "plamo2_tools_version": __version__,
        "fingerprint": fingerprint,
        "source": source,
        "mapping": {
            "tp_size": mapping.tp,
            "pp_size": mapping.pp,
            "world_size": mapping.world_size,
            "stages": [list(s) for s in mapping.stages],
            "ranks": [
                {
                    "rank": r,
                    "tp_rank": mapping.ranks(r)[0],
                    "pp_rank": mapping.ranks(r)[1],
                    "files": [name for name, rank, _, _ in files if rank == r],
                }
                for r in range(mapping.world_size)
            ],
        },
        "options": {
            "dtype": dtype_name(out_dtype) if out_dtype else "auto",
            "max_part_size": max_part_size,
            "tied_embeddings": config.tie_word_embeddings,
            "padded_vocab": config.padded_vocab,
        },
        "copied_files": copied,
        "tensors": records,
        "files": {
            name: {"size": rec["size"], "digest": rec["digest"], "rank": rank, "part": part}
            for name, rank, part, rec in files
        },
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees no manifest or the whole one."""
    atomic_write_text(directory / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def config_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()


_CACHE: dict[tuple[str | int, ...], Manifest] = {}
_CACHE_LOCK = threading.Lock()


def load_manifest(directory: str | Path) -> Manifest:
    """The typed view of a shard directory's manifest, parsed once per process (re-parsed when
    the file changes on disk)."""
    directory = Path(directory)
    ensure_not_being_written(directory)  # every reader comes through here: none reads a half-written directory
    path = directory / MANIFEST_NAME
    key = (str(directory.resolve()), *_stamp(path), *_stamp(directory / "config.json"))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = _parse_manifest(directory, path)
        return _CACHE[key]


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


def _parse_manifest(directory: Path, path: Path) -> Manifest:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: {'not a directory' if directory.exists() else 'no such directory'}")
    if not path.is_file():
        hint = " (an unfinished conversion: run convert again to resume)" if (directory / JOURNAL_NAME).exists() else ""
        raise CheckpointError(f"{directory}: no {MANIFEST_NAME}: not a complete plamo2-tools shard directory{hint}")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a {FORMAT} manifest")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{path}: format_version {version} is not supported (this is {__version__}, which reads format "
                f"{' and '.join(map(str, READABLE_VERSIONS))})"
            )
        if version >= 2 and raw.get("hash") not in HASHES:
            raise CheckpointError(
                f"{path}: unknown hash algorithm {raw.get('hash')!r} (this is {__version__}, which knows "
                f"{', '.join(HASHES)})"
            )
        digest_key = _DIGEST_KEY[version]
        config = load_config(directory / "config.json")
        m = raw["mapping"]
        mapping = Mapping(m["tp_size"], m["pp_size"], tuple(tuple(s) for s in m["stages"]))
        entries: dict[int, dict[str, TensorEntry]] = {}
        for rank_str, tensors in raw["tensors"].items():
            rank = int(rank_str)
            entries[rank] = {}
            for key, rec in tensors.items():
                t = OutputTensor(
                    key=key,
                    source=rec["source"],
                    shape=tuple(rec["shape"]),
                    dtype=parse_dtype(rec["dtype"]),
                    pieces=tuple(Piece(*p) for p in rec["pieces"]),
                    transforms=tuple(parse_transform(x) for x in rec["transforms"]),
                )
                entries[rank][key] = TensorEntry(rank, rec["file"], t, rec[digest_key])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    return Manifest(directory, raw, config, mapping, entries)


# ---- digests of a safetensors file --------------------------------------------------------------
def combine_file_digest(header: bytes, tensor_digests: Sequence[str], algorithm: str = HASH) -> str:
    """Version 2's digest of a whole safetensors file: H(header ‖ d_1 ‖ d_2 ‖ ...), where `header`
    is the file's first bytes up to its data (8-byte length + JSON) and d_i the raw digests of its
    tensors in data-offset order.  A safetensors file is exactly its header and its tensors' bytes
    (read_header refuses holes, overlaps and trailing bytes), so this covers every byte, and each
    byte is hashed once even though both the file and its tensors get a digest."""
    h = new_hash(algorithm)
    h.update(header)
    for d in tensor_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def file_digests(
    path: Path, version: int = FORMAT_VERSION, algorithm: str = HASH, pool: Executor | None = None
) -> tuple[str, dict[str, str]]:
    """(file digest, {tensor: digest}) of a safetensors file as format `version` defines them.
    Version 2's tensors are independent: with a pool they hash in parallel, one per thread."""
    header = read_header(path)  # validates: the ranges below cover the file exactly
    ranges = {k: (t.offset, t.offset + t.nbytes) for k, t in header.tensors.items()}
    if version == 1:
        return sha256_file(path, ranges)
    fd = os.open(path, os.O_RDONLY)
    try:
        run: Callable[[tuple[int, int]], str] = lambda r: _range_digest(fd, r, algorithm)  # noqa: E731
        order = sorted(ranges, key=lambda k: ranges[k][0])
        digests = list(pool.map(run, [ranges[k] for k in order]) if pool else map(run, [ranges[k] for k in order]))
    finally:
        os.close(fd)
    return combine_file_digest(header_bytes(header), digests, algorithm), dict(zip(order, digests, strict=True))


def _range_digest(fd: int, r: tuple[int, int], algorithm: str) -> str:
    h = new_hash(algorithm)
    hash_range(fd, r[0], r[1], [h])
    return h.hexdigest()


def header_bytes(file: SafetensorsFile) -> bytes:
    """The bytes before a file's data (what combine_file_digest starts with)."""
    with open(file.path, "rb") as f:
        return f.read(file.data_start)
