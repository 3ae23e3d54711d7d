"""Triton fusions of the launch-bound steps of a decoder layer (one launch each instead of 4-20).

* ``norm_add_norm``: the post-mixer (or post-MLP) norm, the residual add and the next pre-norm of
  one row, ``y1 = rms(x; w1)``, ``r = y1 + residual``, ``y = rms(r; w2)``, with the same two
  roundings as the unfused chain (y1 and r are stored in the activation dtype first).
* ``bcdt_rms_norm``: the B, C and dt pre-norms of the Mamba mixer (64, 64 and dt_rank wide) over
  one ``bcdt`` row.
* ``qk_norm_rope``: the attention's per-head q/k norms, NeoX RoPE (fp32 cos/sin tables) and the
  K/V cache writes at each token's (sequence, position), from the fused qkv projection output.

Each has a PyTorch twin in ``torch_ops`` with the same rounding points; see ``kernels.Ops``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_add_norm_kernel(
    x_ptr,
    res_ptr,
    w1_ptr,
    w2_ptr,
    y_ptr,
    r_ptr,
    R,
    D,
    sx,
    s_res,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    out_off = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w1_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    w2 = tl.load(w2_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y1 = (x * rstd[:, None] * w1[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
    res = tl.load(res_ptr + rows[:, None] * s_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = (y1 + res).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + out_off, r, mask=mask)
    r32 = r.to(tl.float32)
    rstd2 = tl.rsqrt(tl.sum(r32 * r32, axis=1) / D + eps)
    tl.store(y_ptr + out_off, (r32 * rstd2[:, None] * w2[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def norm_add_norm(
    x: torch.Tensor, w1: torch.Tensor, residual: torch.Tensor, w2: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    M, D = x.shape
    y = torch.empty(M, D, device=x.device, dtype=x.dtype)
    r = torch.empty(M, D, device=x.device, dtype=residual.dtype)
    block_d = triton.next_power_of_2(D)
    block_r = min(triton.next_power_of_2(max(M, 1)), max(1, 4096 // block_d))
    _norm_add_norm_kernel[(triton.cdiv(M, block_r),)](
        x,
        residual,
        w1.contiguous(),
        w2.contiguous(),
        y,
        r,
        M,
        D,
        x.stride(0),
        residual.stride(0),
        eps,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=8 if block_r * block_d >= 8192 else 4,
    )
    return y, r


@triton.jit
def _segment_norm(in_ptr, w_ptr, out_ptr, t, t_ok, s_in, col0, W, eps, BLOCK_W: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    mask = t_ok[:, None] & (cols < W)[None, :]
    x = tl.load(in_ptr + t[:, None] * s_in + col0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < W, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / W + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + t[:, None] * W + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bcdt_norm_kernel(
    in_ptr,
    wb_ptr,
    wc_ptr,
    wdt_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    T,
    N,
    R,
    s_in,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    _segment_norm(in_ptr, wb_ptr, b_ptr, t, t_ok, s_in, 0, N, eps, BLOCK_N)
    _segment_norm(in_ptr, wc_ptr, c_ptr, t, t_ok, s_in, N, N, eps, BLOCK_N)
    _segment_norm(in_ptr, wdt_ptr, dt_ptr, t, t_ok, s_in, 2 * N, R, eps, BLOCK_R)


def bcdt_rms_norm(
    bcdt: torch.Tensor, wB: torch.Tensor, wC: torch.Tensor, wdt: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if bcdt.stride(-1) != 1:
        bcdt = bcdt.contiguous()
    T = bcdt.shape[0]
    N, R = wB.shape[0], wdt.shape[0]
    B = torch.empty(T, N, device=bcdt.device, dtype=bcdt.dtype)
    C = torch.empty(T, N, device=bcdt.device, dtype=bcdt.dtype)
    dt = torch.empty(T, R, device=bcdt.device, dtype=bcdt.dtype)
    block_n, block_r = triton.next_power_of_2(N), triton.next_power_of_2(R)
    block_t = max(1, min(triton.next_power_of_2(max(T, 1)), 2048 // max(block_n, block_r)))
    _bcdt_norm_kernel[(triton.cdiv(T, block_t),)](
        bcdt,
        wB.contiguous(),
        wC.contiguous(),
        wdt.contiguous(),
        B,
        C,
        dt,
        T,
        N,
        R,
        bcdt.stride(0),
        eps,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
    )
    return B, C, dt


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    seq_ptr,
    pos_ptr,
    T,
    Hq,
    Hkv,
    s_qkv,
    s_cs,
    skc_s,
    skc_l,
    skc_h,
    svc_s,
    svc_l,
    svc_h,
    eps,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (token block, head): heads [0, Hq) are q, then Hkv k heads, then Hkv v heads."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    j = tl.arange(0, HALF)
    t_ok = t < T
    m = t_ok[:, None]
    row = qkv_ptr + t[:, None].to(tl.int64) * s_qkv + h * (2 * HALF) + j[None, :]
    x1 = tl.load(row, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=m, other=0.0).to(tl.float32)
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    if h < Hq + Hkv:
        if h < Hq:
            w1 = tl.load(qw_ptr + h * (2 * HALF) + j).to(tl.float32)
            w2 = tl.load(qw_ptr + h * (2 * HALF) + HALF + j).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + (h - Hq) * (2 * HALF) + j).to(tl.float32)
            w2 = tl.load(kw_ptr + (h - Hq) * (2 * HALF) + HALF + j).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        n1 = x1 * rstd[:, None] * w1[None, :]
        n2 = x2 * rstd[:, None] * w2[None, :]
        cs = t[:, None].to(tl.int64) * s_cs + j[None, :]
        c = tl.load(cos_ptr + cs, mask=m, other=0.0)
        s = tl.load(sin_ptr + cs, mask=m, other=0.0)
        o1 = n1 * c - n2 * s
        o2 = n2 * c + n1 * s
        if h < Hq:
            out = q_ptr + (t[:, None].to(tl.int64) * Hq + h) * (2 * HALF) + j[None, :]
            tl.store(out, o1.to(q_ptr.dtype.element_ty), mask=m)
            tl.store(out + HALF, o2.to(q_ptr.dtype.element_ty), mask=m)
        else:
            out = kc_ptr + (seq * skc_s + pos * skc_l + (h - Hq) * skc_h)[:, None] + j[None, :]
            tl.store(out, o1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(out + HALF, o2.to(kc_ptr.dtype.element_ty), mask=m)
    else:
        out = vc_ptr + (seq * svc_s + pos * svc_l + (h - Hq - Hkv) * svc_h)[:, None] + j[None, :]
        tl.store(out, x1.to(vc_ptr.dtype.element_ty), mask=m)
        tl.store(out + HALF, x2.to(vc_ptr.dtype.element_ty), mask=m)


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    T = qkv.shape[0]
    Hq, d = q_weight.shape
    Hkv = k_weight.shape[0]
    assert d % 2 == 0 and d // 2 == triton.next_power_of_2(d // 2)
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    cos, sin = cos.reshape(T, d), sin.reshape(T, d)
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    q = torch.empty(T, Hq, d, device=qkv.device, dtype=qkv.dtype)
    block_t = max(1, min(16, triton.next_power_of_2(max(T, 1))))
    _qk_norm_rope_kernel[(triton.cdiv(T, block_t), Hq + 2 * Hkv)](
        qkv,
        q_weight.contiguous(),
        k_weight.contiguous(),
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        seq_index,
        positions,
        T,
        Hq,
        Hkv,
        qkv.stride(0),
        cos.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        eps,
        HALF=d // 2,
        BLOCK_T=block_t,
        num_warps=4 if block_t * d >= 1024 else 1,
    )
    return q
