"""`plamo2-tools export mlx`: the directory `mlx_lm.load` reads, written from an HF checkpoint or
our shards (docs/export.md, "MLX").

What goes where is the family's (`model/<family>/mlx.py`: names, shapes, config keys, the --mixed
precisions); this module plans the files, streams every tensor through in row chunks (cast, reshape,
quantized with MLX's affine scheme in numpy, `mlx_quant.py`), and keeps convert's output rules: OUT
is locked while written (`shards/lock.py`), the files it will write are recorded before the first
byte (`.plamo2_written.json`, outputs.py), every file is created fresh under a temporary name and
renamed when complete, a file of someone else's is never written over (`--force` replaces only
ours), and `config.json` (what makes the directory loadable) is written after every weight and
taken away again if the run stops before the end, so an interrupted export never looks complete.
No PyTorch and no MLX here; the verification that ends an export (`verified.py`: `verify`'s judge on
the MLX target) loads both.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..convert.plan import split_parts
from ..dtypes import UINT32, DType
from ..errors import CheckpointError, EnvironmentLimitError, UserError
from ..kinds import EXPORT_MLX_KIND, EXPORT_MLX_SCHEMA_VERSION
from ..model.layout import layer_of
from ..model.mlx import BULK, KEEP, MIXED_BASE_BITS, MLXLayout, MLXTensor
from ..model.registry import family_of, hf_tensor_shapes
from ..numerics import cast
from ..outputs import RECORD_NAME, check_free_space, make_output_dir, prepare_output, write_record
from ..safe_files import copy_file
from ..safetensors_io import PartialFile, atomic_write_text, plan_file, tensor_bytes
from ..shards.lock import OutputLock, ensure_not_being_written
from .mlx_quant import check_params, quantize, quantized_shapes
from .side import SIDE_JSON

COMMAND = "export mlx"
CONFIG_NAME = "config.json"  # written last: mlx-lm cannot load a directory without it
INDEX_NAME = "model.safetensors.index.json"
EXPORT_KIND, EXPORT_SCHEMA_VERSION = EXPORT_MLX_KIND, EXPORT_MLX_SCHEMA_VERSION  # kinds.py
MAX_PART_BYTES = 5 << 30  # mlx-lm's own shard size (utils.MAX_FILE_SIZE_GB)
CHUNK_BYTES = 8 << 20  # source rows per job: memory is a few of these per thread
WORKERS = os.cpu_count() or 1
# copy_file_range refusing a pair of files (another filesystem on old kernels, special files):
# the chunk goes through user space instead.
KERNEL_REFUSALS = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})
METADATA = {"format": "mlx"}  # what mlx_lm.save writes into every safetensors header
NOT_COPIED = (CONFIG_NAME, INDEX_NAME, RECORD_NAME)


class Source(Protocol):
    """What the export reads (convert/sources.py's HFSource and ShardSource are two)."""

    path: Path
    config: Any

    @property
    def tensors(self) -> dict[str, Any]: ...  # name -> object with .dtype (DType) and .shape

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray: ...

    def locate(self, name: str) -> tuple[Path, Any] | None: ...  # (file, header entry) of verbatim bytes


@dataclass(frozen=True)
class Planned:
    """One source tensor as mlx-lm will hold it."""

    name: str  # HF name = mlx-lm's parameter name
    module: str  # the module path (name without ".weight")
    shape: tuple[int, ...]  # mlx-lm's (unquantized) shape
    rows: int  # source rows used (the leading ones)
    source_dtype: DType
    dtype: DType  # the values' dtype (of scales and biases when quantized)
    bits: int | None = None
    group_size: int | None = None

    def outputs(self) -> list[tuple[str, DType, tuple[int, ...]]]:
        if self.bits is None:
            return [(self.name, self.dtype, self.shape)]
        assert self.group_size is not None
        wshape, sshape = quantized_shapes(self.shape, self.bits, self.group_size)
        return [
            (f"{self.module}.weight", UINT32, wshape),
            (f"{self.module}.scales", self.dtype, sshape),
            (f"{self.module}.biases", self.dtype, sshape),
        ]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for _, d, s in self.outputs())


@dataclass(frozen=True)
class Recipe:
    """How to quantize: nothing (bits None), or MLX affine at `bits` with `group_size`, optionally
    PFN's --mixed split, and per-module overrides {fnmatch pattern on the module path: bits, or
    None to keep it unquantized} (tests plant bad recipes with these)."""

    bits: int | None = None
    group_size: int = 64
    mixed: bool = False
    dtype: DType | None = None  # cast every float tensor to this; None keeps each source dtype
    overrides: dict[str, int | None] = field(default_factory=dict)

    def check(self) -> None:
        if self.bits is None:
            if self.mixed or self.overrides:
                raise UserError("--mixed needs --bits (the precision of the bulk tensors)")
            return
        check_params(self.bits, self.group_size)
        for pattern, bits in self.overrides.items():
            if bits is not None:
                check_params(bits, self.group_size)
            if not pattern:
                raise UserError("an empty override pattern")

    def bits_for(self, module: str, row: MLXTensor, in_dim: int) -> int | None:
        """The bits of one quantizable module, None for unquantized (mlx-lm's own rule first: a
        last axis that the group size does not divide stays unquantized)."""
        if self.bits is None or in_dim % self.group_size:
            return None
        for pattern, bits in self.overrides.items():
            if fnmatch.fnmatchcase(module, pattern):
                return bits
        if not self.mixed:
            return self.bits
        return {KEEP: None, BULK: self.bits}.get(row.mixed, MIXED_BASE_BITS)


def layout_of(config: Any) -> MLXLayout:
    family = family_of(config)
    layout = family.mlx_layout()
    if layout is None:
        raise UserError(f"export mlx: mlx-lm has no model for {family.description}")
    return layout


def plan(source: Source, recipe: Recipe) -> tuple[list[Planned], dict[str, Any] | None]:
    """Every tensor as mlx-lm holds it, in the model's order, and the config's `quantization`."""
    cfg = source.config
    family = family_of(cfg)
    layout = layout_of(cfg)
    planned: list[Planned] = []
    quant: dict[str, Any] | None = None
    if recipe.bits is not None:
        quant = {"group_size": recipe.group_size, "bits": recipe.bits, "mode": "affine"}
    for name in hf_tensor_shapes(cfg):
        row = layout.tensors[layer_of(name, family.layer_prefix)[1]]
        src = source.tensors[name]
        rows = src.shape[0] if row.rows is None else row.rows(cfg)
        shape = tuple(row.shape(cfg)) if row.shape is not None else (rows, *src.shape[1:])
        dtype = recipe.dtype or src.dtype
        module = name.removesuffix(".weight")
        bits = recipe.bits_for(module, row, shape[-1]) if row.linear else None
        if row.linear and quant is not None and bits != recipe.bits:
            quant[module] = False if bits is None else {"group_size": recipe.group_size, "bits": bits}
        group = recipe.group_size if bits is not None else None
        planned.append(Planned(name, module, shape, rows, src.dtype, dtype, bits, group))
    return planned, quant


def mlx_config(source: Source, quant: dict[str, Any] | None, dtype: DType | None) -> dict[str, Any]:
    """The HF config as mlx-lm reads it (the family's keys) plus `quantization`, written twice as
    mlx_lm.convert writes it (`quantization_config` is what Hugging Face tools look for)."""
    cfg = source.config
    out = layout_of(cfg).config(cfg.to_dict(), cfg)
    out.pop("quantization", None)
    out.pop("quantization_config", None)
    if dtype is not None:
        out["torch_dtype"] = dtype.name
    if quant is not None:
        out["quantization"] = quant
        out["quantization_config"] = quant
    return dict(sorted(out.items()))


def file_names(count: int) -> list[str]:
    """mlx-lm's names (utils.save_model), which its loader globs as model*.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def convert_rows(p: Planned, rows: np.ndarray) -> list[np.ndarray]:
    """Source rows (storage of p.source_dtype) -> the arrays of p's outputs for those rows."""
    values = cast(rows, p.source_dtype, p.dtype)
    values = values.reshape(len(values), *p.shape[1:])
    if p.bits is None:
        return [values]
    assert p.group_size is not None
    return list(quantize(values, p.dtype, p.bits, p.group_size))


def chunks_of(source: Source, p: Planned) -> list[tuple[Planned, int, int]]:
    """p's source rows in steps of about CHUNK_BYTES (the unit of work and of memory)."""
    src = source.tensors[p.name]
    row_bytes = math.prod(src.shape[1:]) * p.source_dtype.itemsize
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    return [(p, a, min(a + step, p.rows)) for a in range(0, p.rows, step)]


def kernel_copy(src: int, src_off: int, out: PartialFile, dst_off: int, n: int) -> bool:
    """n bytes from a source file into ours inside the kernel (copy_file_range: page cache to page
    cache, no trip through Python); False when the kernel refuses this pair of files."""
    done = 0
    try:
        while done < n:
            got = os.copy_file_range(src, out.fd, n - done, src_off + done, dst_off + done)
            if got == 0:
                raise CheckpointError(f"{out.path}: the source shrank while being read")
            done += got
    except OSError as e:
        if e.errno in KERNEL_REFUSALS and done == 0:
            return False
        raise EnvironmentLimitError(f"{out.partial}: {e.strerror or e}") from None
    return True


def write_file(
    source: Source, path: Path, group: list[Planned], progress: Callable[[int], None] | None, workers: int = WORKERS
) -> None:
    """One safetensors file, written under .partial and renamed when complete.  Its chunks run on
    `workers` threads (numpy's casts and the quantizer release the GIL), at most two per thread in
    flight, each written at its own offset: memory stays at a few chunks per thread.  A tensor
    stored as it is (no cast, no quantization: a reshape or a leading-rows cut keeps its bytes)
    is copied inside the kernel when the source can say where its bytes lie."""
    layout = plan_file([o for p in group for o in p.outputs()], METADATA)
    out = PartialFile(path, layout)
    fds: dict[Path, int] = {}

    def verbatim(p: Planned) -> tuple[int, int] | None:
        """(source fd, offset of the tensor's first byte) when p can be copied as it lies."""
        where = getattr(source, "locate", lambda name: None)(p.name) if p.bits is None else None
        if where is None or p.dtype != p.source_dtype:
            return None
        file, info = where
        if file not in fds:
            fds[file] = os.open(file, os.O_RDONLY)
        return fds[file], info.offset

    def job(p: Planned, a: int, b: int, at: tuple[int, int] | None) -> int:
        row = layout.nbytes[p.name] // p.shape[0] if p.bits is None else 0
        if at is not None and kernel_copy(at[0], at[1] + a * row, out, layout.offsets[p.name] + a * row, (b - a) * row):
            return (b - a) * row
        rows = source.read_rows(p.name, a, b)
        # Rows a..b of the (reshaped) tensor: conv1d's [C, K, 1] has the rows of [C, 1, K].
        for (n, _, _), arr in zip(p.outputs(), convert_rows(p, rows), strict=True):
            out.write_at(layout.offsets[n] + a * (layout.nbytes[n] // p.shape[0]), tensor_bytes(arr))
        return rows.nbytes

    try:
        jobs = [(*c, verbatim(p)) for p in group for c in chunks_of(source, p)]
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="plamo2-export") as pool:
            pending: deque[Future[int]] = deque()
            try:
                for c in jobs:
                    pending.append(pool.submit(job, *c))
                    if len(pending) >= 2 * workers:
                        done = pending.popleft().result()
                        if progress:
                            progress(done)
                while pending:
                    done = pending.popleft().result()
                    if progress:
                        progress(done)
            finally:
                for f in pending:
                    f.cancel()
        out.commit()
    except BaseException:
        out.abort()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)


def side_copies(side_files: Iterable[Path]) -> list[Path]:
    return [p for p in side_files if p.name not in NOT_COPIED and p.name != SIDE_JSON]


def output_path_problems(source_path: Path, out: Path) -> list[str]:
    src, dst = source_path.resolve(), out.resolve()
    if src == dst:
        return [f"output {out} is the source directory; choose another one"]
    if src in dst.parents:
        return [f"output {out} is inside the source directory; choose another one"]
    return []


def planned_bytes(source: Source, recipe: Recipe) -> int:
    """What the export reads from the source (its progress total)."""
    planned, _ = plan(source, recipe)
    return sum(p.rows * math.prod(source.tensors[p.name].shape[1:]) * p.source_dtype.itemsize for p in planned)


def export_mlx(
    source: Source,
    side_files: list[Path],
    out: str | Path,
    recipe: Recipe,
    force: bool = False,
    verify: Callable[[Path, list[Planned]], dict[str, Any]] | None = None,
    max_part: int = MAX_PART_BYTES,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write OUT; then, when `verify` is given, run it on the finished directory and the plan (its
    figures go into SIDE_JSON and the result).  Returns the export's record (kind EXPORT_KIND)."""
    out = Path(out)
    recipe.check()
    problems = output_path_problems(source.path, out)
    if problems:
        raise UserError("; ".join(problems))
    ensure_not_being_written(out)
    planned, quant = plan(source, recipe)
    groups = split_parts(planned, max_part)
    weights = file_names(len(groups))
    sides = side_copies(side_files)
    writes = [*weights, *([INDEX_NAME] if len(groups) > 1 else []), *(p.name for p in sides), CONFIG_NAME, SIDE_JSON]
    make_output_dir(out)
    lock = OutputLock(out, COMMAND)
    config_written = finished = False
    try:
        prepare_output(out, writes, force)
        need = sum(p.nbytes for p in planned) + sum(p.stat().st_size for p in sides) + 65536 * (len(groups) + 2)
        check_free_space(out, need, "the export")
        write_record(out, COMMAND, str(source.path), writes, "writing")
        for name, group in zip(weights, groups, strict=True):
            write_file(source, out / name, group, progress)
        if len(groups) > 1:
            weight_map = {o[0]: f for f, g in zip(weights, groups, strict=True) for p in g for o in p.outputs()}
            index = {
                "metadata": {"total_size": sum(p.nbytes for p in planned)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        for p in sides:
            copy_file(p, out / p.name)  # created fresh: never through a link planted in OUT
        config = mlx_config(source, quant, recipe.dtype)
        atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        config_written = True
        record = export_record(source, out, recipe, planned, quant, weights)
        if verify is not None:
            record["verification"] = verify(out, planned)
        atomic_write_text(out / SIDE_JSON, json.dumps(record, indent=2) + "\n")
        write_record(out, COMMAND, str(source.path), writes, "complete")
        finished = True
        return record
    finally:
        if config_written and not finished:  # stopped during the verification: must not look loadable
            (out / CONFIG_NAME).unlink(missing_ok=True)
        lock.release()


def export_mlx_path(
    src: str | Path,
    out: str | Path,
    recipe: Recipe,
    *,
    verify: bool = True,
    reference: str | Path | None = None,
    force: bool = False,
    max_part: int = MAX_PART_BYTES,
    progress_for: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """`export mlx SRC OUT` as a library call: SRC (an HF checkpoint, or our shards with `reference`
    to verify against) opened, written to OUT and, unless `verify` is off, judged with mlx-lm.
    `progress_for(total_bytes)` may return a context manager yielding the byte-progress callback."""
    import contextlib

    from ..convert.sources import HFSource, open_source, source_side_files

    recipe.check()
    source = open_source(Path(src))
    try:
        check = None
        if verify:
            ref = reference or (src if isinstance(source, HFSource) else None)
            if ref is None:
                raise UserError(
                    f"{src} is a shard directory: give --reference HF_CHECKPOINT (reference=) to verify, "
                    "or --no-verify (verify=False)"
                )
            check = verifier(Path(ref), recipe, source.config)
        start = time.perf_counter()
        bar = progress_for(planned_bytes(source, recipe)) if progress_for else contextlib.nullcontext(None)
        with bar as progress:
            record = export_mlx(
                source,
                source_side_files(source),
                out,
                recipe,
                force=force,
                verify=check,
                max_part=max_part,
                progress=progress,
            )
        record["seconds"] = time.perf_counter() - start
    finally:
        source.close()
    return record


def export_record(
    source: Source, out: Path, recipe: Recipe, planned: list[Planned], quant: dict[str, Any] | None, weights: list[str]
) -> dict[str, Any]:
    layout = layout_of(source.config)
    quantized = [p for p in planned if p.bits is not None]
    return {
        "kind": EXPORT_KIND,
        "schema_version": EXPORT_SCHEMA_VERSION,
        "source": str(source.path),
        "out": str(out),
        "model_type": layout.model_type,
        "mlx_lm_layout": layout.mlx_lm_version,
        "dtype": recipe.dtype.name if recipe.dtype else sorted({p.dtype.name for p in planned}),
        "quantization": quant,
        "mixed": recipe.mixed,
        "tensors": len(planned),
        "quantized_tensors": len(quantized),
        "bits_per_weight": bits_per_weight(planned),
        "files": weights,
        "bytes": sum(p.nbytes for p in planned),
        "known_differences": [vars(d) for d in layout.differences(source.config)],
    }


def bits_per_weight(planned: list[Planned]) -> float:
    """Stored bits over parameters (mlx-lm's compute_bits_per_weight counts the same way)."""
    params = sum(math.prod(p.shape) for p in planned)
    return 8 * sum(p.nbytes for p in planned) / params if params else 0.0


def verifier(reference: Path, recipe: Recipe, config: Any = None) -> Callable[[Path, list[Planned]], dict[str, Any]]:
    """The check that ends an export: mlx-lm runs OUT against the reference.  Refused before any
    writing when mlx-lm is not installed (it would otherwise fail after the whole export), or when
    the reference is not shaped like the source's `config`."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"export mlx: verifying needs {e.name or 'mlx-lm'} (pip install 'plamo2-tools[mlx]'), or pass --no-verify"
        ) from None
    from ..model.checkpoint import HFCheckpoint
    from ..shards.owned import ensure_readable_checkpoint

    ensure_readable_checkpoint(reference)
    with HFCheckpoint(reference) as ckpt:  # a wrong --reference is refused before the export, not after
        ckpt.check_inventory()
        if config is not None and hf_tensor_shapes(ckpt.config) != hf_tensor_shapes(config):
            raise UserError(f"--reference {reference} is not shaped like the model being exported")

    def run(path: Path, planned: list[Planned]) -> dict[str, Any]:
        from .verified import verify_export

        return verify_export("mlx", path, reference)

    return run
