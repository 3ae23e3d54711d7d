"""Triton SwiGLU: (M, 2F) -> (M, F) = silu(gate) * up, fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels.triton_math import silu


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, F, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * sx + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu(gate) * up
    tl.store(y_ptr + row * F + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, F = x.shape[0], x.shape[1] // 2
    y = torch.empty(M, F, device=x.device, dtype=x.dtype)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(M, triton.cdiv(F, block))](x, y, F, x.stride(0), BLOCK=block, num_warps=4)
    return y
