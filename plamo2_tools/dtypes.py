"""Dtype names, written once: the names users type and manifests record (`float32`, `bfloat16`,
...) and safetensors' header codes (`F32`, `BF16`, ...), both mapped to `torch.dtype`."""

from __future__ import annotations

import torch

from .errors import CheckpointError, UserError

# The floating dtypes a checkpoint, a shard or a runtime may hold (torch's own names).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# safetensors header codes (the format's spec) -> torch dtype.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the name manifests and configs use)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, what: str = "manifest") -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; a name torch does not know is a corrupt file."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in {what}")
    return dtype


def float_dtype(name: str, option: str = "--dtype") -> torch.dtype:
    """A user-chosen floating dtype; anything else is one line naming the choices."""
    if name not in FLOAT_DTYPES:
        raise UserError(f"unknown {option} {name!r}; choose one of: {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
