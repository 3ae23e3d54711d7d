"""MLX's affine quantization in numpy, bit for bit what `mlx.core.quantize` returns (mode "affine"),
so an export needs no MLX installed (docs/export.md, "MLX").

The rule, from MLX's CPU kernel (`mlx/backend/cpu/quantized.cpp`, `quantize`), per group of
`group_size` consecutive values along the last axis, all arithmetic in float32:

    w_max, w_min  = the group's extremes (as float32)
    scale         = max((w_max - w_min) / (2**bits - 1), 1e-7), negated unless |w_min| > |w_max|
    edge          = w_min if |w_min| > |w_max| else w_max
    q0            = rint(edge / scale);  if q0 != 0: scale = edge / q0, bias = edge  (else bias = 0)
    q             = clip(rint((w - bias) / scale), 0, 2**bits - 1)

so the value of largest magnitude is represented exactly; codes are packed little end first,
32 / bits per uint32 (bits 2, 4, 8: the widths the packing below handles); scale and bias are
rounded once to the weight's dtype (nearest, ties to even).  Dequantized: w ≈ scale * q + bias.
`tests/export/test_mlx_quant.py` checks all of it against `mlx.core.quantize` on random inputs.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..errors import UserError
from ..numerics import from_float32, to_float32

BITS = (2, 4, 8)  # power-of-two widths: 32 / bits codes per uint32
GROUP_SIZES = (32, 64, 128)  # what MLX's kernels accept
EPS = np.float32(1e-7)


def check_params(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise UserError(f"--bits {bits}: MLX affine quantization here takes {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise UserError(f"--group-size {group_size}: MLX takes {', '.join(map(str, GROUP_SIZES))}")


def quantized_shapes(shape: tuple[int, ...], bits: int, group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(packed weight shape, scales/biases shape) of a weight of `shape` (groups on the last axis)."""
    *lead, cols = shape
    return (*lead, cols * bits // 32), (*lead, cols // group_size)


def quantize(w: np.ndarray, dtype: DType, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize values of `dtype` (held as its storage, numerics.py) along the last axis.

    Returns (packed uint32, scales, biases), the latter two held as `dtype`'s storage."""
    *lead, cols = w.shape
    if cols % group_size:
        raise ValueError(f"last axis {cols} is not a multiple of the group size {group_size}")
    g = to_float32(np.ascontiguousarray(w), dtype).reshape(-1, cols // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = g.max(axis=-1), g.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, EPS)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)  # scale is never 0 (>= 1e-7 in magnitude)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale)
    bias = np.where(nonzero, edge, np.float32(0))
    q = g - bias[..., None]  # in place from here on: the chunk's one float32 temporary
    q /= scale[..., None]
    np.rint(q, out=q)
    np.minimum(np.maximum(q, 0, out=q), n_bins, out=q)
    per = 32 // bits
    codes = q.astype(np.uint32).reshape(-1, cols * bits // 32, per)
    packed = codes[..., 0].copy()
    for k in range(1, per):  # per-lane shifts: faster than a reduce over an axis of 4 to 16
        packed |= codes[..., k] << np.uint32(k * bits)
    wshape, sshape = quantized_shapes((*lead, cols), bits, group_size)
    return (
        packed.reshape(wshape),
        from_float32(scale.astype(np.float32), dtype).reshape(sshape),
        from_float32(bias.astype(np.float32), dtype).reshape(sshape),
    )


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype: DType, bits: int) -> np.ndarray:
    """float32 values scale * q + bias (what a quantized matmul multiplies by), for checks."""
    *lead, words = packed.shape
    shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
    codes = ((packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(*lead, words * 32 // bits)
    group = codes.shape[-1] // scales.shape[-1]
    s = np.repeat(to_float32(scales, dtype), group, axis=-1)
    b = np.repeat(to_float32(biases, dtype), group, axis=-1)
    return codes.astype(np.float32) * s + b
