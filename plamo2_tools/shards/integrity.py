"""Shard files against their manifest: the one checker that `check`, the runtime's load and every
reader of shards as a source (reshard, merge) use.

  presence   the file is listed for its rank and in the manifest's files, exists as a regular
             file with the recorded size, and its safetensors header parses
  header     metadata names the rank it belongs to; keys, shapes and dtypes are exactly the
             manifest's entries for the file (cheap: headers only)
  digest     the whole-file digest equals the manifest's, in the algorithm the manifest records
             and by its format version's rule (one read of every byte; `--no-verify` skips it for
             users who have just run `check`)
  side files config.json against `source.config_sha256` (every version) and, from version 3,
             every copied file (tokenizer, generation config, ...) against its recorded size and
             digest: always, even with `--no-verify` (they are small, and they steer the model)

`check` adds what only it needs on top (the layout re-derived from the config, replicas, padding,
coverage: shards/check.py); the runtime needs all three above before a model runs, so that a file
swapped for another rank's, truncated or damaged stops `generate`, `verify` and `eval` with one
line instead of producing confident nonsense.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor

import safetensors

from ..digest import new_hash
from ..errors import CheckpointError, Plamo2Error, os_error
from ..safe_files import ensure_inside_source, hash_file
from ..safetensors_io import read_header
from .manifest import Manifest, config_sha256, file_metadata


def presence_problem(m: Manifest, name: str, judge: bool = False) -> str | None:
    """Is the file there, whole, and a safetensors file?  `judge`: also open it with the
    safetensors library itself (check's extra word on the format)."""
    record = m.files.get(name)
    if record is None:
        return f"{name}: listed for a rank but missing from the manifest's files"
    path = m.path / name
    try:
        ensure_inside_source(m.path, path)  # a symlink out of the directory is not a shard of it
        st = path.stat()
    except FileNotFoundError:
        return f"{name}: missing"
    except Plamo2Error as e:
        return f"{name}: {str(e).removeprefix(f'{path}: ')}"
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None
    if not stat.S_ISREG(st.st_mode):
        return f"{name}: not a regular file"
    if st.st_size != record.size:
        return f"{name}: size {st.st_size} != {record.size} in the manifest (truncated or replaced)"
    try:
        read_header(path)
        if judge:
            with safetensors.safe_open(str(path), "numpy") as f:  # "pt" would import torch
                f.keys()
    except Plamo2Error as e:
        return f"{name}: {e}"
    except Exception as e:  # noqa: BLE001 - the library refusing the file is the finding
        return f"{name}: does not open as safetensors ({e})"
    return None


def header_problem(m: Manifest, rank: int, name: str) -> str | None:
    """Does the header say this rank, and hold exactly the manifest's tensors for the file?"""
    header = read_header(m.path / name)
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


def digests(m: Manifest, name: str, pool: Executor | None = None) -> tuple[str, dict[str, str]]:
    """(file digest, {tensor: digest}) of one shard file on disk, by the manifest's rule."""
    path = m.path / name
    try:
        return m.digests_of(path, pool)
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None


def digest_mismatch(m: Manifest, name: str) -> str:
    return f"{name}: {m.hash} digest differs from the manifest (damaged or replaced file?)"


def all_digests(
    m: Manifest, names: Iterable[str], progress: Callable[[int], None] | None = None
) -> dict[str, tuple[str, dict[str, str]]]:
    """Digests of many files on every core: version 2's tensors in parallel inside each file,
    version 1's (one sequential sha256 per file) file by file in parallel."""
    names = list(names)
    out: dict[str, tuple[str, dict[str, str]]] = {}
    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 64)), thread_name_prefix="plamo2-digest") as pool:
        results = (
            ((n, digests(m, n, pool)) for n in names)
            if m.format.combined
            else pool.map(lambda n: (n, digests(m, n)), names)
        )
        for name, result in results:
            out[name] = result
            if progress:
                progress(m.files[name].size)
    return out


def config_problem(m: Manifest) -> str | None:
    """config.json against the SHA-256 the manifest recorded (every format version)."""
    try:
        same = config_sha256(m.path) == m.source.config_sha256
    except OSError as e:
        raise os_error(e, f"{m.path / 'config.json'}: cannot read") from None
    return None if same else "config.json differs from the one the shards were converted with"


def side_file_problems(m: Manifest) -> list[str]:
    """Version 3: every copied side file is there, a regular file of ours (not a symlink), with
    its recorded size and digest.  Older versions recorded only names (config: config_problem)."""
    problems = []
    for name, rec in sorted(m.side_files.items()):
        h = new_hash(m.hash)
        try:
            size = hash_file(m.path / name, h)
        except Plamo2Error as e:
            problems.append(f"{name}: {str(e).removeprefix(f'{m.path / name}: ')}")
            continue
        if (size, h.hexdigest()) != (rec.size, rec.digest):
            problems.append(f"{name}: changed since the conversion ({m.hash} digest or size differs from the manifest)")
    return problems


def verify_side_files(m: Manifest) -> None:
    """What the runtime's load, merge and resharding check before trusting a shard directory's
    config and tokenizer: one CheckpointError line naming each changed file."""
    problems = [p for p in (config_problem(m), *side_file_problems(m)) if p]
    if problems:
        raise CheckpointError(
            f"{m.path}: {'; '.join(problems)}: refused (`plamo2-tools check {m.path}` shows everything)"
        )


def verify_shard_files(m: Manifest, ranks: Iterable[int], digests: bool = True) -> None:
    """Every file of these ranks against the manifest (side files, presence, header, digest): one
    CheckpointError line naming each bad file."""
    verify_side_files(m)
    files = [(rank, name) for rank in ranks for name in m.rank_files(rank)]
    problems = [p for _, name in files if (p := presence_problem(m, name))]
    if not problems:
        problems = [p for rank, name in files if (p := header_problem(m, rank, name))]
    if not problems and digests:
        found = all_digests(m, [name for _, name in files])
        problems = [digest_mismatch(m, n) for n, (whole, _) in found.items() if whole != m.file_digest(n)]
    if problems:
        raise CheckpointError(
            f"{m.path}: {'; '.join(problems)}: the shards do not match their manifest "
            f"(`plamo2-tools check {m.path}` shows everything)"
        )
