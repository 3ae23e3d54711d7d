"""Shard files checked against their manifest before the runtime loads them.

`check` reads everything and reports every problem; this is the subset that must hold before a
model runs, so that a file swapped for another rank's, truncated, or damaged stops `generate`,
`verify` and `eval` with one line instead of producing confident nonsense:

  structure  the file exists with the recorded size; its safetensors header parses; metadata says
             the rank it belongs to; keys, shapes and dtypes are exactly the manifest's (cheap:
             headers only, always done)
  digest     the whole-file digest equals the manifest's, in the algorithm the manifest records
             (one read of every byte; `--no-verify` skips it for users who have just run `check`)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, Plamo2Error, os_error
from ..safetensors_io import read_header
from .manifest import Manifest, file_metadata


def verify_rank_files(manifest: Manifest, ranks: Iterable[int], digests: bool = True) -> None:
    """Check every file of these ranks; one CheckpointError line naming each bad file."""
    files = [(rank, name) for rank in ranks for name in manifest.rank_files(rank)]
    problems = [p for rank, name in files if (p := _structure_problem(manifest, rank, name))]
    if not problems and digests:
        # hashlib and xxhash release the GIL: the files hash in parallel, one per core.
        workers = max(1, min(len(files), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="plamo2-verify") as pool:
            problems = [p for p in pool.map(lambda rf: _digest_problem(manifest, rf[1]), files) if p]
    if problems:
        raise CheckpointError(
            f"{manifest.path}: {'; '.join(problems)}: the shards do not match their manifest "
            f"(`plamo2-tools check {manifest.path}` shows everything)"
        )


def _structure_problem(m: Manifest, rank: int, name: str) -> str | None:
    path = m.path / name
    record = m.files.get(name)
    if record is None:
        return f"{name}: listed for rank {rank} but missing from the manifest's files"
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{name}: {size} bytes, the manifest says {record['size']} (truncated or replaced)"
    try:
        header = read_header(path)
    except Plamo2Error as e:
        return f"{name}: {e}"
    meta = header.metadata
    for key, want in file_metadata(m.mapping, rank).items():
        if key != "plamo2_tools_version" and meta.get(key) != want:
            return f"{name}: header says {key}={meta.get(key)}, expected {want} (another rank's file?)"
    planned = {key: e for key, e in m.entries.get(rank, {}).items() if e.file == name}
    if set(header.tensors) != set(planned):
        missing, extra = sorted(set(planned) - set(header.tensors)), sorted(set(header.tensors) - set(planned))
        return f"{name}: tensors differ from the manifest (missing {missing[:3]}, unexpected {extra[:3]})"
    for key, info in header.tensors.items():
        t = planned[key].tensor
        if (info.dtype, info.shape) != (t.dtype, t.shape):
            return f"{name}: {key} is {info.dtype} {list(info.shape)}, the manifest says {t.dtype} {list(t.shape)}"
    return None


def _digest_problem(m: Manifest, name: str) -> str | None:
    expected, actual = file_digest(m, name)
    return None if actual == expected else f"{name}: content differs from its recorded digest (damaged file?)"


def file_digest(m: Manifest, name: str) -> tuple[str, str]:
    """(recorded, computed) whole-file digest of one shard file, in the manifest's algorithm and by
    its format version's rule (shards/manifest.py `Manifest.digests_of`)."""
    path = m.path / name
    try:
        return m.file_digest(name), m.digests_of(path)[0]
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None
