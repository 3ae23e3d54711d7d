"""`plamo2-tools export fp8`: a compressed-tensors FP8 checkpoint (llm-compressor's FP8_DYNAMIC scheme)
in the Hugging Face layout, for vLLM and SGLang (docs/export.md, "FP8").

What the checkpoint holds, each fact from the code that defines it (compressed-tensors 0.19.0, the
version llm-compressor 0.14.0.1 pins, and 0.20.1):

* the scheme, `FP8_DYNAMIC` (quant_scheme.py): weights float 8-bit, one scale per output channel,
  static, symmetric; input activations float 8-bit per token, dynamic (the consumer computes their
  scales at run time, so the checkpoint holds none);
* every quantized linear `X.weight` becomes `X.weight` in float8_e4m3fn, same shape, and
  `X.weight_scale` [rows, 1] in the source's dtype (initialize.py: the scale takes the observed
  weight's dtype); no zero point (symmetric);
* the scale of a row is `amax / 448` computed in that dtype, amax = max(|min(row, 0)|, max(row, 0))
  (llm-compressor's memoryless min-max observer, then calculate_qparams), and a zero scale becomes
  the dtype's machine epsilon (no division by zero);
* the weight is `clamp(w / scale, -448, 448)` rounded to e4m3fn, the division rounded in the source
  dtype first (`_quantize`: `x / scale` of two bfloat16 tensors is a bfloat16 tensor);
* `config.json` gains `quantization_config` exactly as llm-compressor's `model_free_ptq` writes it
  (`quantization_config()`), and is written as it writes it (indent 2, sorted keys).

Which linears are quantized is the family's fact (`Family.fp8_quantized`; `fp8_kept` are linears a
consumer would quantize that stay in the source dtype, named in `ignore` with `lm_head` and the
embedding); norms, the embedding and the head keep their bytes.  The values are computed in numpy
with torch's rounding (numerics.py), so this command imports no torch unless it verifies.

Output safety as `merge`: OUT's lock, `.plamo2_written.json` before the first byte, weights under
`.partial` names renamed when complete, `config.json` after them (and taken away again when the run
stops during its verification), so an interrupted export never looks like a checkpoint.  Unless told
not to, the export ends with `verify OUT --reference SRC` in-process (export/verified.py: the `fp8`
deploy target, deploy/fp8.py, judged by deploy/verify.py): the result goes to `plamo2_export.json`
beside the weights (and to `report`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..convert.engine import CHUNK_BYTES
from ..convert.plan import output_path_problems
from ..convert.sources import Source, open_source, source_side_files
from ..dtypes import FLOAT8_E4M3, DType
from ..errors import CheckFailed, CheckpointError, UserError
from ..jsonio import CONFIG_BYTES, read_object
from ..kinds import EXPORT_FP8_KIND, EXPORT_FP8_SCHEMA_VERSION
from ..model.checkpoint import INDEX_NAME, HFCheckpoint, hf_file_names
from ..model.layout import GLOBAL, applies
from ..model.registry import family_of, hf_tensor_shapes
from ..outputs import check_free_space, make_output_dir, prepare_output, write_record
from ..safe_files import copy_file
from ..safetensors_io import PartialFile, atomic_write_text, plan_file, tensor_bytes
from ..shards.lock import OutputLock, ensure_not_being_written
from ..shards.owned import ensure_readable_checkpoint
from .fp8_format import (
    COMPRESSED_TENSORS_VERSION,
    SCALE_DTYPES,
    SCHEME,
    NonFinite,
    quantization_config,
    quantize_rows,
)
from .side import SIDE_JSON  # the export's record and its measured verification figures

EXPORT_KIND, EXPORT_SCHEMA_VERSION = EXPORT_FP8_KIND, EXPORT_FP8_SCHEMA_VERSION  # kinds.py
LAST = "config.json"  # without it the directory is no checkpoint: written last, it marks completion
DEFAULT_MAX_PART_SIZE = 5 * 2**30


# ---- what gets written ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutTensor:
    name: str
    source: str
    dtype: DType
    shape: tuple[int, ...]
    role: str  # "copy" (source bytes), "fp8" (the quantized weight), "scale" (its weight_scale)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Plan:
    tensors: list[OutTensor]  # in the checkpoint's own order, each quantized weight followed by its scale
    quantized: list[str]  # source names
    ignore: list[str]  # module names for quantization_config
    files: list[list[OutTensor]] = field(default_factory=list)

    @property
    def file_names(self) -> list[str]:
        return hf_file_names(len(self.files))


def fp8_names(family: Any, cfg: Any) -> tuple[list[str], list[str]]:
    """(source names of the weights an export quantizes, module names it keeps and must list in `ignore`)."""
    quantized, kept = [], []
    rows = {k.hf: k for k in family.tensors if k.hf is not None and k.where != GLOBAL}
    for i, layer_kind in enumerate(cfg.layer_kinds):
        prefix = family.layer_prefix.format(i)
        for names, out in ((family.fp8_quantized, quantized), (family.fp8_kept, kept)):
            out += [prefix + n for n in names if applies(rows[n], layer_kind)]
    return quantized, [n.removesuffix(".weight") for n in kept]


def plan_export(source: Source, max_part_size: int = DEFAULT_MAX_PART_SIZE) -> Plan:
    family = family_of(source.config)
    quantized, kept = fp8_names(family, source.config)
    if not quantized:
        raise UserError(f"{family.description}: the family declares no linears for an FP8 export")
    chosen = set(quantized)
    tensors: list[OutTensor] = []
    for name, t in source.tensors.items():
        if name not in chosen:
            tensors.append(OutTensor(name, name, t.dtype, t.shape, "copy"))
            continue
        if t.dtype not in SCALE_DTYPES or len(t.shape) != 2:
            raise CheckpointError(
                f"{name}: {t.dtype} {list(t.shape)}: an FP8 export quantizes 2-D float32, bfloat16 or float16 "
                "weights (export from the unquantized checkpoint)"
            )
        tensors.append(OutTensor(name, name, FLOAT8_E4M3, t.shape, "fp8"))
        tensors.append(
            OutTensor(name.removesuffix(".weight") + ".weight_scale", name, t.dtype, (t.shape[0], 1), "scale")
        )
    ignore = [family.head_name.removesuffix(".weight"), family.embed_name.removesuffix(".weight"), *kept]
    return Plan(tensors, quantized, ignore, _groups(tensors, max_part_size))


def _groups(tensors: list[OutTensor], max_part_size: int) -> list[list[OutTensor]]:
    """Greedily into files of at most max_part_size bytes; a weight and its scale stay in one file."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_part_size and t.role != "scale":
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


# ---- writing ---------------------------------------------------------------------------------------------
@dataclass
class ExportResult:
    out: Path
    files: list[str]
    quantized: int
    seconds: float
    source_bytes: int
    output_bytes: int
    verification: dict[str, Any] | None
    record: dict[str, Any]


def _chunks(source: Source, name: str) -> Iterator[tuple[int, np.ndarray]]:
    st = source.tensors[name]
    step = max(1, CHUNK_BYTES // max(1, st.row_bytes))
    for a in range(0, st.rows, step):
        yield a, source.read_rows(name, a, min(a + step, st.rows))


Target = tuple[OutTensor, PartialFile, int]  # an output tensor, its file, its payload offset there


class Cancelled(Exception):
    """Another job failed or the run was interrupted: this one stops at its next chunk."""


def _write_source(
    source: Source, name: str, targets: list[Target], progress: Callable | None, cancelled: threading.Event
) -> None:
    """Every output of one source tensor (the copy, or the fp8 weight and its scale), chunk by chunk of source
    rows: memory is one chunk and its temporaries, and each source byte is read once."""
    try:
        _write_chunks(source, name, targets, progress, cancelled)
    except BaseException:
        cancelled.set()  # at once, from the failing job itself: the others stop at their next chunk
        raise


def _write_chunks(
    source: Source, name: str, targets: list[Target], progress: Callable | None, cancelled: threading.Event
) -> None:
    src_dtype = source.tensors[name].dtype
    for first, rows in _chunks(source, name):
        if cancelled.is_set():
            raise Cancelled
        values = {"copy": rows}
        if targets[0][0].role != "copy":
            try:
                values["fp8"], values["scale"] = quantize_rows(rows, src_dtype)
            except NonFinite as e:
                raise CheckpointError(
                    f"{name}: non-finite value in row {first + e.row}: an FP8 scale cannot be derived from it"
                ) from None
        for t, part, offset in targets:
            part.write_at(offset + first * (t.nbytes // t.shape[0]), tensor_bytes(values[t.role]))
        if progress is not None:
            progress(rows.nbytes)


def _write_weights(source: Source, plan: Plan, out: Path, workers: int, progress: Callable | None) -> None:
    """Every file at once, one job per source tensor; each file renamed into place once all its tensors are in."""
    parts: list[PartialFile] = []
    try:
        jobs: dict[str, list[Target]] = {}
        for fname, group in zip(plan.file_names, plan.files, strict=True):
            layout = plan_file([(t.name, t.dtype, t.shape) for t in group], {"format": "pt"})
            part = PartialFile(out / fname, layout)
            parts.append(part)
            for t in group:
                jobs.setdefault(t.source, []).append((t, part, layout.offsets[t.name]))
        # Largest first, so that the last job to finish is a small one.
        order = sorted(jobs, key=lambda n: -source.tensors[n].rows * source.tensors[n].row_bytes)
        cancelled = threading.Event()
        pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="export-fp8")
        futures = [pool.submit(_write_source, source, n, jobs[n], progress, cancelled) for n in order]
        try:
            for f in futures:
                f.result()
        except BaseException as e:
            # A failed job or Ctrl-C: the others stop at their next chunk, queued ones never start.
            cancelled.set()
            pool.shutdown(wait=True, cancel_futures=True)
            if isinstance(e, Cancelled):  # report the job that failed, not one it stopped
                raise next(
                    x
                    for f in futures
                    if f.done()
                    and not f.cancelled()
                    and (x := f.exception()) is not None
                    and not isinstance(x, Cancelled)
                ) from None
            raise
        pool.shutdown(wait=True)
        for part in parts:
            part.commit()
    except BaseException:
        for part in parts:
            part.abort()
        raise


def _refuse_quantized(config_path: Path) -> dict[str, Any]:
    """The raw config.json (bounded read), refused when it says the checkpoint is already quantized."""
    if not config_path.is_file():
        return {}
    raw = read_object(config_path, CONFIG_BYTES, "a config")
    if "quantization_config" in raw:
        q = raw["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else None
        raise UserError(
            f"{config_path}: already quantized (quant_method {method!r}); export from the unquantized checkpoint"
        )
    return raw


def _reference(source: Source, reference: str | Path | None) -> Path:
    """The HF checkpoint the export is verified against: --reference, else the source when it is one
    (refused before writing when neither, or when it is not shaped like the source)."""
    if reference is None:
        if source.kind == "shards":
            raise UserError(
                f"{source.path} is a shard directory: give --reference HF_CHECKPOINT to verify, or --no-verify"
            )
        return Path(source.path)
    ref = Path(reference)
    ensure_readable_checkpoint(ref)
    with HFCheckpoint(ref) as ckpt:
        ckpt.check_inventory()
        if hf_tensor_shapes(ckpt.config) != hf_tensor_shapes(source.config):
            raise UserError(f"--reference {ref} is not shaped like the model being exported")
    return ref


def measured_kl(verification: dict[str, Any]) -> float | None:
    """The mean KL a verification measured (teacher-forced, under the convention the target follows or
    else the first); None when the target could not run."""
    targets = verification.get("targets") or []
    if not targets:
        return None
    t = targets[0]
    r = t["conventions"][t["follows"][0] if t["follows"] else next(iter(t["conventions"]))]
    kl = (r["teacher_forced"] or r["greedy"])["mean_kl"]
    return None if kl is None else float(kl)


def _index(plan: Plan) -> str:
    weight_map = {t.name: fname for fname, group in zip(plan.file_names, plan.files, strict=True) for t in group}
    total = sum(t.nbytes for t in plan.tensors)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)


def export_fp8(
    src: str | Path,
    out: str | Path,
    *,
    max_part_size: int = DEFAULT_MAX_PART_SIZE,
    force: bool = False,
    verify: bool = True,
    reference: str | Path | None = None,
    verify_options: dict[str, Any] | None = None,
    max_kl: float | None = None,
    workers: int = 2,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write the FP8 checkpoint of `src` (an HF checkpoint or our shards) into `out`; verify it unless told not
    to.  Raises CheckFailed (exit 1) after writing a complete export whose measured mean KL exceeds `max_kl`."""
    start = time.perf_counter()
    out = Path(out)
    _refuse_quantized(Path(src) / LAST)  # before the reader, which would only see unexpected tensors
    source = open_source(src)
    lock: OutputLock | None = None
    config_written = finished = False
    try:
        problems = output_path_problems(source.path, out)
        if problems:
            raise UserError("; ".join(problems))
        ensure_not_being_written(out)
        if source.kind == "shards":
            source.verify()  # type: ignore[attr-defined]  # a damaged shard must not come back quantized
        if verify:
            reference = _reference(source, reference)
        sides = source_side_files(source)
        config_path = next((p for p in sides if p.name == LAST), None)
        if config_path is None:
            raise CheckpointError(f"{source.path}: no {LAST} to copy")
        raw = _refuse_quantized(config_path)
        plan = plan_export(source, max_part_size)
        writes = plan.file_names + ([INDEX_NAME] if len(plan.files) > 1 else []) + [p.name for p in sides]
        writes += [SIDE_JSON] if SIDE_JSON not in writes else []
        if SIDE_JSON in {p.name for p in sides}:
            raise UserError(f"{source.path}: has a {SIDE_JSON} of its own; export from the original checkpoint")
        make_output_dir(out)
        lock = OutputLock(out, "export fp8")
        prepare_output(out, writes, force)
        output_bytes = sum(t.nbytes for t in plan.tensors)
        check_free_space(
            out, output_bytes + sum(p.stat().st_size for p in sides) + 65536 * (len(plan.files) + 3), "the FP8 export"
        )
        write_record(out, "export fp8", str(source.path), writes, "writing")
        source_bytes = sum(t.rows * t.row_bytes for t in source.tensors.values())
        if on_plan is not None:
            on_plan(source_bytes)
        for p in sides:
            if p.name != LAST:
                copy_file(p, out / p.name)  # created fresh: never through a link planted in OUT
        _write_weights(source, plan, out, workers, progress)
        if len(plan.files) > 1:
            atomic_write_text(out / INDEX_NAME, _index(plan) + "\n")
        written_s = time.perf_counter() - start
        # config.json before the verification (the fp8 target reads it, as vLLM would), taken away
        # again if the run stops before the record says complete: never a half-verified checkpoint.
        config = {**raw, "quantization_config": quantization_config(plan.ignore)}
        atomic_write_text(out / LAST, json.dumps(config, indent=2, sort_keys=True))
        config_written = True
        verification = None
        if verify:
            from .verified import verify_export  # torch: only when verifying

            verification = verify_export("fp8", out, reference, **(verify_options or {}))
        record = {
            "kind": EXPORT_KIND,
            "schema_version": EXPORT_SCHEMA_VERSION,
            "format": "fp8",
            "scheme": SCHEME,
            "compressed_tensors_version": COMPRESSED_TENSORS_VERSION,
            "source": str(source.path),
            "source_kind": source.kind,
            "family": family_of(source.config).name,
            "out": str(out),
            "files": plan.file_names,
            "quantized": plan.quantized,
            "ignore": plan.ignore,
            "source_weight_bytes": source_bytes,
            "output_weight_bytes": output_bytes,
            "write_seconds": round(written_s, 3),
            "verification": verification,
            "max_kl": max_kl,
        }
        atomic_write_text(out / SIDE_JSON, json.dumps(record, indent=1) + "\n")
        write_record(out, "export fp8", str(source.path), writes, "complete")
        finished = True
        result = ExportResult(
            out,
            plan.file_names,
            len(plan.quantized),
            time.perf_counter() - start,
            source_bytes,
            output_bytes,
            verification,
            record,
        )
    finally:
        if config_written and not finished:
            (out / LAST).unlink(missing_ok=True)
        if lock is not None:
            lock.release()
        source.close()
    kl = None if verification is None else measured_kl(verification)
    if max_kl is not None and kl is not None and kl > max_kl:
        raise CheckFailed(
            f"{out}: FP8 export written, but its measured mean KL {kl:.3g} exceeds --max-kl {max_kl:g} ({SIDE_JSON})"
        )
    return result
