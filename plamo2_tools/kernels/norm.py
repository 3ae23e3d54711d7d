"""Triton RMSNorm: row norm with fused residual add, and the per-head (q/k) variant.

One kernel serves both: logical row r of an (R, D) problem lives at
``(r // heads) * stride_outer + (r % heads) * stride_inner`` and uses weight row ``r % heads``
(heads = 1 for the plain norm), so strided q/k views of a fused qkv need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    y_ptr,
    r_ptr,
    w_ptr,
    R,
    D,
    heads,
    sx_outer,
    sx_inner,
    s_res,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    x_off = ((rows // heads) * sx_outer + (rows % heads) * sx_inner)[:, None] + cols[None, :]
    out_off = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + rows[:, None] * s_res + cols[None, :], mask=mask, other=0.0)
        r = (x + res.to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + out_off, r, mask=mask)
        x = r.to(tl.float32)  # normalise the stored (rounded) stream, like the torch path
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + (rows % heads)[:, None] * D + cols[None, :], mask=mask, other=0.0)
    y = x * rstd[:, None] * w.to(tl.float32)
    tl.store(y_ptr + out_off, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x, weight, eps, residual, heads, s_outer, s_inner, rows, D):
    y = torch.empty(rows, D, device=x.device, dtype=x.dtype)
    r = torch.empty(rows, D, device=x.device, dtype=residual.dtype) if residual is not None else y
    block_d = triton.next_power_of_2(D)
    block_r = min(triton.next_power_of_2(max(rows, 1)), max(1, 4096 // block_d))
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x,
        residual if residual is not None else x,
        y,
        r,
        weight,
        rows,
        D,
        heads,
        s_outer,
        s_inner,
        residual.stride(0) if residual is not None else 0,
        eps,
        HAS_RES=residual is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=8 if block_r * block_d >= 8192 else 4,
    )
    return y, r


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    M, D = x.shape
    y, r = _launch(x, weight.contiguous(), eps, residual, 1, x.stride(0), 0, M, D)
    return y, (r if residual is not None else x)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, H, d = x.shape
    y, _ = _launch(x, weight.contiguous(), eps, None, H, x.stride(0), x.stride(1), M * H, d)
    return y.view(M, H, d)
