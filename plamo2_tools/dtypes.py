"""Dtype names, written once: the names users type and manifests record (`float32`, `bfloat16`,
...) and safetensors' header codes (`F32`, `BF16`, ...), both mapped to our own `DType`.

`DType` knows no framework: commands that only move bytes (convert, check, merge, inspect) never
import PyTorch (docs/convert.md, "The numeric path").  A `DType` equals the torch dtype of the same
name, so code holding either compares right; `DType.torch` is the torch dtype itself, imported
only by the commands that run the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, UserError

if TYPE_CHECKING:  # numpy on first use: a refusal that reads a manifest needs none (issue 33)
    import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    name: str  # torch's and the manifests' name: "bfloat16"
    code: str  # safetensors' header code: "BF16"
    itemsize: int
    kind: str  # "float" | "int" | "uint" | "bool"
    # How our numpy code holds the values: the IEEE types numpy has as themselves, the others
    # (bfloat16, float8) as unsigned integers of their bits (model/numerics.py does their math).
    storage: str

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "float"

    @property
    def np(self) -> np.dtype:
        import numpy as np

        return np.dtype(self.storage)

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch: only for the commands that run the model)."""
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        if type(other).__name__ == "dtype" and type(other).__module__ == "torch":  # torch.dtype
            return str(other) == "torch." + self.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


FLOAT64 = DType("float64", "F64", 8, "float", "float64")
FLOAT32 = DType("float32", "F32", 4, "float", "float32")
FLOAT16 = DType("float16", "F16", 2, "float", "float16")
BFLOAT16 = DType("bfloat16", "BF16", 2, "float", "uint16")
FLOAT8_E4M3 = DType("float8_e4m3fn", "F8_E4M3", 1, "float", "uint8")
FLOAT8_E5M2 = DType("float8_e5m2", "F8_E5M2", 1, "float", "uint8")
INT64 = DType("int64", "I64", 8, "int", "int64")
INT32 = DType("int32", "I32", 4, "int", "int32")
INT16 = DType("int16", "I16", 2, "int", "int16")
INT8 = DType("int8", "I8", 1, "int", "int8")
UINT8 = DType("uint8", "U8", 1, "uint", "uint8")
UINT32 = DType("uint32", "U32", 4, "uint", "uint32")  # MLX's packed quantized weights
BOOL = DType("bool", "BOOL", 1, "bool", "bool")
ALL: tuple[DType, ...] = (
    FLOAT64,
    FLOAT32,
    FLOAT16,
    BFLOAT16,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    INT64,
    INT32,
    INT16,
    INT8,
    UINT8,
    UINT32,
    BOOL,
)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}

# The floating dtypes a checkpoint, a shard or a runtime may hold (torch's own names).
FLOAT_DTYPES: dict[str, DType] = {d.name: d for d in (FLOAT32, BFLOAT16, FLOAT16)}

# safetensors header codes (the format's spec) -> dtype.
SAFETENSORS_DTYPES: dict[str, DType] = {d.code: d for d in ALL}
SAFETENSORS_NAMES: dict[DType, str] = {d: d.code for d in ALL}


def dtype_name(dtype: Any) -> str:
    """bfloat16 (ours or torch's) -> 'bfloat16' (the name manifests and configs use)."""
    return str(dtype).removeprefix("torch.")


def as_dtype(dtype: Any) -> DType:
    """Ours, from ours or a torch dtype (the runtime and the tests hand either)."""
    return dtype if isinstance(dtype, DType) else BY_NAME[dtype_name(dtype)]


def parse_dtype(name: str, what: str = "manifest") -> DType:
    """'bfloat16' -> BFLOAT16; a name we do not know is a corrupt file."""
    if name not in BY_NAME:
        raise CheckpointError(f"unknown dtype {name!r} in {what}")
    return BY_NAME[name]


def float_dtype(name: str, option: str = "--dtype") -> DType:
    """A user-chosen floating dtype; anything else is one line naming the choices."""
    if name not in FLOAT_DTYPES:
        raise UserError(f"unknown {option} {name!r}; choose one of: {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


def element_size(dtype: Any) -> int:
    return as_dtype(dtype).itemsize
