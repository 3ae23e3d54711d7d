"""Which tensors a GGUF export writes, named, shaped and typed as llama.cpp's converter does it
(docs/export.md, "GGUF"), and how one tensor's bytes are made from the checkpoint.

llama.cpp's rule (`conversion/base.py:ModelBase.prepare_tensors`): every source tensor is taken
in the checkpoint's order (files sorted, each file's header order) and widened to float32, the
family's value transforms run in float32, and then the tensor is stored as F32 when it is 1-D,
a norm (`*_norm.weight`), one the architecture keeps in F32 (PLaMo 2's `ssm_conv1d`) or not a
`.weight`; otherwise in the file's type, falling back to F16 when its rows do not split into the
type's blocks.  Per-tensor overrides (`--tensor-type PATTERN=TYPE`, llama-quantize's option) apply
to the tensors that would take the file's type.  The quantizers are the `gguf` package's
(bit-exact with ggml's reference rows), so a chunk of rows quantizes exactly as the whole tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType, quant_shape_to_byte_shape
from gguf.quants import QuantError, quantize

from .. import numerics
from ..dtypes import FLOAT16, FLOAT32, DType
from ..errors import UserError
from ..model.checkpoint import HFCheckpoint
from ..model.gguf import BLOCK_PREFIX, GGUFArch, value_transforms
from ..model.layout import Transform, apply_values, kind_of, layer_of

Q = GGMLQuantizationType
# --type values written here (numpy quantizers of the `gguf` package) and their file types.
FILE_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
# Types a --tensor-type override may name.
TENSOR_TYPES: dict[str, GGMLQuantizationType] = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
}
# The types llama-quantize makes (k-quants and i-quants): exported through it (export/gguf.py).
LLAMA_QUANTIZE_TYPES = (
    "q2_k",
    "q2_k_s",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q4_k_m",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
    "iq2_xxs",
    "iq2_xs",
    "iq2_s",
    "iq2_m",
    "iq3_xxs",
    "iq3_xs",
    "iq3_s",
    "iq3_m",
    "iq4_nl",
    "iq4_xs",
    "iq1_s",
    "iq1_m",
    "q4_1",
    "q5_0",
    "q5_1",
    "tq1_0",
    "tq2_0",
    "mxfp4_moe",
)
CHUNK_BYTES = 64 * 2**20  # float32 bytes of source rows transformed at a time: the memory bound


@dataclass(frozen=True)
class Override:
    pattern: str  # a regular expression searched in the GGUF tensor name (llama-quantize's rule)
    type: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def parse_overrides(specs: list[str], recipes: dict[str, dict[str, str]], recipe: str | None) -> list[Override]:
    """`PATTERN=TYPE` strings (and a named recipe, first) as overrides, each checked; one line each."""
    out: list[Override] = []
    if recipe is not None:
        if recipe not in recipes:
            known = ", ".join(recipes) or "none for this model"
            raise UserError(f"--recipe {recipe!r}: not a recipe of this model ({known})")
        out += [Override(p, t) for p, t in recipes[recipe].items()]
    for spec in specs:
        pattern, sep, kind = spec.partition("=")
        if not sep or not pattern or not kind:
            raise UserError(f"--tensor-type {spec!r}: expected PATTERN=TYPE, e.g. ssm_out=f16")
        kind = kind.lower()
        if kind not in TENSOR_TYPES:
            raise UserError(f"--tensor-type {spec!r}: type {kind!r} is not one of {', '.join(TENSOR_TYPES)}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise UserError(f"--tensor-type {spec!r}: bad pattern ({e})") from None
        out.append(Override(pattern, kind))
    return out


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: where it comes from and how it is stored."""

    name: str  # GGUF name
    source: str  # HF tensor name
    source_dtype: DType
    source_shape: tuple[int, ...]
    shape: tuple[int, ...]  # numpy (row-major) shape in the file (GGUF lists it reversed)
    qtype: GGMLQuantizationType
    transforms: tuple[Transform, ...]
    override: str | None = None  # the --tensor-type pattern that chose qtype
    fallback: bool = False  # the rows do not split into the type's blocks: F16 instead (llama.cpp's rule)

    @property
    def nbytes(self) -> int:
        return math.prod(quant_shape_to_byte_shape(self.shape, self.qtype)) if self.shape else 4


def gguf_name(arch: GGUFArch, family_prefix: str, source: str) -> str:
    index, rest = layer_of(source, family_prefix)
    return (BLOCK_PREFIX.format(index) if index is not None else "") + arch.by_hf()[rest].name


def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _chosen(
    arch: GGUFArch, name: str, shape: tuple[int, ...], file_type: GGMLQuantizationType, overrides: list[Override]
) -> tuple[GGMLQuantizationType, str | None]:
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    if len(shape) <= 1 or name.endswith("_norm.weight") or base in arch.keep_f32 or not name.endswith(".weight"):
        return Q.F32, None
    for o in overrides:
        if o.matches(name):
            return TENSOR_TYPES[o.type], o.pattern
    return file_type, None


def plan_tensors(
    ckpt: HFCheckpoint, arch: GGUFArch, file_type: GGMLQuantizationType, overrides: list[Override]
) -> list[PlannedTensor]:
    """Every tensor of the file, in the converter's order (the checkpoint's)."""
    family, cfg = ckpt.family, ckpt.config
    names = arch.by_hf()
    out = []
    for source, info in ckpt.tensors.items():
        kind = kind_of(family, source)
        entry = names[kind.hf]  # type: ignore[index]
        name = gguf_name(arch, family.layer_prefix, source)
        shape = squeezed(info.shape) if entry.squeeze else info.shape
        qtype, pattern = _chosen(arch, name, shape, file_type, overrides)
        fallback = False
        if qtype not in (Q.F32, Q.F16, Q.BF16) and shape[-1] % _block_size(qtype):
            qtype, fallback = Q.F16, True
        out.append(
            PlannedTensor(
                name, source, info.dtype, info.shape, shape, qtype, value_transforms(kind, cfg), pattern, fallback
            )
        )
    return out


def _block_size(qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][0]


def row_chunks(t: PlannedTensor) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of the source whose float32 values fit CHUNK_BYTES (one range for a
    tensor whose squeeze moves its first dimension)."""
    rows = t.source_shape[0] if t.source_shape else 1
    if not t.shape or t.shape[0] != rows:
        yield 0, rows
        return
    per_row = 4 * max(1, math.prod(t.source_shape[1:]))
    step = max(1, CHUNK_BYTES // per_row)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def tensor_bytes(ckpt: HFCheckpoint, t: PlannedTensor, start: int, stop: int) -> np.ndarray:
    """Source rows [start, stop) transformed and stored as `t.qtype`: the bytes the file holds."""
    x = ckpt.read_array(t.source, start, stop)
    if t.transforms and t.source_dtype == FLOAT16:
        # The converter keeps a float16 tensor float16 through its transforms: torch casts the
        # Python offset to half, adds in float32 and rounds the sum to half (exp: float32, rounded).
        half = tuple(
            Transform(tr.name, float(np.float16(tr.arg))) if tr.name == "add_offset" else tr for tr in t.transforms
        )
        values = apply_values(x, t.source_dtype, half, FLOAT32)
        values = numerics.to_float32(numerics.from_float32(values, FLOAT16), FLOAT16)
    else:
        values = apply_values(x, t.source_dtype, t.transforms, FLOAT32)
    if t.shape:
        values = values.reshape((stop - start, *t.shape[1:]) if t.shape[0] == t.source_shape[0] else t.shape)
    try:
        data = quantize(np.ascontiguousarray(values, np.float32), t.qtype)
    except QuantError as e:  # plan_tensors already fell back for every such shape
        raise AssertionError(f"{t.name}: {e}") from None
    return np.ascontiguousarray(data)
