"""Triton Mamba2 chunked scan (SSD) for packed sequences, fp32 state, one B/C group.

Chunks of Q tokens never cross a sequence boundary; chunk c of the batch is the c-th of the
sequences' chunks in order (each sequence has ceil(L_s / Q)).  With a_t the within-chunk cumulative
log decay sum(delta A), the output pass is

    y_i = exp(a_i) C_i . S_start + sum_{j <= i in chunk} (C_i . B_j) exp(a_i - a_j) delta_j x_j
    + D x_i, then y *= silu(z)                                    (``_chunk_output_kernel``)

and it needs S_start, the state entering every chunk.  Two ways to get it:

* ``"sequential"``: ``_state_pass_kernel`` walks one sequence's tokens per (head, (P, N) tile),
  S <- exp(a_last) S + sum_j exp(a_last - a_j) delta_j x_j (outer) B_j, BLOCK_Q tokens a step,
  writing S at each chunk start.  Fewest bytes (x read once, one fp32 state per chunk written), but
  T / BLOCK_Q dependent steps per program.
* ``"parallel"``: ``_chunk_state_kernel`` computes every chunk's own end state from zero in
  parallel (one dot of K = Q per chunk, head and P block), then ``_chunk_pass_kernel`` chains them,
  S_start(c+1) = exp(a_last(c)) S_start(c) + local(c): T / Q elementwise steps.  Two more fp32
  state passes over memory, but no long dependent chain (the mamba_ssm structure, without its
  separate cumsum and C.B^T kernels).

Both also write a_t for the output pass and the final states.  The sequence -> chunk bookkeeping
is recomputed in-kernel from cu_seqlens (no host sync, so the whole scan is graph-capturable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


@triton.jit
def _chunk_of(cu_ptr, c, S, Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, chunk index inside it) of batch chunk c; sequence == S for unused slots."""
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    incl = tl.cumsum(nch, axis=0)
    seq = tl.sum(((incl <= c) & (i < S)).to(tl.int32), axis=0)
    return seq, c - tl.sum(tl.where(i == seq, incl - nch, 0), axis=0)


@triton.jit
def _chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, local_ptr, atot_ptr, acum_ptr, cu_ptr,
    S, H, P, N,
    sx_t, sx_h, sdt_t, sdt_h, sB_t,
    Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """End state of chunk c started from zero: sum_j exp(a_last - a_j) delta_j x_j (outer) B_j."""
    c, pb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, chunk_in_seq = _chunk_of(cu_ptr, c, S, Q, BLOCK_S)
    if seq >= S:
        return
    c_start = tl.load(cu_ptr + seq) + chunk_in_seq * Q
    c_end = tl.minimum(c_start + Q, tl.load(cu_ptr + seq + 1))
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    a_tot = tl.full((), 0.0, tl.float32)  # pass 1: the chunk's total log decay (dt only)
    for k0 in range(c_start, c_end, BLOCK_K):
        t = k0 + tl.arange(0, BLOCK_K)
        dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=t < c_end, other=0.0).to(tl.float32)
        a_tot += tl.sum(tl.where(t < c_end, softplus(dt + bias), 0.0) * A, axis=0)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    a_carry = tl.full((), 0.0, tl.float32)
    for k0 in range(c_start, c_end, BLOCK_K):
        t = k0 + tl.arange(0, BLOCK_K)
        t_ok = t < c_end
        dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=t_ok, other=0.0).to(tl.float32)
        delta = tl.where(t_ok, softplus(dt + bias), 0.0)
        a = a_carry + tl.cumsum(delta * A, axis=0)
        a_carry += tl.sum(delta * A, axis=0)
        tl.store(acum_ptr + t * H + h, a, mask=tl.where(pb == 0, t_ok, False))
        xk = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + p[None, :],
                     mask=t_ok[:, None] & p_ok[None, :], other=0.0)  # fmt: skip
        Bk = tl.load(B_ptr + t[:, None] * sB_t + n[None, :],
                     mask=t_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        Bw = Bk.to(tl.float32) * (tl.exp(a_tot - a) * delta)[:, None]
        acc += dot(tl.trans(xk), Bw.to(xk.dtype), DOT_F32)
    tl.store(local_ptr + (c * H + h) * P * N + p[:, None] * N + n[None, :], acc,
             mask=p_ok[:, None] & n_ok[None, :])  # fmt: skip
    if pb == 0:
        tl.store(atot_ptr + c * H + h, a_tot)


@triton.jit
def _chunk_pass_kernel(
    local_ptr, atot_ptr, init_ptr, states_ptr, final_ptr, cu_ptr,
    S, H, PN,
    Q: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, HAS_INIT: tl.constexpr,
):  # fmt: skip
    """Chain one sequence's chunk states: states[c] = S entering chunk c; S <- exp(a) S + local."""
    tile, sh = tl.program_id(0), tl.program_id(1)
    s, h = sh // H, sh % H
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    first = tl.sum(tl.where(i < s, nch, 0), axis=0)
    count = tl.sum(tl.where(i == s, nch, 0), axis=0)
    off = tile * BLOCK + tl.arange(0, BLOCK)
    ok = off < PN
    if HAS_INIT:
        state = tl.load(init_ptr + (s * H + h) * PN + off, mask=ok, other=0.0)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    # Loads do not depend on the carried state: issue them two chunks ahead of their use.
    c = first
    loc0 = tl.load(local_ptr + (c * H + h) * PN + off, mask=tl.where(count > 0, ok, False), other=0.0)
    dec0 = tl.load(atot_ptr + c * H + h, mask=count > 0, other=0.0)
    loc1 = tl.load(local_ptr + ((c + 1) * H + h) * PN + off, mask=tl.where(count > 1, ok, False), other=0.0)
    dec1 = tl.load(atot_ptr + (c + 1) * H + h, mask=count > 1, other=0.0)
    for k in range(0, count):
        c = first + k
        more = k + 2 < count
        loc2 = tl.load(local_ptr + ((c + 2) * H + h) * PN + off, mask=tl.where(more, ok, False), other=0.0)
        dec2 = tl.load(atot_ptr + (c + 2) * H + h, mask=more, other=0.0)
        tl.store(states_ptr + (c * H + h) * PN + off, state, mask=ok)
        state = state * tl.exp(dec0) + loc0
        loc0, dec0, loc1, dec1 = loc1, dec1, loc2, dec2
    tl.store(final_ptr + (s * H + h) * PN + off, state, mask=ok)


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
    seq, chunk_in_seq = _chunk_of(cu_ptr, c, S, Q, BLOCK_S)
    if seq >= S:  # grid is sized by an upper bound on the chunk count
        return
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


@dataclass
class _Scan:
    """Inputs, scratch and outputs of one ``ssd_chunk_scan`` call (the launches share them)."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor | None
    dt_bias: torch.Tensor
    cu: torch.Tensor
    init: torch.Tensor | None
    Q: int
    states: torch.Tensor  # (slots, H, P, N) fp32: state entering each chunk
    final: torch.Tensor  # (S, H, P, N) fp32
    acum: torch.Tensor  # (T, H) fp32: within-chunk cumulative log decay
    y: torch.Tensor
    dot_f32: bool
    local: torch.Tensor | None = None  # "parallel": each chunk's own end state
    atot: torch.Tensor | None = None  # "parallel": (slots, H) total log decay of each chunk

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(T, S, H, P, N)."""
        T, H, P = self.x.shape
        return T, self.cu.numel() - 1, H, P, self.B.shape[-1]

    @property
    def slots(self) -> int:
        return self.states.shape[0]

    @property
    def block_s(self) -> int:
        return triton.next_power_of_2(self.cu.numel())


def _prepare(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_state, Q, parallel) -> _Scan:
    T, H, P = x.shape
    N = B.shape[-1]
    assert Q >= 16 and Q & (Q - 1) == 0, "chunk_size must be a power of two >= 16"
    assert x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert z is None or z.stride(-1) == 1
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    S = cu.numel() - 1
    slots = T // Q + S  # >= sum_s ceil(L_s / Q)
    f32 = torch.float32
    return _Scan(
        x=x, dt=dt, A=A.contiguous(), B=B, C=C, D=D.contiguous(), z=z, dt_bias=dt_bias.contiguous(),
        cu=cu, init=None if initial_state is None else initial_state.float().contiguous(), Q=Q,
        states=torch.empty(slots, H, P, N, device=dev, dtype=f32),
        final=torch.empty(S, H, P, N, device=dev, dtype=f32),
        acum=torch.empty(T, H, device=dev, dtype=f32),
        y=torch.empty(T, H, P, device=dev, dtype=x.dtype),
        dot_f32=x.dtype == f32 or (_INTERPRET and x.dtype == torch.bfloat16),
        local=torch.empty(slots, H, P, N, device=dev, dtype=f32) if parallel else None,
        atot=torch.empty(slots, H, device=dev, dtype=f32) if parallel else None,
    )  # fmt: skip


def _launch_sequential(w: _Scan, block_q: int | None = None, warps: int = 4, stages: int = 2) -> None:
    T, S, H, P, N = w.dims
    bp, bn = _state_tiles(w.x.device, P, N, S * H)
    block_q = min(block_q or (16 if _INTERPRET else 128), w.Q)
    _state_pass_kernel[(triton.cdiv(P, bp), triton.cdiv(N, bn), S * H)](
        w.x, w.dt, w.A, w.B, w.dt_bias, w.init if w.init is not None else w.final, w.states,
        w.final, w.acum, w.cu,
        S, H, P, N, w.x.stride(0), w.x.stride(1), w.dt.stride(0), w.dt.stride(1), w.B.stride(0),
        Q=w.Q, BLOCK_Q=block_q, BLOCK_P=bp, BLOCK_N=bn, BLOCK_S=w.block_s,
        HAS_INIT=w.init is not None, DOT_F32=w.dot_f32, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _launch_chunk_states(
    w: _Scan, block_p: int = 64, block_k: int = 64, warps: int = 4, stages: int = 2
) -> None:
    T, S, H, P, N = w.dims
    assert w.local is not None and w.atot is not None
    if _INTERPRET:
        block_p, block_k = min(block_p, 32), min(block_k, 16)
    block_p = min(block_p, triton.next_power_of_2(P))
    _chunk_state_kernel[(w.slots, triton.cdiv(P, block_p), H)](
        w.x, w.dt, w.A, w.B, w.dt_bias, w.local, w.atot, w.acum, w.cu,
        S, H, P, N, w.x.stride(0), w.x.stride(1), w.dt.stride(0), w.dt.stride(1), w.B.stride(0),
        Q=w.Q, BLOCK_K=min(block_k, w.Q), BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
        BLOCK_S=w.block_s, DOT_F32=w.dot_f32, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _launch_chunk_pass(w: _Scan, block: int = 512, warps: int = 4) -> None:
    T, S, H, P, N = w.dims
    assert w.local is not None and w.atot is not None
    block = min(block, triton.next_power_of_2(P * N))
    _chunk_pass_kernel[(triton.cdiv(P * N, block), S * H)](
        w.local, w.atot, w.init if w.init is not None else w.final, w.states, w.final, w.cu,
        S, H, P * N, Q=w.Q, BLOCK=block, BLOCK_S=w.block_s, HAS_INIT=w.init is not None,
        num_warps=warps, num_stages=1,
    )  # fmt: skip


def _launch_output(w: _Scan) -> None:
    T, S, H, P, N = w.dims
    zz = w.z if w.z is not None else w.x

    def grid(meta):
        return (w.slots * triton.cdiv(w.Q, meta["BLOCK_M"]), triton.cdiv(P, meta["BLOCK_P"]), H)

    _chunk_output_kernel[grid](
        w.x, zz, w.dt, w.B, w.C, w.D, w.dt_bias, w.states, w.acum, w.cu, w.y,
        S, H, P, N, w.x.stride(0), w.x.stride(1), zz.stride(0), zz.stride(1),
        w.dt.stride(0), w.dt.stride(1), w.B.stride(0), w.C.stride(0),
        Q=w.Q, BLOCK_N=triton.next_power_of_2(N), BLOCK_S=w.block_s, HAS_Z=w.z is not None,
        DOT_F32=w.dot_f32,
    )  # fmt: skip


VARIANTS = ("sequential", "parallel")
DEFAULT_VARIANT = "sequential"


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
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``Ops.ssd_chunk_scan``; ``variant`` picks how chunk states are formed (module doc)."""
    variant = variant or DEFAULT_VARIANT
    assert variant in VARIANTS, variant
    w = _prepare(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_state, chunk_size,
                 variant == "parallel")  # fmt: skip
    if variant == "parallel":
        _launch_chunk_states(w)
        _launch_chunk_pass(w)
    else:
        _launch_sequential(w)
    _launch_output(w)
    return w.y, w.final
