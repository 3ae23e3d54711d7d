"""Run a conversion plan: every output tensor is one job on a pool of threads that copies its
bytes to their planned offsets (inside the kernel where they are verbatim source bytes, see
writer.py) and hashes them on the way; a file is finished when its tensors are.

Safety: files are written as `*.partial` and renamed when complete; a journal records finished
files with their digests, so a killed run resumes and keeps what still verifies (a resume hashes
every journaled file again, so a file the journal lists but the disk lost is rewritten); the
manifest is written last, only after every file it lists is durable (`--sync`, SYNC_MODES).
Memory: each worker holds at most a window or a chunk (writer.py), whatever the size of the model.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..digest import SHA256, hash_range, mapped_windows, new_hash
from ..dtypes import dtype_name
from ..errors import CheckpointError, OutputExistsError, Plamo2Error, UserError
from ..jsonio import MANIFEST_BYTES, read_json
from ..kinds import CONVERT_KIND, CONVERT_SCHEMA_VERSION  # what `convert --json` is (ConvertResult.summary)
from ..outputs import check_free_space, make_output_dir, refuse_foreign, remove_outputs, untrusted_record
from ..safe_files import copy_file
from ..safetensors_io import PartialFile, fsync_dir, fsync_path, read_header
from ..shards.formats import HASH, WRITTEN, combine_file_digest, header_bytes
from ..shards.journal import Journal
from ..shards.lock import OutputLock, ensure_not_being_written
from ..shards.manifest import MANIFEST_NAME, build_manifest, config_sha256, write_manifest
from ..shards.owned import convert_outputs
from .plan import FilePlan, Plan, make_plan, output_path_problems
from .sources import ShardSource, Source, open_source, source_side_files
from .writer import CHUNK_BYTES, COPY_MODES, Cancelled, Job, Writer, default_workers, segments

log = logging.getLogger("plamo2_tools.convert")
__all__ = ["CHUNK_BYTES", "COPY_MODES", "ConvertResult", "convert", "plan_only"]
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
    copy: dict[str, Any] = field(default_factory=dict)  # mode, workers, bytes by how they were made

    def summary(self) -> dict[str, Any]:
        """What `convert --json` prints: the run's outcome and, per rank, its layers, files and bytes."""
        m = self.plan.mapping
        ranks = []
        for r in range(m.world_size):
            tp_rank, pp_rank = m.ranks(r)
            files = [f for f in self.plan.files if f.rank == r]
            start, stop = m.stages[pp_rank]
            ranks.append(
                {
                    "rank": r,
                    "tp_rank": tp_rank,
                    "pp_rank": pp_rank,
                    "layers": f"{start}-{stop - 1}",
                    "files": len(files),
                    "tensors": sum(len(f.tensors) for f in files),
                    "bytes": sum(f.layout.size for f in files),
                }
            )
        return {
            "kind": CONVERT_KIND,
            "schema_version": CONVERT_SCHEMA_VERSION,
            "status": self.status,
            "out": str(self.out),
            "tp": m.tp,
            "pp": m.pp,
            "seconds": self.seconds,
            "bytes_total": self.plan.total_bytes,
            "bytes_written": self.bytes_written,
            "files_reused": self.files_reused,
            "copy": self.copy,
            "ranks": ranks,
        }


def _clear_outputs(out: Path) -> None:
    """Remove what earlier conversions of ours wrote, as their manifest and journal list it, and
    nothing else (manifest first: never look complete; journal last: it is the record)."""
    try:
        ours = convert_outputs(out)
    except Plamo2Error as e:  # a manifest or journal naming `../x`: not a record to delete by
        raise untrusted_record(e, out) from None
    remove_outputs(out, ours | {MANIFEST_NAME}, first=MANIFEST_NAME)
    Journal(out).remove()


def _writes(source: Source, plan: Plan) -> list[str]:
    """Every file a conversion may create in OUT: shard files, copied side files, the manifest."""
    return [f.name for f in plan.files] + [p.name for p in source_side_files(source)] + [MANIFEST_NAME]


def _old_fingerprint(manifest: Path) -> str | None:
    """The fingerprint of the manifest already in OUT (None: none we can read, or not one of ours)."""
    try:
        raw = read_json(manifest, MANIFEST_BYTES)
    except Plamo2Error:
        return None
    old = raw.get("fingerprint") if isinstance(raw, dict) else None
    return old if isinstance(old, str) else None


def _space_needed(source: Source, files: list[FilePlan]) -> int:
    """Bytes this run will add: its shard files, the side files and a manifest (about 1 kB per
    tensor: its record, pieces and digest), so that a disk that fits only the weights is refused
    before the first byte rather than at the last file."""
    sides = sum(p.stat().st_size for p in source_side_files(source))
    return sum(f.layout.size for f in files) + sides + 1024 * sum(len(f.tensors) for f in files) + 65536


def _prepare_output(out: Path, plan: Plan, force: bool, writes: list[str]) -> dict[str, dict[str, Any]] | None:
    """Decide fresh / resume / up-to-date / refuse.  Returns the journal records worth reusing, or
    None when OUT already holds this very conversion, complete.  The caller holds OUT's lock."""
    manifest = out / MANIFEST_NAME
    journal = Journal(out)
    if manifest.exists() or manifest.is_symlink():
        old = _old_fingerprint(manifest)
        if old == plan.fingerprint and not force:
            return None
        if not force:
            raise OutputExistsError(f"{out} holds a different completed conversion; use --force to replace it")
        _clear_outputs(out)
    records = journal.finished(plan.fingerprint)
    if records is None:
        ours = journal.exists()
        others = [p for p in out.iterdir() if not p.name.startswith(".")]
        if others and not ours and not force:
            raise OutputExistsError(
                f"{out} is not empty and is not a plamo2-tools output; use --force to write into it"
            )
        if ours:
            log.info("discarding an unfinished conversion with different inputs or options")
        _clear_outputs(out)
        refuse_foreign(out, writes)  # what is left in the way is someone else's
        journal.start(plan.fingerprint, writes)
        return {}
    for name in writes:  # unfinished files of the interrupted run (ours: its journal lists them)
        (out / f"{name}.partial").unlink(missing_ok=True)
    return records


def _verified(out: Path, f: FilePlan, records: dict[str, dict[str, Any]], pool: ThreadPoolExecutor) -> bool:
    """A file finished by an earlier run: journaled, present, right size, and its digest, computed
    again now from what is on disk, is the journaled one."""
    rec = records.get(f.name)
    path = out / f.name
    if rec is None or path.is_symlink() or not path.is_file() or path.stat().st_size != f.layout.size:
        return False
    try:
        digest = WRITTEN.digests(path, HASH, pool)[0]
    except (CheckpointError, OSError):  # not even a safetensors file any more
        digest = None
    if digest != rec.get("digest"):
        log.warning("%s: digest differs from the journal; rewriting it", f.name)
        return False
    return True


def _jobs(writer: Writer, unit: list[FilePlan], parts: dict[str, PartialFile]) -> list[tuple[str, Job]]:
    """The unit's tensors as jobs, the TP ranks' i-th tensors next to each other: they cut the
    same source tensor, so the source is read front to back once for all of them."""
    per_file = [
        [
            (f.name, Job(parts[f.name], t, f.layout.offsets[t.key], segments(t, writer.source)))
            for t in sorted(f.tensors, key=lambda t: f.layout.offsets[t.key])
        ]
        for f in unit
    ]
    ordered: list[tuple[str, Job]] = []
    for i in range(max(map(len, per_file))):
        ordered += [jobs[i] for jobs in per_file if i < len(jobs)]
    return ordered


def _stream_unit(
    writer: Writer,
    pool: ThreadPoolExecutor,
    unit: list[FilePlan],
    parts: dict[str, PartialFile],
    inputs: _InputDigests | None,
) -> dict[str, dict[str, str]]:
    """Write the files of one unit; returns {file: {tensor key: digest}}.  Each source tensor's
    input digest is queued right behind the last job that copies from it, so that it hashes
    bytes the copies have just brought into the page cache."""
    jobs = _jobs(writer, unit, parts)
    last = {job.tensor.source: i for i, (_, job) in enumerate(jobs)}
    futures: list[Future] = []
    try:
        for i, (_, job) in enumerate(jobs):
            futures.append(pool.submit(writer.run, job))
            if inputs is not None and last[job.tensor.source] == i:
                inputs.hash_tensors([job.tensor.source])
        done, _ = wait(futures, return_when="FIRST_EXCEPTION")
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, Cancelled)), failed[0])  # type: ignore[misc]
    except BaseException:  # a failed job, or an interrupt: stop every job before the files go
        writer.cancel.set()
        for f in futures:
            f.cancel()
        wait(futures)  # none may still write into a file the caller is about to remove
        raise
    digests: dict[str, dict[str, str]] = {f.name: {} for f in unit}
    for (name, job), fut in zip(jobs, futures, strict=True):
        digests[name][job.tensor.key] = fut.result()
    return digests


# When the data is made durable (docs/convert.md, "Durability", has the measurements):
#   file  fsync each file before its rename and journal record (the first design)
#   end   rename and journal as files finish; fsync every file of the plan in parallel at the end,
#         then the directory, then write the manifest
#   none  never fsync the data (the manifest itself still is): only for measuring what sync costs
SYNC_MODES = ("file", "end", "none")
DEFAULT_SYNC = "end"


def _finish_file(
    part: PartialFile, f: FilePlan, tensor_digests: dict[str, str], journal: Journal, sync: str
) -> dict[str, Any]:
    """(fsync,) rename into place, journal (with the file digest made from the tensor digests).
    Runs in a worker thread."""
    if sync == "file":
        part.sync()
    order = sorted(tensor_digests, key=lambda k: f.layout.offsets[k])
    digest = combine_file_digest(f.layout.header, [tensor_digests[k] for k in order])
    part.commit(durable=sync == "file")
    record = {"file": f.name, "size": f.layout.size, "digest": digest, "tensors": tensor_digests}
    journal.append(record)
    return record


def _copy_side_files(source: Source, out: Path, sync: str) -> dict[str, dict[str, Any]]:
    """Copy config, tokenizer, ... (each created fresh, never through a planted link) and return
    their records for the manifest: {name: {size, digest}} of exactly the bytes written; each
    fsync'd before its rename unless --sync none."""
    copied = {}
    for p in source_side_files(source):
        h = new_hash(HASH)
        size = copy_file(p, out / p.name, h, durable=sync != "none")
        copied[p.name] = {"size": size, "digest": h.hexdigest()}
    return copied


_BLOB = re.compile(r"[0-9a-f]{64}")


class _InputDigests:
    """Our record of the input files: {name: {size, digest[, sha256]}}.  The digest is format 2's
    file digest (header + tensor digests), its tensors hashed as jobs on the pool right after
    the jobs that copy them, so they come out of the page cache the copies have just filled.

    A file in a Hugging Face cache is a link to a blob named by its sha256; with `verify_blobs`
    that sha256 is computed (one sequential pass per file, started first so it overlaps with
    everything else) and a mismatch, a damaged download, stops the conversion before a manifest
    can vouch for it."""

    def __init__(self, source: Source, pool: ThreadPoolExecutor, verify_blobs: bool, cancel: threading.Event) -> None:
        self.pool = pool
        self.cancel = cancel
        self.files = {p.name: p for p in source.input_files()}
        self.headers = {name: read_header(p) for name, p in self.files.items()}
        self.file_of = {t: name for name, h in self.headers.items() for t in h.tensors}
        self.tensors: dict[str, Future] = {}
        self.blobs = {
            name: pool.submit(self._sha256, p)
            for name, p in self.files.items()
            if verify_blobs and _BLOB.fullmatch(p.resolve().name)
        }

    def _sha256(self, path: Path) -> str:
        h = new_hash(SHA256)
        fd = os.open(path, os.O_RDONLY)
        try:
            for view in mapped_windows(fd, 0, os.fstat(fd).st_size):
                if self.cancel.is_set():  # the run failed or was interrupted: stop, do not hold it up
                    raise Cancelled
                h.update(view)
        finally:
            os.close(fd)
        return h.hexdigest()

    def hash_tensors(self, names: list[str]) -> None:
        for name in names:
            if name in self.file_of and name not in self.tensors:
                self.tensors[name] = self.pool.submit(self._hash_tensor, name)

    def _hash_tensor(self, name: str) -> str:
        info = self.headers[self.file_of[name]].tensors[name]
        h = new_hash(HASH)
        fd = os.open(self.files[self.file_of[name]], os.O_RDONLY)
        try:
            hash_range(fd, info.offset, info.offset + info.nbytes, [h])
        finally:
            os.close(fd)
        return h.hexdigest()

    def result(self) -> dict[str, dict[str, Any]]:
        self.hash_tensors(list(self.file_of))  # tensors no output took (none, for a valid plan)
        out: dict[str, dict[str, Any]] = {}
        for name, header in self.headers.items():
            order = sorted(header.tensors, key=lambda t: header.tensors[t].offset)
            digest = combine_file_digest(header_bytes(header), [self.tensors[t].result() for t in order])
            out[name] = {"size": header.size, "digest": digest}
            if name in self.blobs:
                sha = self.blobs[name].result()
                blob = self.files[name].resolve().name
                if sha != blob:
                    raise CheckpointError(
                        f"{self.files[name]}: content sha256 {sha[:12]}... differs from its Hugging Face cache blob "
                        f"name {blob[:12]}... (damaged download?)"
                    )
                out[name]["sha256"] = sha
        return out


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
    copy: str = "auto",
    workers: int | None = None,
    verify_blobs: bool = True,
    sync: str = DEFAULT_SYNC,
) -> ConvertResult:
    """Convert an HF checkpoint (or shards of ours) into TP x PP shards in `out`.

    `copy`: how verbatim bytes are copied (writer.COPY_MODES; "auto": inside the kernel where it
    can, else user space); `workers`: threads (default: one per core, 4 to 16); `verify_blobs`:
    check the sha256 of Hugging Face cache blobs against their names; `sync`: when the data is
    made durable (SYNC_MODES)."""
    if sync not in SYNC_MODES:
        raise UserError(f"--sync must be one of {', '.join(SYNC_MODES)}, not {sync!r}")
    if copy not in COPY_MODES:
        raise UserError(f"--copy must be one of {', '.join(COPY_MODES)}, not {copy!r}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, not {workers}")
    request = _Request(
        src,
        Path(out),
        tp,
        pp,
        pp_layers,
        dtype,
        max_part_size,
        force,
        copy,
        workers or default_workers(),
        verify_blobs,
        sync,
    )
    return _convert(request, progress, on_plan)


@dataclass(frozen=True)
class _Request:
    """What `convert` was asked, checked."""

    src: str | Path
    out: Path
    tp: int
    pp: int
    pp_layers: list[int] | None
    dtype: str
    max_part_size: int | None
    force: bool
    copy: str
    workers: int
    verify_blobs: bool
    sync: str

    def plan(self, source: Source) -> Plan:
        problems = output_path_problems(source.path, self.out)
        if problems:
            raise UserError("; ".join(problems))
        kwargs = {} if self.max_part_size is None else {"max_part_size": self.max_part_size}
        return make_plan(source, self.tp, self.pp, self.pp_layers, self.dtype, **kwargs)


def _locked(progress: Progress | None) -> Progress | None:
    """The progress callback, called from many threads: one at a time."""
    if progress is None:
        return None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


def _convert(req: _Request, progress: Progress | None, on_plan: Callable[[Plan], None] | None) -> ConvertResult:
    """Plan, then hold OUT's lock while `_Run` writes it; the lock goes only after every worker
    has stopped, and the source is closed last."""
    start = time.perf_counter()
    source = open_source(req.src)
    lock: OutputLock | None = None
    try:
        plan = req.plan(source)
        ensure_not_being_written(req.out)  # a second writer stops here, before hashing a shard source
        pool = ThreadPoolExecutor(req.workers, thread_name_prefix="plamo2-convert")
        try:
            # Shards as input are checked against their manifest before OUT is touched; their
            # digests then serve as our input record (an HF source is hashed while we copy).
            known_inputs = source.verify(pool) if isinstance(source, ShardSource) else None
            make_output_dir(req.out)
            lock = OutputLock(req.out, "convert")  # held until the manifest is written and the journal gone
            return _Run(req, source, plan, pool, progress).run(known_inputs, on_plan, start)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if lock is not None:
            lock.release()
        source.close()


class _Run:
    """One conversion into OUT under its lock: keep the finished files that still verify, write the
    others unit by unit (their digests into the journal as each file finishes), then the side
    files, fsync as `sync` says, and the manifest last."""

    def __init__(
        self, req: _Request, source: Source, plan: Plan, pool: ThreadPoolExecutor, progress: Progress | None
    ) -> None:
        self.req, self.out, self.source, self.plan, self.pool = req, req.out, source, plan, pool
        self.journal = Journal(req.out)
        self.writer = Writer(source, HASH, req.copy, _locked(progress))

    def run(
        self, known_inputs: dict[str, dict[str, Any]] | None, on_plan: Callable[[Plan], None] | None, start: float
    ) -> ConvertResult:
        req, out, plan = self.req, self.out, self.plan
        records = _prepare_output(out, plan, req.force, _writes(self.source, plan))
        if records is None:
            manifest = read_json(out / MANIFEST_NAME, MANIFEST_BYTES)
            return ConvertResult(out, plan, "up-to-date", time.perf_counter() - start, 0, manifest=manifest)
        # Per file, not per unit: a kill between two files of one unit keeps the finished one
        # (docs/shard-format.md: "skips the finished files whose digests match").
        reused = [f.name for u in plan.units for f in u if _verified(out, f, records, self.pool)]
        todo = [kept for u in plan.units if (kept := [f for f in u if f.name not in reused])]
        if reused:
            log.info("resuming: %d finished file(s) verified and kept", len(reused))
        check_free_space(out, _space_needed(self.source, [f for u in todo for f in u]), "the conversion")
        if on_plan:
            on_plan(plan)
        written, input_digests, copied = self.write(todo, known_inputs)
        finished = {**records, **(self.journal.finished(plan.fingerprint) or {})}
        if req.sync != "none":
            fsync_dir(out)  # the renames, before a manifest can vouch for the files
        manifest = _manifest(self.source, plan, finished, input_digests, copied)
        write_manifest(out, manifest)
        self.journal.remove()
        fsync_dir(out)
        status = "resumed" if reused else "converted"
        copy = {"mode": req.copy, "workers": req.workers, "sync": req.sync, "bytes": dict(self.writer.stats)}
        return ConvertResult(out, plan, status, time.perf_counter() - start, written, reused, manifest, copy)

    def write(
        self, todo: list[list[FilePlan]], known_inputs: dict[str, dict[str, Any]] | None
    ) -> tuple[int, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Every file of `todo`, the input record and the side files: (bytes written, input
        digests, side-file records).  A failure or an interrupt stops every job first."""
        inputs = None
        if known_inputs is None:
            inputs = _InputDigests(self.source, self.pool, self.req.verify_blobs, self.writer.cancel)
        try:
            written = self._write_units(todo, inputs)
            input_digests = known_inputs if inputs is None else inputs.result()
            copied = _copy_side_files(self.source, self.out, self.req.sync)
            if self.req.sync == "end":  # reused files too: an interrupted run may not have synced them
                # (the side files were fsynced as they were copied: _copy_side_files)
                list(self.pool.map(fsync_path, [self.out / f.name for f in self.plan.files]))
        except BaseException:
            self.writer.cancel.set()  # also stops a blob's sha256 still running
            raise
        finally:
            self.writer.close()
        return written, input_digests, copied

    def _write_units(self, todo: list[list[FilePlan]], inputs: _InputDigests | None) -> int:
        """Stream each unit's files; each file is finished (renamed, journaled) on a second pool
        while the next unit streams."""
        written = 0
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="plamo2-finish") as finisher:
            finishing: list[Future] = []
            for unit in todo:
                parts, digests = self._stream(unit, inputs)
                written += sum(f.layout.size - len(f.layout.header) for f in unit)
                finishing += [
                    finisher.submit(_finish_file, parts[f.name], f, digests[f.name], self.journal, self.req.sync)
                    for f in unit
                ]
            for fut in finishing:
                fut.result()
        return written

    def _stream(
        self, unit: list[FilePlan], inputs: _InputDigests | None
    ) -> tuple[dict[str, PartialFile], dict[str, dict[str, str]]]:
        """One unit's `.partial` files, written; on failure none of them is left behind."""
        parts: dict[str, PartialFile] = {}
        try:
            for f in unit:
                parts[f.name] = PartialFile(self.out / f.name, f.layout)
            return parts, _stream_unit(self.writer, self.pool, unit, parts, inputs)
        except BaseException:
            for part in parts.values():
                part.abort()
            raise


def _manifest(
    source: Source,
    plan: Plan,
    finished: dict[str, dict[str, Any]],
    input_digests: dict[str, dict[str, Any]],
    copied: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    return build_manifest(
        fingerprint=plan.fingerprint,
        source={
            "path": str(source.path),
            "kind": source.kind,
            "files": input_digests,
            "config_sha256": config_sha256(source.path),
            "tensors": {
                n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for n, t in sorted(source.tensors.items())
            },
        },
        config=source.config,
        mapping=plan.mapping,
        out_dtype=plan.out_dtype,
        max_part_size=plan.max_part_size,
        files=[(f.name, f.rank, f.part, finished[f.name]) for f in plan.files],
        tensors=[(f.rank, f.name, t, finished[f.name]["tensors"][t.key]) for f in plan.files for t in f.tensors],
        copied=copied,
    )


def plan_only(src: str | Path, tp: int, pp: int, pp_layers: list[int] | None = None, dtype: str = "auto") -> Plan:
    source = open_source(src)
    try:
        return make_plan(source, tp, pp, pp_layers, dtype)
    finally:
        source.close()
