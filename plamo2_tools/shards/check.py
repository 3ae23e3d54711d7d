"""`plamo2-tools check`: structural verification of a shard directory without running the model.

Checks, each reported as one line per problem:
  files      every listed file exists, has the recorded size and digest, opens with safetensors
  headers    metadata says format=pt and the right tp/pp ranks; keys, shapes, dtypes are exactly
             what the layout plans for this config and split (nothing missing, nothing extra), and
             what the manifest's tensor records say (the runtime's own load check)
  tensors    every tensor's digest matches the manifest
  replicas   tensors cut from the same pieces on different ranks are byte-identical
  padding    vocab padding rows are zero
  coverage   the pieces of each source tensor cover it exactly once (replicas aside)
  side_files (format 3) every copied file (config, tokenizer, ...) has its recorded size and digest

Digests are computed in the algorithm and by the rules of the manifest's format version (1:
SHA-256 of files and tensors; 2: its `hash`, files digested from their header and tensor digests),
on every core: version 2's tensors hash in parallel, version 1's files do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import DType
from ..kinds import CHECK_KIND, CHECK_SCHEMA_VERSION  # what `check --json` is (CheckReport.to_dict)
from ..model import family_of
from ..model.layout import CONSTANT, OutputTensor, rank_tensors
from ..numerics import nonzero_count
from ..safetensors_io import read_array, read_header
from .integrity import (
    all_digests,
    config_problem,
    digest_mismatch,
    header_problem,
    presence_problem,
    side_file_problems,
)
from .manifest import Manifest, file_metadata, load_manifest


@dataclass
class CheckReport:
    path: Path
    checks: dict[str, list[str]] = field(default_factory=dict)  # check name -> problems

    @property
    def ok(self) -> bool:
        return not any(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": CHECK_KIND,
            "schema_version": CHECK_SCHEMA_VERSION,
            "path": str(self.path),
            "ok": self.ok,
            "checks": self.checks,
        }


def check_shards(path: str | Path, progress: Callable[[int], None] | None = None) -> CheckReport:
    path = Path(path)
    m = load_manifest(path)
    report = CheckReport(path)
    report.checks["config"] = [p for p in [config_problem(m)] if p]
    report.checks["side_files"] = side_file_problems(m)
    report.checks["files"], digests = _check_files(m, progress)
    report.checks["headers"] = _guarded(_check_headers, m)
    report.checks["tensors"] = [
        f"rank {rank}: {key}: {m.hash} digest differs from the manifest"
        for rank, entries in m.entries.items()
        for key, e in entries.items()
        if e.file in digests and digests[e.file].get(key) not in (None, e.digest)
    ]
    report.checks["replicas"] = _guarded(_check_replicas, m)
    # Only files that passed the file check: a missing or truncated one is reported already.
    report.checks["padding"] = _guarded(_check_padding, m, set(digests))
    report.checks["coverage"] = _guarded(_check_coverage, m)
    return report


def _guarded(check: Callable[..., list[str]], *args: Any) -> list[str]:
    """A check over records that a hand-edited (or hostile) manifest made inconsistent with each
    other, say a piece past the end of its tensor: the inconsistency is the finding (exit 1),
    not a crash.  Only the manifest's own records get here: they were typed when parsed."""
    try:
        return check(*args)
    except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError, RuntimeError) as e:
        return [f"the manifest's records are inconsistent with each other ({type(e).__name__}: {e})"]


def _check_files(m: Manifest, progress: Callable[[int], None] | None) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Presence (with the safetensors library's own word on the format) and digest of every file
    (shards/integrity.py); returns the problems and the tensor digests of the readable files."""
    problems: list[str] = []
    readable = []
    for name in sorted(m.files):
        found = presence_problem(m, name, judge=True)
        if found:
            problems.append(found)
        else:
            readable.append(name)
    digests = {}
    for name, (whole, tensors) in all_digests(m, readable, progress).items():
        digests[name] = tensors
        if whole != m.file_digest(name):
            problems.append(digest_mismatch(m, name))
    return problems, digests


def _expected(m: Manifest) -> dict[int, list[OutputTensor]]:
    src_dtypes = {n: r.dtype for n, r in m.source_tensors.items()}
    out_dtype = m.out_dtype
    family = family_of(m.config)
    planned = {
        r: rank_tensors(family, m.config, src_dtypes, m.mapping, r, out_dtype) for r in range(m.mapping.world_size)
    }
    if not m.format.has_constants:  # version 1 predates vLLM's extra constant tensors: none expected
        planned = {r: [t for t in ts if t.source != CONSTANT] for r, ts in planned.items()}
    return planned


def _check_headers(m: Manifest) -> list[str]:
    problems = []
    expected = _expected(m)
    for rank in range(m.mapping.world_size):
        found: dict[str, tuple[str, DType, tuple[int, ...]]] = {}
        for fname in m.rank_files(rank):
            p = m.path / fname
            if not p.is_file():
                continue
            try:
                header = read_header(p)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{fname}: {e}")
                continue
            meta = header.metadata
            want = {k: v for k, v in file_metadata(m.mapping, rank).items() if k != "plamo2_tools_version"}
            bad = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
            if bad:
                problems.append(f"{fname}: metadata {bad} should be { ({k: want[k] for k in bad}) }")
            # The manifest's own records against the header, by the checker the runtime's load uses:
            # a record whose shape or dtype was changed passed `check` and failed every load (issue 28).
            record = header_problem(m, rank, fname)
            if record and not bad:
                problems.append(record)
            for key, info in header.tensors.items():
                if key in found:
                    problems.append(f"rank {rank}: {key} appears in {found[key][0]} and {fname}")
                found[key] = (fname, info.dtype, info.shape)
        planned = {t.key: t for t in expected[rank]}
        for key in sorted(set(planned) - set(found)):
            problems.append(f"rank {rank}: missing {key}")
        for key in sorted(set(found) - set(planned)):
            problems.append(f"rank {rank}: unexpected {key}")
        for key in sorted(set(found) & set(planned)):
            fname, dtype, shape = found[key]
            t = planned[key]
            if (dtype, shape) != (t.dtype, t.shape):
                problems.append(f"rank {rank}: {key} is {dtype} {list(shape)}, planned {t.dtype} {list(t.shape)}")
            elif m.entries.get(rank, {}).get(key) is None or m.entries[rank][key].tensor.pieces != t.pieces:
                problems.append(f"rank {rank}: {key}: manifest pieces differ from the layout")
    return problems


def _check_replicas(m: Manifest) -> list[str]:
    groups: dict[tuple, list[tuple[int, str, str]]] = {}
    for rank, entries in m.entries.items():
        for key, e in entries.items():
            sig = (e.tensor.source, e.tensor.pieces, e.tensor.transforms, e.tensor.dtype)
            groups.setdefault(sig, []).append((rank, key, e.digest))
    return [
        f"{members[0][1]}: replicas differ across ranks {[r for r, _, _ in members]}"
        for members in groups.values()
        if len({h for _, _, h in members}) > 1
    ]


def _check_padding(m: Manifest, readable: set[str]) -> list[str]:
    problems = []
    for rank, entries in m.entries.items():
        for key, e in entries.items():
            t = e.tensor
            if e.file not in readable:
                continue
            row = 0
            for p in t.pieces:
                rows = t.shape[0] if p.dim == 1 else p.length
                if p.source is None:
                    path = m.path / e.file
                    info = read_header(path).tensors[key]
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        pad = read_array(fd, info, row, row + rows, path)
                    finally:
                        os.close(fd)
                    if nonzero_count(pad, info.dtype):
                        problems.append(f"rank {rank}: {key}: vocab padding rows {row}..{row + rows - 1} are not zero")
                row += rows
    return problems


def _check_coverage(m: Manifest) -> list[str]:
    """Each source row (dim-0 pieces) or column (dim-1 pieces) is taken exactly once, counting
    identical pieces on several ranks (replicas) once."""
    used: dict[str, set] = {}
    for entries in m.entries.values():
        for e in entries.values():
            for p in e.tensor.pieces:
                if p.source is not None:
                    used.setdefault(p.source, set()).add(p)
    problems = []
    cfg = m.config
    for name, rec in m.source_tensors.items():
        pieces = used.get(name, set())
        if not pieces:
            problems.append(f"{name}: not used by any rank")
            continue
        dims = {p.dim for p in pieces}
        if len(dims) != 1:
            problems.append(f"{name}: split along both dims")
            continue
        dim = dims.pop()
        size = rec.shape[dim]
        if name == m.family.head_name:
            size = cfg.vocab_size  # HF's rows beyond V (rounded to 16) are not part of the model
        count = [0] * size
        for p in {(p.start, p.length) for p in pieces}:
            for i in range(p[0], min(p[0] + p[1], size)):
                count[i] += 1
        holes = [i for i, c in enumerate(count) if c == 0]
        twice = [i for i, c in enumerate(count) if c > 1]
        if holes:
            problems.append(f"{name}: {len(holes)} {'rows' if dim == 0 else 'columns'} never taken (first {holes[0]})")
        if twice:
            problems.append(f"{name}: {len(twice)} {'rows' if dim == 0 else 'columns'} taken twice (first {twice[0]})")
    return problems
