"""Triton split-K decode attention (one query per sequence), GQA by contiguous head groups.

Decode with Hkv = 1 (PLaMo2-1B) has one (sequence, KV head) pair of parallelism per sequence, so
the visible keys (the last window+1, or all) are split over programs ("flash decoding"); each
program loads a K/V tile once for all the query heads of its KV head, keeps an online softmax in
exp2 form, and a second launch merges the partial results.  Prefill and chunked prefill go to SDPA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels.triton_math import dot

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lens_ptr,
    o_ptr,
    ml_ptr,
    qk_scale,
    group,
    window,
    n_splits,
    sq_b,
    sq_h,
    sk_s,
    sk_l,
    sk_h,
    sv_s,
    sv_l,
    sv_h,
    HEAD_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    sp, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Hq = group * tl.num_programs(1)
    L = tl.load(lens_ptr + b)
    b = b.to(tl.int64)  # b * sk_s passes 2**31 for caches over 4 GiB (seen: 8b, 256 x 32K tokens)
    lo = tl.maximum(L - 1 - window, 0) if HAS_WINDOW else 0
    per = tl.cdiv(tl.cdiv(L - lo, n_splits), BLOCK_N) * BLOCK_N
    k_lo = lo + sp * per
    k_hi = tl.minimum(L, k_lo + per)
    gi = tl.arange(0, BLOCK_G)
    heads = g * group + gi
    d = tl.arange(0, HEAD_D)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=(gi < group)[:, None], other=0.0)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_D), tl.float32)
    for j0 in range(k_lo, k_hi, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        ok = cols < k_hi
        k = tl.load(
            k_ptr + b * sk_s + cols[:, None].to(tl.int64) * sk_l + g * sk_h + d[None, :], mask=ok[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + b * sv_s + cols[:, None].to(tl.int64) * sv_l + g * sv_h + d[None, :], mask=ok[:, None], other=0.0
        )
        s = tl.where(ok[None, :], dot(q, tl.trans(k), DOT_F32) * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    row = (b * Hq + heads) * n_splits + sp  # partials laid out (B, Hq, n_splits, ...)
    h_ok = gi < group
    tl.store(o_ptr + row[:, None] * HEAD_D + d[None, :], acc, mask=h_ok[:, None])
    tl.store(ml_ptr + row * 2, m, mask=h_ok)
    tl.store(ml_ptr + row * 2 + 1, l_sum, mask=h_ok)


@triton.jit
def _decode_merge_kernel(o_ptr, ml_ptr, out_ptr, n_splits, HEAD_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # = b * Hq + h, also the row of the (B, Hq, d) output
    sp = tl.arange(0, BLOCK_SPLITS)
    ok = sp < n_splits
    m = tl.load(ml_ptr + (bh * n_splits + sp) * 2, mask=ok, other=float("-inf"))
    l_sum = tl.load(ml_ptr + (bh * n_splits + sp) * 2 + 1, mask=ok, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # empty splits have m = -inf: weight 0
    d = tl.arange(0, HEAD_D)
    o = tl.load(o_ptr + (bh * n_splits + sp)[:, None] * HEAD_D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
    tl.store(out_ptr + bh * HEAD_D + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q (B, Hq, d): one query per sequence, the last of its kv_lens[b] cached keys."""
    Bsz, Hq, d = q.shape
    Lmax, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert d == triton.next_power_of_2(d) and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = Hq // Hkv
    block_n = 16 if _INTERPRET else 64
    span = Lmax if window is None else min(Lmax, window + 1)
    if q.device.type == "cuda":  # ~2 waves of programs over the SMs
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        n_splits = min(triton.cdiv(span, block_n), max(1, triton.cdiv(2 * sms, Bsz * Hkv)))
    else:
        n_splits = min(triton.cdiv(span, block_n), 4)
    o = torch.empty(Bsz, Hq, n_splits, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(Bsz, Hq, n_splits, 2, device=q.device, dtype=torch.float32)
    lens = kv_lens.to(device=q.device, dtype=torch.int32)
    _decode_split_kernel[(n_splits, Hkv, Bsz)](
        q,
        k_cache,
        v_cache,
        lens,
        o,
        ml,
        scale * _LOG2E,
        group,
        window if window is not None else 0,
        n_splits,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        HEAD_D=d,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        HAS_WINDOW=window is not None,
        DOT_F32=q.dtype == torch.float32 or (_INTERPRET and q.dtype == torch.bfloat16),
        num_warps=4,
        num_stages=2,
    )
    out = torch.empty(Bsz, Hq, d, device=q.device, dtype=q.dtype)
    _decode_merge_kernel[(Bsz * Hq,)](
        o, ml, out, n_splits, HEAD_D=d, BLOCK_SPLITS=triton.next_power_of_2(n_splits), num_warps=4
    )
    return out
