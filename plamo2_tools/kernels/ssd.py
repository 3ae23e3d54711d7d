"""Triton Mamba2 chunked scan (SSD) for packed sequences, fp32 state, one B/C group.

Chunks of Q tokens never cross a sequence boundary; chunk c of the batch is the c-th of the
sequences' chunks in order (each sequence has ceil(L_s / Q)).  With a_t the within-chunk cumulative
log decay sum(delta A), two launches compute

 1. ``_state_pass_kernel`` (sequential over one sequence's tokens, per head and (P, N) tile):
    the state at the start of every chunk, S <- exp(a_last) S + sum_j exp(a_last - a_j) delta_j
    x_j (outer) B_j, stepping BLOCK_Q tokens at a time.  It also writes a_t for the second pass
    and the final states.  This pass only reads x, B, dt: the heavy work is in
 2. ``_chunk_output_kernel`` (parallel over chunks, row blocks, P blocks, heads):
    y_i = exp(a_i) C_i . S_start + sum_{j <= i in chunk} (C_i . B_j) exp(a_i - a_j) delta_j x_j
    + D x_i, then y *= silu(z).

Compared with the 5-kernel mamba_ssm design, there are no per-chunk local states, no separate
C.B^T buffer and no cumsum pass: extra traffic is one fp32 state per chunk, written and read once.
The sequence -> chunk bookkeeping is recomputed in-kernel from cu_seqlens (no host sync).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels.triton_math import dot, silu, softplus

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _chunk_counts(cu_ptr, S, Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence index, number of chunks) vectors over all sequences (0 beyond S)."""
    i = tl.arange(0, BLOCK_S)
    ok = i < S
    lens = tl.load(cu_ptr + i + 1, mask=ok, other=0) - tl.load(cu_ptr + i, mask=ok, other=0)
    return i, (lens + Q - 1) // Q


@triton.jit
def _state_pass_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, init_ptr, states_ptr, final_ptr, acum_ptr, cu_ptr,
    S, H, P, N,
    sx_t, sx_h, sdt_t, sdt_h, sB_t,
    Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_INIT: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pb, nb, sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, h = sh // H, sh % H
    start, end = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    first_chunk = tl.sum(tl.where(i < s, nch, 0), axis=0)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    pn_mask = (p < P)[:, None] & (n < N)[None, :]
    pn_off = p[:, None] * N + n[None, :]  # offset inside one contiguous (P, N) state
    hpn_off = h * P * N + pn_off
    if HAS_INIT:
        state = tl.load(init_ptr + s * H * P * N + hpn_off, mask=pn_mask, other=0.0)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    write_acum = (pb == 0) & (nb == 0)  # a_t is the same for every tile: one writer
    a_carry = tl.full((), 0.0, tl.float32)
    for kb in range(0, tl.cdiv(end - start, BLOCK_Q)):
        chunk_start = (kb % (Q // BLOCK_Q)) == 0
        chunk = first_chunk + kb // (Q // BLOCK_Q)
        # tl.where, not &: the interpreter rejects masks mixing scalar and vector booleans
        at_start = tl.where(chunk_start, pn_mask, False)
        tl.store(states_ptr + chunk * H * P * N + hpn_off, state, mask=at_start)
        a_carry = tl.where(chunk_start, 0.0, a_carry)
        t = start + kb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        t_ok = t < end
        dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=t_ok, other=0.0).to(tl.float32)
        delta = tl.where(t_ok, softplus(dt + bias), 0.0)
        a = tl.cumsum(delta * A, axis=0)
        a_last = tl.sum(delta * A, axis=0)
        tl.store(acum_ptr + t * H + h, a_carry + a, mask=tl.where(write_acum, t_ok, False))
        a_carry += a_last
        xk = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + p[None, :],
                     mask=t_ok[:, None] & (p < P)[None, :], other=0.0)  # fmt: skip
        Bk = tl.load(B_ptr + t[:, None] * sB_t + n[None, :],
                     mask=t_ok[:, None] & (n < N)[None, :], other=0.0)  # fmt: skip
        Bw = Bk.to(tl.float32) * (tl.exp(a_last - a) * delta)[:, None]
        state = state * tl.exp(a_last) + dot(tl.trans(xk), Bw.to(xk.dtype), DOT_F32)
    tl.store(final_ptr + s * H * P * N + hpn_off, state, mask=pn_mask)


_OUT_CONFIGS = [
    # (BLOCK_M, BLOCK_K, BLOCK_P, warps, stages).  sm90 wgmma race (kernel-notes 6.2): a register
    # operand dot in a pipelined loop with warps % 4 == 0 and BLOCK_M % 64 == 0 needs stages == 1.
    (64, 64, 64, 4, 1),
    (64, 32, 128, 4, 1),
    (32, 64, 64, 4, 2),
    (128, 64, 64, 8, 1),
]
if _INTERPRET:  # one config (multi-config autotune needs a GPU driver); few, large-ish blocks
    _OUT_CONFIGS = [(32, 32, 32, 4, 1)]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": m, "BLOCK_K": k, "BLOCK_P": p}, num_warps=w, num_stages=st)
        for m, k, p, w, st in _OUT_CONFIGS
    ],
    key=["H", "P", "N", "Q", "DOT_F32"],
)
@triton.jit
def _chunk_output_kernel(
    x_ptr, z_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, states_ptr, acum_ptr, cu_ptr, y_ptr,
    S, H, P, N,
    sx_t, sx_h, sz_t, sz_h, sdt_t, sdt_h, sB_t, sC_t,
    Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_Z: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    blocks_per_chunk = (Q + BLOCK_M - 1) // BLOCK_M
    c = tl.program_id(0) // blocks_per_chunk
    mb = tl.program_id(0) % blocks_per_chunk
    pb, h = tl.program_id(1), tl.program_id(2)
    # Which sequence owns chunk c: count sequences whose chunks all come before it.
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    incl = tl.cumsum(nch, axis=0)
    seq = tl.sum(((incl <= c) & (i < S)).to(tl.int32), axis=0)
    if seq >= S:  # grid is sized by an upper bound on the chunk count
        return
    chunk_in_seq = c - tl.sum(tl.where(i == seq, incl - nch, 0), axis=0)
    c_start = tl.load(cu_ptr + seq) + chunk_in_seq * Q
    c_end = tl.minimum(c_start + Q, tl.load(cu_ptr + seq + 1))
    i0 = c_start + mb * BLOCK_M
    if i0 >= c_end:
        return

    rows = i0 + tl.arange(0, BLOCK_M)
    r_ok = rows < c_end
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    a_i = tl.load(acum_ptr + rows * H + h, mask=r_ok, other=0.0)
    Cm = tl.load(C_ptr + rows[:, None] * sC_t + n[None, :],
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
    s0 = tl.load(states_ptr + (c * H + h) * P * N + p[:, None] * N + n[None, :],
                 mask=p_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
    # Carried state: tf32 keeps more of the fp32 state than rounding it to bf16 would.
    if DOT_F32:
        acc = tl.dot(Cm.to(tl.float32), tl.trans(s0), input_precision="ieee")
    else:
        acc = tl.dot(Cm.to(tl.float32), tl.trans(s0), input_precision="tf32")
    acc *= tl.exp(a_i)[:, None]

    bias = tl.load(bias_ptr + h).to(tl.float32)
    for j0 in range(c_start, tl.minimum(i0 + BLOCK_M, c_end), BLOCK_K):
        cols = j0 + tl.arange(0, BLOCK_K)
        k_ok = cols < c_end
        a_j = tl.load(acum_ptr + cols * H + h, mask=k_ok, other=0.0)
        dt = tl.load(dt_ptr + cols * sdt_t + h * sdt_h, mask=k_ok, other=0.0).to(tl.float32)
        delta = tl.where(k_ok, softplus(dt + bias), 0.0)
        Bk = tl.load(B_ptr + cols[:, None] * sB_t + n[None, :],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        xk = tl.load(x_ptr + cols[:, None] * sx_t + h * sx_h + p[None, :],
                     mask=k_ok[:, None] & p_ok[None, :], other=0.0)  # fmt: skip
        causal = rows[:, None] >= cols[None, :]
        decay = tl.exp(tl.where(causal, a_i[:, None] - a_j[None, :], float("-inf")))
        cb = dot(Cm, tl.trans(Bk), DOT_F32)
        acc += dot((cb * decay * delta[None, :]).to(xk.dtype), xk, DOT_F32)

    x_off = rows[:, None] * sx_t + h * sx_h + p[None, :]
    mask = r_ok[:, None] & p_ok[None, :]
    acc += tl.load(D_ptr + h).to(tl.float32) * tl.load(x_ptr + x_off, mask=mask, other=0.0).to(
        tl.float32
    )
    if HAS_Z:
        z = tl.load(z_ptr + rows[:, None] * sz_t + h * sz_h + p[None, :], mask=mask, other=0.0)
        z = z.to(tl.float32)
        acc *= silu(z)
    tl.store(y_ptr + (rows[:, None] * H + h) * P + p[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def _state_tiles(device: torch.device, P: int, N: int, programs: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of the sequential pass: smaller tiles until ~2 programs per SM.

    BLOCK_P <= 32 also keeps that dot off sm90 wgmma (M < 64), away from its loop race.
    """
    bp, bn = min(32, triton.next_power_of_2(P)), triton.next_power_of_2(N)
    if device.type != "cuda":
        return bp, bn
    want = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    while programs * triton.cdiv(P, bp) * triton.cdiv(N, bn) < want and bp > 16:
        bp //= 2
    while programs * triton.cdiv(P, bp) * triton.cdiv(N, bn) < want and bn > 16:
        bn //= 2
    return bp, bn


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, P = x.shape
    N = B.shape[-1]
    Q = chunk_size
    assert Q >= 16 and Q & (Q - 1) == 0, "chunk_size must be a power of two >= 16"
    assert x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert z is None or z.stride(-1) == 1
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    S = cu.numel() - 1
    A, D, dt_bias = A.contiguous(), D.contiguous(), dt_bias.contiguous()
    n_slots = T // Q + S  # >= sum_s ceil(L_s / Q)
    states = torch.empty(n_slots, H, P, N, device=dev, dtype=torch.float32)
    final = torch.empty(S, H, P, N, device=dev, dtype=torch.float32)
    acum = torch.empty(T, H, device=dev, dtype=torch.float32)
    y = torch.empty(T, H, P, device=dev, dtype=x.dtype)
    init = initial_state.float().contiguous() if initial_state is not None else final
    dot_f32 = x.dtype == torch.float32 or (_INTERPRET and x.dtype == torch.bfloat16)
    block_s = triton.next_power_of_2(S + 1)
    block_n = triton.next_power_of_2(N)

    bp, bn = _state_tiles(dev, P, N, S * H)
    _state_pass_kernel[(triton.cdiv(P, bp), triton.cdiv(N, bn), S * H)](
        x, dt, A, B, dt_bias, init, states, final, acum, cu,
        S, H, P, N, x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0),
        Q=Q, BLOCK_Q=min(Q, 16 if _INTERPRET else 128), BLOCK_P=bp, BLOCK_N=bn, BLOCK_S=block_s,
        HAS_INIT=initial_state is not None, DOT_F32=dot_f32, num_warps=4, num_stages=2,
    )  # fmt: skip
    zz = z if z is not None else x

    def grid(meta):
        return (n_slots * triton.cdiv(Q, meta["BLOCK_M"]), triton.cdiv(P, meta["BLOCK_P"]), H)

    _chunk_output_kernel[grid](
        x, zz, dt, B, C, D, dt_bias, states, acum, cu, y,
        S, H, P, N, x.stride(0), x.stride(1), zz.stride(0), zz.stride(1),
        dt.stride(0), dt.stride(1), B.stride(0), C.stride(0),
        Q=Q, BLOCK_N=block_n, BLOCK_S=block_s, HAS_Z=z is not None, DOT_F32=dot_f32,
    )  # fmt: skip
    return y, final
