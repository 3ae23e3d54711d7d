"""`plamo2-tools check FILE.gguf --source SRC`: an exported GGUF re-derived from the checkpoint it came
from, tensor by tensor and key by key (docs/export.md, "Checking an export").

The file is read with the `gguf` package's reader, the checkpoint with the `safetensors` library
(not the export's streaming reader), the value transforms run in PyTorch (not the export's numpy
path) and the storage types are made by the `gguf` package's quantizers: every tensor must be
byte-identical, quantized ones by quantizing the source again, except A = -exp(A_log), whose float32
exp no library rounds the same everywhere (one unit in the last place; docs/convert.md).  Which
tensor has which name and type is the family's GGUF table and llama.cpp's type rule
(`gguf_plan.py`), the definition both sides share, like the layout in the shard check.  The keys are
rebuilt as the export builds them and compared one by one (an edited RoPE base is a difference).
Tensors quantized by llama-quantize (k-quants, i-quants) have no numpy quantizer: they are counted
as not re-derived.  Memory: one tensor at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..check_report import SourceComparison
from ..errors import CheckpointError, UserError
from ..kinds import GGUF_CHECK_KIND, GGUF_CHECK_SCHEMA_VERSION
from ..model.checkpoint import HFCheckpoint
from .gguf_meta import OWN_KEY
from .gguf_plan import FILE_TYPES, Override, PlannedTensor, plan_tensors

_NUMPY_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
}


@dataclass
class GGUFCheckReport(SourceComparison):
    KIND, SCHEMA_VERSION = GGUF_CHECK_KIND, GGUF_CHECK_SCHEMA_VERSION
    keys: int = 0
    not_rederived: list[str] = field(default_factory=list)

    def extra(self) -> dict[str, Any]:
        return {"keys_compared": self.keys, "not_rederived": self.not_rederived}


def _recipe(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    field_ = reader.fields.get(OWN_KEY)
    if field_ is None:
        raise UserError(f"{path}: no {OWN_KEY} key: not a GGUF written by plamo2-tools export")
    try:
        recipe = json.loads(field_.contents())
    except (ValueError, TypeError):
        raise CheckpointError(f"{path}: {OWN_KEY} is not the JSON plamo2-tools writes") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("type"), str):
        raise CheckpointError(f"{path}: {OWN_KEY} is not the JSON plamo2-tools writes")
    return recipe


def _source_values(st: Any, t: PlannedTensor) -> np.ndarray:
    """The tensor's float32 values from the safetensors library and torch (the oracle's path)."""
    import torch

    from ..model.layout import apply_transforms

    x = st.get_tensor(t.source)
    if x.dtype not in (torch.float16, torch.float32):  # the converter's first step
        x = x.to(torch.float32)
    y = apply_transforms(x, t.transforms, x.dtype) if t.transforms else x
    return y.reshape(t.shape).to(torch.float32).numpy()


def _compare(t: PlannedTensor, got: np.ndarray, want: np.ndarray) -> str | None:
    if got.tobytes() == want.tobytes():
        return None
    if (
        t.transforms
        and any(tr.name == "neg_exp_f32" for tr in t.transforms)
        and t.qtype == gguf.GGMLQuantizationType.F32
    ):
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        if ulps.max() <= 1:
            return None
    a, b = np.frombuffer(got.tobytes(), np.uint8), np.frombuffer(want.tobytes(), np.uint8)
    first = int(np.argmax(a[: min(a.size, b.size)] != b[: min(a.size, b.size)])) if a.size == b.size else 0
    return f"{t.name}: bytes differ from the source's {t.source} (first at byte {first})"


def check_gguf(path: Path, source: Path) -> GGUFCheckReport:
    """Every tensor and key of `path` against `source` (module doc)."""
    import safetensors

    report = GGUFCheckReport(path, source)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({str(e)[:120]})") from None
    recipe = _recipe(reader, path)
    with HFCheckpoint(source) as ckpt:
        ckpt.check_inventory()
        arch = ckpt.family.gguf
        if arch is None:
            raise UserError(f"{source}: {ckpt.family.description} has no llama.cpp architecture")
        base = recipe["type"] if recipe["type"] in FILE_TYPES else None
        overrides = [Override(*spec.split("=", 1)) for spec in recipe.get("tensor_types") or []]
        planned = {t.name: t for t in plan_tensors(ckpt, arch, FILE_TYPES[base or "f32"][0], overrides)}
        got = {t.name: t for t in reader.tensors}
        for name in sorted(set(planned) ^ set(got)):
            report.problems.append(f"{name}: {'missing from the file' if name in planned else 'not in the model'}")
        files = {ckpt.file_of(t.source).path for t in planned.values()}
        handles = {p: safetensors.safe_open(str(p), framework="pt") for p in files}
        for name in [n for n in got if n in planned]:
            t, tensor = planned[name], got[name]
            if base is None and tensor.tensor_type not in _NUMPY_TYPES:
                report.not_rederived.append(name)
                continue
            want_type = t.qtype if base is not None else tensor.tensor_type
            if tensor.tensor_type != want_type or tuple(int(d) for d in reversed(tensor.shape)) != t.shape:
                report.problems.append(
                    f"{name}: {tensor.tensor_type.name} {list(reversed(tensor.shape))}, expected "
                    f"{want_type.name} {list(t.shape)}"
                )
                continue
            values = _source_values(handles[ckpt.file_of(t.source).path], t)
            want = gguf.quants.quantize(values, want_type)
            problem = _compare(
                t, np.ascontiguousarray(tensor.data).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
            )
            report.tensors += 1
            if problem:
                report.problems.append(problem)
    report.problems += _check_keys(reader, path, source, recipe, report)
    return report


def _check_keys(
    reader: gguf.GGUFReader, path: Path, source: Path, recipe: dict[str, Any], report: GGUFCheckReport
) -> list[str]:
    """The keys as the export builds them now, against the file's (the count and tensor index
    fields of the header itself are not keys)."""
    from .gguf import expected_keys, plain

    want = expected_keys(source, recipe)
    problems = []
    have = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if recipe["type"] not in FILE_TYPES:  # llama-quantize writes these two itself
        for key in ("general.file_type", "general.quantization_version"):
            want.pop(key, None), have.pop(key, None)
    for key in sorted(set(want) ^ set(have)):
        problems.append(f"key {key}: {'missing from the file' if key in want else 'not written by this export'}")
    for key in [k for k in want if k in have]:
        report.keys += 1
        value, types = want[key]
        f = have[key]
        if key == OWN_KEY:
            continue
        got = plain(f.contents())
        if [int(t) for t in f.types] != types or got != value:
            problems.append(f"key {key}: {str(got)[:60]} in the file, {str(value)[:60]} from the source")
    return problems
