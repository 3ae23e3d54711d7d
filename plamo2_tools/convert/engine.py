"""Run a conversion plan: stream every source tensor once per output unit, in row chunks, writing
each rank's pieces straight to their planned byte offsets.

Safety: files are written as `*.partial` and renamed after fsync and hashing; a journal records
finished files, so a killed run resumes and keeps what verifies; the manifest is written last.
Memory: one chunk of one source tensor (CHUNK_BYTES) plus its transformed copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..digest import HashWorker, StreamDigest, sha256_file
from ..errors import CheckpointError, EnvironmentLimitError, OutputExistsError, UserError
from ..safetensors_io import PartialFile, atomic_write_text, fsync_dir, tensor_bytes
from .layout import OutputTensor, apply_transforms
from .manifest import FORMAT, FORMAT_VERSION, JOURNAL_NAME, MANIFEST_NAME, dtype_name, tensor_record
from .plan import FilePlan, Plan, canonical_order, make_plan, output_path_problems
from .sources import ShardSource, Source, open_source, side_files

log = logging.getLogger("plamo2_tools.convert")
CHUNK_BYTES = 8 * 2**20  # small enough to stay in the heap (no page faults) and in cache for hashing
Progress = Callable[[int], None]


@dataclass
class ConvertResult:
    out: Path
    plan: Plan
    status: str  # "converted" | "resumed" | "up-to-date"
    seconds: float
    bytes_written: int
    files_reused: list[str] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)


class Journal:
    """Append-only record of finished files; the first line holds the plan fingerprint."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def read(self, fingerprint: str) -> dict[str, dict[str, Any]] | None:
        """Finished-file records if the journal belongs to this plan, else None."""
        try:
            lines = self.path.read_text().splitlines()
            head = json.loads(lines[0])
            records = [json.loads(line) for line in lines[1:] if line.strip()]
        except (OSError, IndexError, json.JSONDecodeError):
            return None
        if head.get("fingerprint") != fingerprint:
            return None
        return {r["file"]: r for r in records if "file" in r}

    def start(self, fingerprint: str) -> None:
        atomic_write_text(self.path, json.dumps({"fingerprint": fingerprint}) + "\n")

    def append(self, record: dict[str, Any]) -> None:
        try:
            with self.lock, open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk here too is the environment's refusal, not a crash
            raise EnvironmentLimitError(f"{self.path}: {e.strerror or e}") from None


def _clear_outputs(out: Path) -> None:
    """Remove what a previous conversion of ours left (manifest first: never look complete)."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for p in out.iterdir():
        if p.name.startswith("model-rank-") or p.name.endswith((".partial", ".tmp")):
            p.unlink()
    (out / JOURNAL_NAME).unlink(missing_ok=True)


def _prepare_output(out: Path, plan: Plan, force: bool) -> dict[str, dict[str, Any]]:
    """Decide fresh / resume / up-to-date / refuse.  Returns journal records worth reusing."""
    make_output_dir(out)
    manifest = out / MANIFEST_NAME
    journal = Journal(out / JOURNAL_NAME)
    if manifest.exists():
        try:
            old = json.loads(manifest.read_text()).get("fingerprint")
        except (OSError, json.JSONDecodeError):
            old = None
        if old == plan.fingerprint and not force:
            return {"__complete__": {}}
        if not force:
            raise OutputExistsError(f"{out} holds a different completed conversion; use --force to replace it")
        _clear_outputs(out)
    records = journal.read(plan.fingerprint)
    if records is None:
        ours = (out / JOURNAL_NAME).exists()
        others = [p for p in out.iterdir() if not p.name.startswith(".")]
        if others and not ours and not force:
            raise OutputExistsError(
                f"{out} is not empty and is not a plamo2-tools output; use --force to write into it"
            )
        if ours:
            log.info("discarding an unfinished conversion with different inputs or options")
        _clear_outputs(out)
        journal.start(plan.fingerprint)
        return {}
    for p in out.glob("*.partial"):
        p.unlink()
    return records


def _verified(out: Path, f: FilePlan, records: dict[str, dict[str, Any]]) -> bool:
    """A file finished by an earlier run: journaled, present, right size, digest matches."""
    rec = records.get(f.name)
    path = out / f.name
    if rec is None or not path.is_file() or path.stat().st_size != f.layout.size:
        return False
    if sha256_file(path)[0] != rec["sha256"]:
        log.warning("%s: digest differs from the journal; rewriting it", f.name)
        return False
    return True


def _write_tensor_chunk(part: PartialFile, t: OutputTensor, chunk: torch.Tensor, a: int, b: int, last: bool) -> int:
    """Write the part of output tensor t that source rows [a, b) feed.  Returns bytes written.

    Writes land in increasing offsets within t (padding with the last chunk, after the real rows),
    except for interleaved pieces spread over several chunks, where the stream hash gives up."""
    base = part.layout.offsets[t.key]
    row_bytes = part.layout.nbytes[t.key] // t.shape[0]
    row, written = 0, 0
    for p in t.pieces:
        if p.source is None:  # zero padding rows, written once
            if last:
                zeros = torch.zeros((p.length, *t.shape[1:]), dtype=t.dtype)
                part.write_at(base + row * row_bytes, tensor_bytes(zeros))
                written += zeros.numel() * zeros.element_size()
            row += p.length
        elif p.dim == 0:
            lo, hi = max(a, p.start), min(b, p.start + p.length)
            if lo < hi:
                data = tensor_bytes(apply_transforms(chunk[lo - a : hi - a], t.transforms, t.dtype))
                part.write_at(base + (row + lo - p.start) * row_bytes, data)
                written += len(data)
            row += p.length
        else:  # column slice of every row: output rows follow source rows
            data = tensor_bytes(apply_transforms(chunk[:, p.start : p.start + p.length], t.transforms, t.dtype))
            part.write_at(base + a * row_bytes, data)
            written += len(data)
            row += t.shape[0]
    return written


def stream_order(source: Source, tensors: list[OutputTensor]) -> list[str]:
    """The order sources are streamed in, which is also the byte order of every output file
    (plan.make_plan lays files out the same way): wider output dtypes first, then read order."""
    width = {t.source: t.dtype.itemsize for t in tensors}
    order = canonical_order(source.config)
    return sorted(width, key=lambda n: (-width[n], order[n]))


def _stream_unit(source: Source, unit: list[FilePlan], parts: dict[str, PartialFile], progress: Progress | None) -> int:
    targets: dict[str, list[tuple[PartialFile, OutputTensor]]] = {}
    for f in unit:
        for t in f.tensors:
            targets.setdefault(t.source, []).append((parts[f.name], t))
    written = 0
    for name in stream_order(source, [t for f in unit for t in f.tensors]):
        st = source.tensors[name]
        step = max(1, CHUNK_BYTES // max(1, st.row_bytes))
        for a in range(0, st.rows, step):
            b = min(a + step, st.rows)
            chunk = source.read_rows(name, a, b)
            for part, t in targets[name]:
                n = _write_tensor_chunk(part, t, chunk, a, b, last=b == st.rows)
                written += n
                if progress:
                    progress(n)
    return written


@dataclass
class _Hashing:
    """The two stream digests of one output file: whole file and per tensor, each fed by its own
    thread so the hashing of both runs beside the copying."""

    whole: StreamDigest
    tensors: StreamDigest

    @classmethod
    def of(cls, f: FilePlan) -> _Hashing:
        ranges = {k: (off, off + f.layout.nbytes[k]) for k, off in f.layout.offsets.items()}
        return cls(StreamDigest(f.layout.size, {}), StreamDigest(f.layout.size, ranges, whole=False))


def _finish_file(part: PartialFile, f: FilePlan, hashing: _Hashing, journal: Journal) -> dict[str, Any]:
    """fsync, take the stream digests (or hash what is on disk if the stream was out of order),
    rename into place, journal.  Runs in a worker thread."""
    part.sync()
    whole, tensors = hashing.whole.result(), hashing.tensors.result()
    if whole is None or tensors is None:
        ranges = {k: (off, off + part.layout.nbytes[k]) for k, off in part.layout.offsets.items()}
        digest, tensor_digests = sha256_file(part.partial, ranges)
    else:
        digest, tensor_digests = whole[0], tensors[1]
    part.commit()
    record = {"file": f.name, "size": f.layout.size, "sha256": digest, "tensors": tensor_digests}
    journal.append(record)
    return record


def _copy_side_files(source: Source, out: Path) -> list[str]:
    copied = []
    for p in side_files(source.path):
        tmp = out / (p.name + ".tmp")
        shutil.copyfile(p, tmp)
        os.replace(tmp, out / p.name)
        copied.append(p.name)
    return copied


def _input_digests(files: list[Path]) -> dict[str, dict[str, Any]]:
    """sha256 of every input file.  A file in a Hugging Face cache is a link to a blob named by
    its sha256: a different digest means a damaged download, and nothing may vouch for it."""
    digests = {}
    for p in files:
        digest = sha256_file(p)[0]
        blob = p.resolve().name
        if re.fullmatch(r"[0-9a-f]{64}", blob) and blob != digest:
            raise CheckpointError(
                f"{p}: content sha256 {digest[:12]}... differs from its Hugging Face cache blob name "
                f"{blob[:12]}... (damaged download?)"
            )
        digests[p.name] = {"size": p.stat().st_size, "sha256": digest}
    return digests


def make_output_dir(out: Path) -> None:
    """mkdir -p OUT, with one-line errors: an existing file there (or above it) is the user's to
    fix (exit 2); a refusal from the system (permissions, read-only, full) is environmental (3)."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise OutputExistsError(f"{out}: {p} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EnvironmentLimitError(f"{out}: cannot create the output directory ({e.strerror or e})") from None


def _check_disk(out: Path, need: int) -> None:
    free = shutil.disk_usage(out).free
    if need > free:
        raise EnvironmentLimitError(
            f"{out}: not enough disk space: the conversion needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )


def convert(
    src: str | Path,
    out: str | Path,
    tp: int = 1,
    pp: int = 1,
    pp_layers: list[int] | None = None,
    dtype: str = "auto",
    max_part_size: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> ConvertResult:
    """Convert an HF checkpoint (or shards of ours) into TP x PP shards in `out`."""
    threads = torch.get_num_threads()
    # The copies are small and memory-bound; torch's OpenMP workers would only spin on the cores
    # the hashing threads need.
    torch.set_num_threads(1)
    try:
        return _convert(src, Path(out), tp, pp, pp_layers, dtype, max_part_size, force, progress, on_plan)
    finally:
        torch.set_num_threads(threads)


def _convert(
    src: str | Path,
    out: Path,
    tp: int,
    pp: int,
    pp_layers: list[int] | None,
    dtype: str,
    max_part_size: int | None,
    force: bool,
    progress: Progress | None,
    on_plan: Callable[[Plan], None] | None,
) -> ConvertResult:
    start = time.perf_counter()
    source = open_source(src)
    try:
        problems = output_path_problems(source.path, out)
        if problems:
            raise UserError("; ".join(problems))
        kwargs = {} if max_part_size is None else {"max_part_size": max_part_size}
        plan = make_plan(source, tp, pp, pp_layers, dtype, **kwargs)
        # Shards as input are checked against their manifest before OUT is touched; their digests
        # then serve as our input record (an HF source is hashed while we stream).
        known_inputs = source.verify() if isinstance(source, ShardSource) else None
        records = _prepare_output(out, plan, force)
        if "__complete__" in records:
            manifest = json.loads((out / MANIFEST_NAME).read_text())
            return ConvertResult(out, plan, "up-to-date", time.perf_counter() - start, 0, manifest=manifest)
        # Per file, not per unit: a kill between two files of one unit keeps the finished one
        # (shard-format.md: "skips the finished files whose digests match").
        reused = [f.name for u in plan.units for f in u if _verified(out, f, records)]
        todo = [kept for u in plan.units if (kept := [f for f in u if f.name not in reused])]
        if reused:
            log.info("resuming: %d finished file(s) verified and kept", len(reused))
        _check_disk(out, sum(f.layout.size for u in todo for f in u))
        if on_plan:
            on_plan(plan)
        journal = Journal(out / JOURNAL_NAME)
        written = 0
        file_hasher, tensor_hasher = HashWorker("plamo2-hash-file"), HashWorker("plamo2-hash-tensors")
        try:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="plamo2-finish") as pool:
                inputs: Future | None = None
                if known_inputs is None:
                    inputs = pool.submit(_input_digests, source.input_files())
                finishing: list[Future] = []
                for unit in todo:
                    parts: dict[str, PartialFile] = {}
                    hashing = {f.name: _Hashing.of(f) for f in unit}

                    def observer(h: _Hashing) -> Callable[[int, memoryview], None]:
                        def observe(offset: int, data: memoryview) -> None:
                            file_hasher.submit(h.whole, offset, data)
                            tensor_hasher.submit(h.tensors, offset, data)

                        return observe

                    try:
                        for f in unit:
                            parts[f.name] = PartialFile(out / f.name, f.layout, observer(hashing[f.name]))
                        written += _stream_unit(source, unit, parts, progress)
                        file_hasher.drain()
                        tensor_hasher.drain()
                    except BaseException:
                        for part in parts.values():
                            part.abort()
                        raise
                    finishing += [pool.submit(_finish_file, parts[f.name], f, hashing[f.name], journal) for f in unit]
                for fut in finishing:
                    fut.result()
                input_digests = known_inputs if inputs is None else inputs.result()
        finally:
            file_hasher.close()
            tensor_hasher.close()
        finished = {**records, **journal.read(plan.fingerprint)}  # type: ignore[dict-item]
        copied = _copy_side_files(source, out)
        manifest = _manifest(source, plan, finished, input_digests, copied)
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        (out / JOURNAL_NAME).unlink(missing_ok=True)
        fsync_dir(out)
        status = "resumed" if reused else "converted"
        return ConvertResult(out, plan, status, time.perf_counter() - start, written, reused, manifest)
    finally:
        source.close()


def _manifest(
    source: Source,
    plan: Plan,
    finished: dict[str, dict[str, Any]],
    input_digests: dict[str, dict[str, Any]],
    copied: list[str],
) -> dict[str, Any]:
    m = plan.mapping
    tensors: dict[str, dict[str, Any]] = {}
    for f in plan.files:
        rank_tensors = tensors.setdefault(str(f.rank), {})
        for t in f.tensors:
            rank_tensors[t.key] = tensor_record(t, f.name, finished[f.name]["tensors"][t.key])
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "plamo2_tools_version": __version__,
        "fingerprint": plan.fingerprint,
        "source": {
            "path": str(source.path),
            "kind": source.kind,
            "files": input_digests,
            "config_sha256": hashlib.sha256((source.path / "config.json").read_bytes()).hexdigest(),
            "tensors": {
                n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for n, t in sorted(source.tensors.items())
            },
        },
        "mapping": {
            "tp_size": m.tp,
            "pp_size": m.pp,
            "world_size": m.world_size,
            "stages": [list(s) for s in m.stages],
            "ranks": [
                {"rank": r, "tp_rank": m.ranks(r)[0], "pp_rank": m.ranks(r)[1], "files": plan.rank_files(r)}
                for r in range(m.world_size)
            ],
        },
        "options": {
            "dtype": dtype_name(plan.out_dtype) if plan.out_dtype else "auto",
            "max_part_size": plan.max_part_size,
            "tied_embeddings": source.config.tie_word_embeddings,
            "padded_vocab": source.config.padded_vocab,
        },
        "copied_files": copied,
        "tensors": tensors,
        "files": {
            f.name: {
                "size": finished[f.name]["size"],
                "sha256": finished[f.name]["sha256"],
                "rank": f.rank,
                "part": f.part,
            }
            for f in plan.files
        },
    }


def plan_only(src: str | Path, tp: int, pp: int, pp_layers: list[int] | None = None, dtype: str = "auto") -> Plan:
    source = open_source(src)
    try:
        return make_plan(source, tp, pp, pp_layers, dtype)
    finally:
        source.close()
