"""Triton Mamba2 decode step: the SSM state is read once and written once, in place.

    delta = softplus(dt + dt_bias);  S = exp(delta A) S + delta x (outer) B
    y = S . C + D x;  y *= silu(z)

Pure bandwidth (~0.6 FLOP/B with an fp32 state), so each program streams a (BLOCK_P, N) slab of
one head's state; there is no autotuning because the kernel updates its input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels.triton_math import silu, softplus


@triton.jit
def _state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    bias_ptr,
    y_ptr,
    H,
    P,
    N,
    ss_b,
    ss_h,
    ss_p,
    sx_b,
    sx_h,
    sdt_b,
    sB_b,
    sC_b,
    sz_b,
    sz_h,
    HAS_Z: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H  # int64: a large state pool passes 2**31 elements
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    v = tl.load(dt_ptr + b * sdt_b + h).to(tl.float32) + tl.load(bias_ptr + h).to(tl.float32)
    delta = softplus(v)
    decay = tl.exp(delta * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * sx_b + h * sx_h + p, mask=p_ok, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b * sB_b + n, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * sC_b + n, mask=n_ok, other=0.0).to(tl.float32)
    s_ptrs = state_ptr + b * ss_b + h * ss_h + p[:, None] * ss_p + n[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    s = s * decay + (delta * x)[:, None] * Bv[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(s * Cv[None, :], axis=1) + tl.load(D_ptr + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b * sz_b + h * sz_h + p, mask=p_ok, other=0.0).to(tl.float32)
        y *= silu(z)
    tl.store(y_ptr + (b * H + h) * P + p, y.to(y_ptr.dtype.element_ty), mask=p_ok)


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor,
    block_p: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """See ``Ops.ssd_state_update``; ``block_p`` / ``num_warps`` override the tile heuristic."""
    Bsz, H, P, N = state.shape
    A, D, dt_bias = A.contiguous(), D.contiguous(), dt_bias.contiguous()
    assert state.stride(-1) == 1 and x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert dt.stride(-1) == 1 and (z is None or z.stride(-1) == 1)
    y = torch.empty(Bsz, H, P, device=x.device, dtype=x.dtype)
    block_n = triton.next_power_of_2(N)
    block_p = block_p or max(1, min(triton.next_power_of_2(P), 2048 // block_n))
    zz = z if z is not None else x
    _state_update_kernel[(triton.cdiv(P, block_p), Bsz * H)](
        state,
        x,
        dt,
        A,
        B,
        C,
        D,
        zz,
        dt_bias,
        y,
        H,
        P,
        N,
        state.stride(0),
        state.stride(1),
        state.stride(2),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        C.stride(0),
        zz.stride(0),
        zz.stride(1),
        HAS_Z=z is not None,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y
