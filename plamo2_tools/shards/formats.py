"""The shard format's versions, one object each (docs/shard-format.md, its table of versions).

A version says where its manifest records digests, which hash algorithms it may name, how a
file's digest is built, and what the layout of its time held.  Readers look a manifest's version
up here (`format_of`), so a new version is one more object in `FORMATS` plus its reader fields in
`manifest.py`; every older one stays readable and checkable.

  1  SHA-256 of every file and tensor (`sha256` keys); no constant tensors (vLLM's attention scale
     buffers came with version 2).
  2  the algorithm named once (`hash`, XXH3-128 when we write it), digests under `digest`; a file's
     digest is H(header ‖ tensor digests in offset order), so each byte is hashed once.
  3  version 2 plus `side_files`: every file copied into the directory (config, generation config,
     tokenizer files, ...) with its size and digest (H of its bytes), checked by `check`, at load
     and before resharding or merging (issue 21: an edited config.json was used silently).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from ..digest import HASHES, SHA256, XXH3_128, hash_range, new_hash, sha256_file
from ..errors import CheckpointError
from ..safetensors_io import SafetensorsFile, read_header
from ..version import __version__

FORMAT = "plamo2-shards"


@dataclass(frozen=True)
class ShardFormat:
    version: int
    digest_key: str  # the manifest key of every recorded digest
    hashes: tuple[str, ...]  # algorithms a manifest of this version may name
    default_hash: str  # the algorithm when the manifest names none (version 1) / when we write it
    combined: bool  # a file's digest is built from its header and tensor digests (else: of its bytes)
    has_constants: bool  # the layout includes the family's constant extras (vLLM's scale buffers)
    side_digests: bool = False  # the manifest records every copied side file's size and digest

    def hash_of(self, raw: dict) -> str:
        """The algorithm a manifest of this version records its digests in."""
        name = raw.get("hash", self.default_hash) if len(self.hashes) > 1 else self.default_hash
        if name not in self.hashes:
            raise CheckpointError(
                f"unknown hash algorithm {name!r} (this is {__version__}, which knows {', '.join(self.hashes)})"
            )
        return name

    def digests(self, path: Path, algorithm: str, pool: Executor | None = None) -> tuple[str, dict[str, str]]:
        """(file digest, {tensor key: digest}) of a safetensors file on disk, by this version's rule.
        With a pool, the tensors of a version-2 file hash in parallel (one per thread)."""
        header = read_header(path)  # validates: the ranges below cover the file exactly
        ranges = {k: (t.offset, t.offset + t.nbytes) for k, t in header.tensors.items()}
        if not self.combined:
            return sha256_file(path, ranges)
        fd = os.open(path, os.O_RDONLY)
        try:
            run: Callable[[tuple[int, int]], str] = lambda r: _range_digest(fd, r, algorithm)  # noqa: E731
            order = sorted(ranges, key=lambda k: ranges[k][0])
            digests = list(pool.map(run, [ranges[k] for k in order]) if pool else map(run, [ranges[k] for k in order]))
        finally:
            os.close(fd)
        return combine_file_digest(header_bytes(header), digests, algorithm), dict(zip(order, digests, strict=True))


V1 = ShardFormat(1, "sha256", (SHA256,), SHA256, combined=False, has_constants=False)
V2 = ShardFormat(2, "digest", tuple(HASHES), XXH3_128, combined=True, has_constants=True)
V3 = ShardFormat(3, "digest", tuple(HASHES), XXH3_128, combined=True, has_constants=True, side_digests=True)
FORMATS: dict[int, ShardFormat] = {f.version: f for f in (V1, V2, V3)}
WRITTEN = V3  # what convert writes
HASH = WRITTEN.default_hash


def format_of(version: object, where: str) -> ShardFormat:
    if not isinstance(version, int) or isinstance(version, bool) or version not in FORMATS:
        readable = " and ".join(map(str, FORMATS))
        raise CheckpointError(
            f"{where}: format_version {version!r} is not supported "
            f"(this is {__version__}, which reads format {readable})"
        )
    return FORMATS[version]


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


def _range_digest(fd: int, r: tuple[int, int], algorithm: str) -> str:
    h = new_hash(algorithm)
    hash_range(fd, r[0], r[1], [h])
    return h.hexdigest()


def header_bytes(file: SafetensorsFile) -> bytes:
    """The bytes before a file's data (what combine_file_digest starts with)."""
    with open(file.path, "rb") as f:
        return f.read(file.data_start)
