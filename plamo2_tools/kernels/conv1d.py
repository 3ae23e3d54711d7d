"""Triton depthwise causal conv1d + SiLU over packed sequences, and its one-token update.

Prefill runs in two launches because a sequence's conv state is both read (its history, by the
programs holding its first tokens) and rewritten (its last K-1 inputs): the conv kernel only
reads states, then ``_conv_state_kernel`` writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels.triton_math import silu


@triton.jit
def _conv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    state_ptr,
    has_init_ptr,
    seq_ptr,
    cu_ptr,
    T,
    Cch,
    sx,
    ss_seq,
    ss_c,
    ss_k,
    K: tl.constexpr,
    HAS_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < T, c < Cch
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    start = tl.load(cu_ptr + seq, mask=t_ok, other=0)
    if HAS_STATE:
        use_state = tl.load(has_init_ptr + seq, mask=t_ok, other=0) != 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        src = t - (K - 1) + k  # packed index of the input under tap k
        in_seq = src >= start
        v = tl.load(
            x_ptr + src[:, None] * sx + c[None, :],
            mask=(t_ok & in_seq)[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_STATE:  # before the sequence start: its history slot (K-1) + (src - start)
            h_off = seq * ss_seq + ((K - 1) + src - start) * ss_k
            hist_mask = (t_ok & ~in_seq & use_state)[:, None] & c_ok[None, :]
            hist = tl.load(state_ptr + h_off[:, None] + c[None, :] * ss_c, mask=hist_mask, other=0.0)
            v += hist.to(tl.float32)
        w = tl.load(w_ptr + c * K + k, mask=c_ok, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    y = silu(acc)
    tl.store(y_ptr + t[:, None] * Cch + c[None, :], y.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    has_init_ptr,
    cu_ptr,
    Cch,
    sx,
    ss_seq,
    ss_c,
    ss_k,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """New state of sequence s = its last K-1 inputs, reaching back into the old state."""
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    start, end = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    use_state = tl.load(has_init_ptr + s) != 0
    pos = end - start - KM1 + j  # position relative to the sequence start
    c_ok, j_ok = c < Cch, j < KM1
    base = state_ptr + s * ss_seq + c[:, None] * ss_c
    from_x = tl.load(
        x_ptr + (start + pos)[None, :] * sx + c[:, None], mask=c_ok[:, None] & (j_ok & (pos >= 0))[None, :], other=0.0
    )
    # (tl.where, not &: the interpreter rejects masks mixing scalar and vector booleans)
    hist_mask = tl.where(use_state, c_ok[:, None] & (j_ok & (pos < 0))[None, :], False)
    from_state = tl.load(base + (KM1 + pos)[None, :] * ss_k, mask=hist_mask, other=0.0)
    new = from_x.to(tl.float32) + from_state.to(tl.float32)
    tl.store(base + j[None, :] * ss_k, new.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & j_ok[None, :])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, Cch = x.shape
    K = weight.shape[1]
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    S = cu.numel() - 1
    # Per-token sequence id without a host sync (keeps prefill capturable).
    seq = torch.searchsorted(cu[1:], torch.arange(T, device=x.device, dtype=torch.int32), right=True)
    seq = seq.to(torch.int32)
    if has_initial_state is None or conv_state is None:
        has_init = torch.zeros(S, device=x.device, dtype=torch.int32)
    else:
        has_init = has_initial_state.to(device=x.device, dtype=torch.int32)
    state = conv_state if conv_state is not None else x  # dummy pointer when absent
    ss = conv_state.stride() if conv_state is not None else (0, 0, 0)
    y = torch.empty_like(x)
    block_c = min(128, triton.next_power_of_2(Cch))
    _conv_kernel[(triton.cdiv(T, 32), triton.cdiv(Cch, block_c))](
        x,
        weight.contiguous(),
        y,
        state,
        has_init,
        seq,
        cu,
        T,
        Cch,
        x.stride(0),
        *ss,
        K=K,
        HAS_STATE=conv_state is not None and has_initial_state is not None,
        BLOCK_T=32,
        BLOCK_C=block_c,
        num_warps=4,
    )
    if conv_state is not None:
        _conv_state_kernel[(S, triton.cdiv(Cch, block_c))](
            x,
            conv_state,
            has_init,
            cu,
            Cch,
            x.stride(0),
            *ss,
            KM1=K - 1,
            BLOCK_K=triton.next_power_of_2(K - 1),
            BLOCK_C=block_c,
            num_warps=4,
        )
    return y


@triton.jit
def _conv_update_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    y_ptr,
    Cch,
    sx,
    ss_b,
    ss_c,
    ss_k,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    c_ok, hist_ok = c < Cch, j < K - 1
    x = tl.load(x_ptr + b * sx + c, mask=c_ok, other=0.0)
    base = state_ptr + b * ss_b + c[:, None] * ss_c
    hist = tl.load(base + j[None, :] * ss_k, mask=c_ok[:, None] & hist_ok[None, :], other=0.0)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=c_ok[:, None] & hist_ok[None, :], other=0.0)
    w_last = tl.load(w_ptr + c * K + K - 1, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.sum(hist.to(tl.float32) * w.to(tl.float32), axis=1) + x.to(tl.float32) * w_last
    tl.store(y_ptr + b * Cch + c, silu(acc).to(y_ptr.dtype.element_ty), mask=c_ok)
    # Shift left by one: slot j takes old slot j+1, the last slot takes x.
    nxt = tl.load(base + (j + 1)[None, :] * ss_k, mask=c_ok[:, None] & (j + 1 < K - 1)[None, :], other=0.0)
    nxt = tl.where((j == K - 2)[None, :], x[:, None].to(nxt.dtype), nxt)
    tl.store(base + j[None, :] * ss_k, nxt.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & hist_ok[None, :])


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    Bsz, Cch = x.shape
    K = weight.shape[1]
    y = torch.empty(Bsz, Cch, device=x.device, dtype=x.dtype)
    block_c = min(256, triton.next_power_of_2(Cch))
    _conv_update_kernel[(Bsz, triton.cdiv(Cch, block_c))](
        x,
        conv_state,
        weight.contiguous(),
        y,
        Cch,
        x.stride(0),
        *conv_state.stride(),
        K=K,
        BLOCK_K=triton.next_power_of_2(K - 1),
        BLOCK_C=block_c,
        num_warps=4,
    )
    return y
