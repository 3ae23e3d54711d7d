"""`plamo2-tools check OUT --source SRC` for an `export mlx` or `export fp8` directory: every tensor re-derived
from the checkpoint it was exported from and compared (docs/export.md, "Checking an export").

Per format, two halves:

* **re-derived, byte for byte**: the export's own plan (`export/mlx.py:plan`, `export/fp8.py:plan_export`) run
  again on the source, tensors the export copies or casts compared with the cast source bytes, quantized ones
  quantized again with our quantizer (`mlx_quant.quantize`, `fp8_format.quantize_rows`) and compared byte for
  byte (codes, scales, biases); every planned tensor present, nothing else in any `*.safetensors` file, and the
  config exactly what the export writes for that source (a RoPE base edited in `config.json` is a difference);
* **independently** (not the code under test): MLX's own `mlx.core.dequantize` of every quantized MLX weight
  (the [mlx] extra), and compressed-tensors' own `dequantize` of every FP8 weight (torch), each within one
  quantization step of the source values.  Skipped, and said so, when that package is missing.

Torch-free for the byte comparison (numpy, like the exports); memory is one tensor at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..check_report import SourceComparison
from ..convert.sources import Source, open_source
from ..dtypes import DType, float_dtype
from ..errors import CheckpointError, UserError
from ..jsonio import CONFIG_BYTES, read_object
from ..kinds import CHECK_EXPORT_KIND, CHECK_EXPORT_SCHEMA_VERSION
from ..numerics import to_float32
from ..safetensors_io import read_array, read_header, tensor_bytes
from .side import SIDE_JSON, export_format


@dataclass
class ExportCheckReport(SourceComparison):
    KIND, SCHEMA_VERSION = CHECK_EXPORT_KIND, CHECK_EXPORT_SCHEMA_VERSION
    format: str = ""
    independent: str = ""  # what was checked by the other package, or why not

    def extra(self) -> dict[str, Any]:
        return {"format": self.format, "independent": self.independent}


class ExportFiles:
    """Every tensor of every `*.safetensors` file in the directory (not only those an index names: an extra
    file is extra tensors), read with our bounded reader."""

    def __init__(self, out: Path) -> None:
        self.where: dict[str, tuple[Path, Any]] = {}
        self.duplicates: list[str] = []
        self._fds: dict[Path, int] = {}
        for file in sorted(out.glob("*.safetensors")):
            for name, info in read_header(file).tensors.items():
                if name in self.where:
                    self.duplicates.append(f"{name} in both {self.where[name][0].name} and {file.name}")
                self.where[name] = (file, info)

    def array(self, name: str) -> np.ndarray:
        file, info = self.where[name]
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return read_array(self._fds[file], info, 0, info.rows, file).reshape(info.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _compare(files: ExportFiles, name: str, dtype: DType, shape: tuple[int, ...], want: np.ndarray) -> str | None:
    """None when the exported tensor `name` has this dtype, shape and exactly these bytes; else why not."""
    _, info = files.where[name]
    if info.dtype != dtype or tuple(info.shape) != tuple(shape):
        return f"{name}: {info.dtype.name} {list(info.shape)} where the source gives {dtype.name} {list(shape)}"
    got, exp = tensor_bytes(files.array(name)), tensor_bytes(want)
    if got != exp:
        at = next(i for i, (a, b) in enumerate(zip(got, exp, strict=True)) if a != b)
        return f"{name}: differs from the source re-derived (first differing byte at {at} of {len(exp)})"
    return None


def _inventory(files: ExportFiles, expected: list[str]) -> list[str]:
    want = set(expected)
    problems = [f"missing tensor {n}" for n in expected if n not in files.where]
    problems += [f"unexpected tensor {n}" for n in files.where if n not in want]
    return problems + [f"duplicate tensor {d}" for d in files.duplicates]


def _first_config_difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    for key in sorted(set(got) | set(want)):
        if key not in got:
            return f"config.json lacks {key!r}"
        if key not in want:
            return f"config.json has {key!r}, which the export does not write"
        if got[key] != want[key]:
            return f"config.json {key!r} is {got[key]!r}, the export writes {want[key]!r}"
    return None


# ---- MLX -------------------------------------------------------------------------------------------------
def _mlx_recipe(config: dict[str, Any], record: dict[str, Any]) -> Any:
    """The Recipe an MLX directory was written with, from its config's `quantization` (per-module entries as
    overrides: the plan then lists exactly those) and the record's dtype."""
    from .mlx import Recipe

    dtype = float_dtype(record["dtype"]) if isinstance(record.get("dtype"), str) else None
    quant = config.get("quantization")
    if quant is None:
        return Recipe(dtype=dtype)
    if (
        not isinstance(quant, dict)
        or not isinstance(quant.get("bits"), int)
        or not isinstance(quant.get("group_size"), int)
    ):
        raise CheckpointError("config.json: 'quantization' is not what export mlx writes")
    overrides: dict[str, int | None] = {}
    for module, setting in quant.items():
        if module in ("bits", "group_size", "mode"):
            continue
        if setting is False:
            overrides[module] = None
        elif isinstance(setting, dict) and isinstance(setting.get("bits"), int):
            overrides[module] = setting["bits"]
        else:
            raise CheckpointError(f"config.json: quantization of {module!r} is not what export mlx writes")
    recipe = Recipe(bits=quant["bits"], group_size=quant["group_size"], dtype=dtype, overrides=overrides)
    try:
        recipe.check()
    except UserError as e:
        raise CheckpointError(f"config.json: {e}") from None
    return recipe


def check_mlx(out: Path, source: Source, report: ExportCheckReport) -> None:
    from .mlx import convert_rows, mlx_config, plan

    config = read_object(out / "config.json", CONFIG_BYTES, "a config")
    record = read_object(out / SIDE_JSON, CONFIG_BYTES, "an export record")
    recipe = _mlx_recipe(config, record)
    planned, quant = plan(source, recipe)
    diff = _first_config_difference(config, mlx_config(source, quant, recipe.dtype))
    if diff:
        report.problems.append(diff)
    files = ExportFiles(out)
    try:
        report.problems += _inventory(files, [o[0] for p in planned for o in p.outputs()])
        for p in planned:
            outputs = p.outputs()
            if any(o[0] not in files.where for o in outputs):
                continue
            arrays = convert_rows(p, source.read_rows(p.name, 0, p.rows))
            for (name, dtype, shape), want in zip(outputs, arrays, strict=True):
                report.tensors += 1
                problem = _compare(files, name, dtype, shape, want.reshape(shape))
                if problem:
                    report.problems.append(problem)
        report.independent = _mlx_independent(out, source, planned, files, report.problems)
    finally:
        files.close()


def _mlx_independent(out: Path, source: Source, planned: list[Any], files: ExportFiles, problems: list[str]) -> str:
    """MLX's own dequantization of every quantized weight (read by MLX's own loader) within one quantization
    step of the source values: |w - (scale q + bias)| <= |scale| plus the rounding of scale and bias."""
    try:
        import mlx.core as mx
    except ImportError:
        return "skipped: mlx is not installed (pip install 'plamo2-tools[mlx]')"
    from ..numerics import cast

    loaded: dict[str, Any] = {}
    for file in sorted(out.glob("*.safetensors")):
        loaded.update(mx.load(str(file)))
    count = 0
    for p in planned:
        names = [o[0] for o in p.outputs()]
        if p.bits is None or any(n not in loaded for n in names):
            continue
        w_q, scales, biases = (loaded[n] for n in names)
        deq = mx.dequantize(w_q, scales, biases, group_size=p.group_size, bits=p.bits).astype(mx.float32)
        got = np.array(deq).reshape(-1, p.group_size)
        src = cast(source.read_rows(p.name, 0, p.rows), p.source_dtype, p.dtype)
        want = to_float32(src, p.dtype).reshape(-1, p.group_size)
        s = np.abs(np.array(scales.astype(mx.float32))).reshape(-1, 1)
        b = np.abs(np.array(biases.astype(mx.float32))).reshape(-1, 1)
        eps = float(
            2.0
            ** -(np.finfo(np.float32).nmant if p.dtype.name == "float32" else 7 if p.dtype.name == "bfloat16" else 10)
        )
        tol = s + eps * (b + s * ((1 << p.bits) - 1) + np.abs(want).max(axis=1, keepdims=True))
        bad = np.argwhere(~(np.abs(got - want) <= tol))
        count += 1
        if bad.size:
            g, i = (int(x) for x in bad[0])
            problems.append(
                f"{p.module}: mlx.core.dequantize gives {got[g, i]:.6g} where the source has "
                f"{want[g, i]:.6g} (group {g}, more than one step {float(s[g, 0]):.3g})"
            )
    return f"mlx.core.dequantize (mlx {mx.__version__}): {count} quantized weight(s) within one step of the source"


# ---- FP8 -------------------------------------------------------------------------------------------------
def check_fp8(out: Path, source: Source, report: ExportCheckReport) -> None:
    from .fp8 import LAST, plan_export
    from .fp8_format import quantization_config, quantize_rows

    config = read_object(out / LAST, CONFIG_BYTES, "a config")
    plan = plan_export(source)
    src_config = read_object(Path(source.path) / LAST, CONFIG_BYTES, "a config")
    diff = _first_config_difference(config, {**src_config, "quantization_config": quantization_config(plan.ignore)})
    if diff:
        report.problems.append(diff)
    files = ExportFiles(out)
    try:
        report.problems += _inventory(files, [t.name for t in plan.tensors])
        by_source: dict[str, list[Any]] = {}
        for t in plan.tensors:
            by_source.setdefault(t.source, []).append(t)
        for name, outs in by_source.items():
            if any(t.name not in files.where for t in outs):
                continue
            st = source.tensors[name]
            rows = source.read_rows(name, 0, st.rows).reshape(st.shape)
            values = {"copy": rows}
            if outs[0].role != "copy":
                values["fp8"], values["scale"] = quantize_rows(rows, st.dtype)
            for t in outs:
                report.tensors += 1
                problem = _compare(files, t.name, t.dtype, t.shape, values[t.role])
                if problem:
                    report.problems.append(problem)
        report.independent = _fp8_independent(out, source, plan.quantized, files, report.problems)
    finally:
        files.close()


def _fp8_independent(out: Path, source: Source, quantized: list[str], files: ExportFiles, problems: list[str]) -> str:
    """compressed-tensors' own `dequantize` of every FP8 weight (read by the safetensors library) within one
    e4m3 step of the source: |w - deq| <= |w| (1/8 + 2^-7) + scale 2^-9 (3 mantissa bits, the source dtype's
    rounding of w / scale, the subnormal step)."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.quantization.lifecycle.forward import dequantize
        from safetensors import safe_open
    except ImportError as e:
        return f"skipped: {e.name or 'compressed-tensors'} is not installed"
    from ..numerics import to_torch

    # The weights' arguments as compressed-tensors itself parses the export's config (strategy, type, bits).
    qc = QuantizationConfig.model_validate(read_object(out / "config.json", CONFIG_BYTES)["quantization_config"])
    args = next(iter(qc.config_groups.values())).weights

    count = 0
    for name in quantized:
        scale_name = name.removesuffix(".weight") + ".weight_scale"
        if name not in files.where or scale_name not in files.where:
            continue
        with safe_open(str(files.where[name][0]), "pt") as f:
            q = f.get_tensor(name)
        with safe_open(str(files.where[scale_name][0]), "pt") as f:
            scale = f.get_tensor(scale_name)
        deq = dequantize(q, scale, args=args, dtype=scale.dtype).double()
        st = source.tensors[name]
        w = to_torch(source.read_rows(name, 0, st.rows), st.dtype).reshape(st.shape).double()
        tol = w.abs() * (1 / 8 + 2**-7) + scale.double().abs() * 2**-9
        bad = ~((deq - w).abs() <= tol)
        count += 1
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            problems.append(
                f"{name}: compressed-tensors dequantizes row {r} column {c} to {float(deq[r, c]):.6g} "
                f"where the source has {float(w[r, c]):.6g} (more than one e4m3 step)"
            )
    import compressed_tensors

    return (
        f"compressed-tensors {compressed_tensors.__version__} dequantize: {count} FP8 weight(s) within one "
        "step of the source"
    )


def check_export(out: str | Path, source: str | Path) -> ExportCheckReport:
    """Check an `export mlx` / `export fp8` directory against the checkpoint it was exported from."""
    out, source_path = Path(out), Path(source)
    fmt = export_format(out)
    if fmt is None:
        raise UserError(f"{out}: not a directory written by export mlx or export fp8 (no {SIDE_JSON})")
    from ..shards.owned import ensure_readable_checkpoint

    ensure_readable_checkpoint(out)  # one of ours still being written, or left unfinished: refused in one line
    src = open_source(source_path)
    report = ExportCheckReport(out, source_path, format=fmt)
    try:
        (check_mlx if fmt == "mlx" else check_fp8)(out, src, report)
    finally:
        src.close()
    return report


__all__ = ["ExportCheckReport", "check_export", "check_fp8", "check_mlx", "export_format"]
