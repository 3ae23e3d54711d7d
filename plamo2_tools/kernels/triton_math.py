"""Small Triton device functions shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(v):
    """log(1 + exp(v)) accurate for tiny results (delta ~ 1e-3 loses 1e-4 with log(1 + e)).

    Written as max(v, 0) + log1p(exp(-|v|)), with log1p by Kahan's trick: Triton has no log1p.
    """
    e = tl.exp(-tl.abs(v))
    w = 1.0 + e
    return tl.maximum(v, 0.0) + tl.where(w == 1.0, e, tl.log(w) * (e / (w - 1.0)))


@triton.jit
def silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """tl.dot in the operands' dtype, or exact fp32 when F32 (fp32 inputs, and bf16 under the
    interpreter, which multiplies bf16 bit patterns)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)
