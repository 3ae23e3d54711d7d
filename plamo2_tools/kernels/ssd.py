"""Triton Mamba2 chunked scan (SSD) for packed sequences, fp32 state, one B/C group.

Chunks of Q tokens never cross a sequence boundary; chunk c of the batch is the c-th of the
sequences' chunks in order (each sequence has ceil(L_s / Q)).  With a_t the within-chunk cumulative
log decay sum(delta A), the output is

    y_i = exp(a_i) C_i . S_start + sum_{j <= i in chunk} (C_i . B_j) exp(a_i - a_j) delta_j x_j
    + D x_i, then y *= silu(z)

Launches, in stream order:

 1. ``_chunk_cumsum_kernel`` (chunks x heads, tiny): the chunk's token range (a bounds table, so
    no later kernel redoes the sequence bookkeeping), a_t, delta_t and the state weight
    w_t = exp(a_last - a_t) delta_t, stored per head contiguous over tokens, and a_last.
 2. The state entering every chunk (S_start), one of two ways:
    * ``"sequential"``: ``_state_pass_kernel`` walks one sequence per (head, (P, N) tile):
      S <- exp(a_last) S + x^T (w * B) per chunk.  Fewest bytes (x read once, one fp32 state
      per chunk written) but T / BLOCK_Q dependent steps.
    * ``"parallel"``: ``_chunk_state_kernel`` forms every chunk's own end state from zero in
      parallel, then ``_chunk_pass_kernel`` chains them (T / Q elementwise steps).  Two more
      fp32 state passes over memory, a much shorter dependent chain.
 3. ``_chunk_output_kernel`` (chunks x row blocks x P blocks x heads): the formula above.

``ssd_chunk_scan`` times both variants and both Q in {128, 256} on the first call of each shape
bucket and keeps the fastest (the output does not depend on Q in exact arithmetic); an explicit
``variant`` runs that variant at the given ``chunk_size``.  No host sync: graph-capturable once
the choice is made.
"""

from __future__ import annotations

import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from plamo2_tools.kernels import compile_watch, tuned
from plamo2_tools.kernels.triton_math import dot, silu, softplus
from plamo2_tools.kernels.tune_cache import TuneCache, key_of
from plamo2_tools.version import __version__

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _chunk_counts(cu_ptr, S, Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence index, number of chunks) vectors over all sequences (0 beyond S)."""
    i = tl.arange(0, BLOCK_S)
    ok = i < S
    lens = tl.load(cu_ptr + i + 1, mask=ok, other=0) - tl.load(cu_ptr + i, mask=ok, other=0)
    return i, (lens + Q - 1) // Q


@triton.jit
def _chunk_of(cu_ptr, c, S, Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, chunk index inside it) of batch chunk c; sequence == S for unused slots."""
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    incl = tl.cumsum(nch, axis=0)
    seq = tl.sum(((incl <= c) & (i < S)).to(tl.int32), axis=0)
    return seq, c - tl.sum(tl.where(i == seq, incl - nch, 0), axis=0)


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr,
    A_ptr,
    bias_ptr,
    cu_ptr,
    bounds_ptr,
    acum_ptr,
    delta_ptr,
    w_ptr,
    atot_ptr,
    S,
    H,
    T,
    sdt_t,
    sdt_h,
    Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Per (chunk, head): bounds, a_t, delta_t, w_t = exp(a_last - a_t) delta_t and a_last.

    Unused slots get the empty range (0, 0), which every later kernel skips.
    """
    c, h = tl.program_id(0), tl.program_id(1)
    seq, chunk_in_seq = _chunk_of(cu_ptr, c, S, Q, BLOCK_S)
    valid = seq < S
    c_start = tl.load(cu_ptr + seq, mask=valid, other=0) + chunk_in_seq * Q
    c_end = tl.minimum(c_start + Q, tl.load(cu_ptr + seq + 1, mask=valid, other=0))
    c_start = tl.where(valid, c_start, 0)
    c_end = tl.where(valid, c_end, 0)
    if h == 0:
        tl.store(bounds_ptr + 2 * c, c_start)
        tl.store(bounds_ptr + 2 * c + 1, c_end)
    t = c_start + tl.arange(0, Q)
    ok = t < c_end
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=ok, other=0.0).to(tl.float32)
    delta = tl.where(ok, softplus(dt + bias), 0.0)
    a = tl.cumsum(delta * A, axis=0)
    a_last = tl.sum(delta * A, axis=0)
    row = h.to(tl.int64) * T + t
    tl.store(acum_ptr + row, a, mask=ok)
    tl.store(delta_ptr + row, delta, mask=ok)
    tl.store(w_ptr + row, tl.exp(a_last - a) * delta, mask=ok)
    tl.store(atot_ptr + c * H + h, a_last)


@triton.jit
def _state_pass_kernel(
    x_ptr,
    B_ptr,
    w_ptr,
    atot_ptr,
    init_ptr,
    states_ptr,
    final_ptr,
    cu_ptr,
    S,
    H,
    P,
    N,
    T,
    sx_t,
    sx_h,
    sB_t,
    Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_INIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One sequence, one head, one (P, N) tile: S_start of each of its chunks, then the final S."""
    pb, nb, sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, h = sh // H, sh % H
    start, end = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    first_chunk = tl.sum(tl.where(i < s, nch, 0), axis=0)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    pn_mask = (p < P)[:, None] & (n < N)[None, :]
    hpn_off = h * P * N + p[:, None] * N + n[None, :]  # offset inside one (H, P, N) state
    if HAS_INIT:
        state = tl.load(init_ptr + s.to(tl.int64) * H * P * N + hpn_off, mask=pn_mask, other=0.0)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    QB = Q // BLOCK_Q  # token blocks per chunk (constexpr)
    n_blocks = tl.cdiv(end - start, BLOCK_Q)
    for kb in range(0, n_blocks):
        k_in = kb % QB
        chunk = first_chunk + kb // QB
        # tl.where, not &: the interpreter rejects masks mixing scalar and vector booleans
        tl.store(states_ptr + chunk.to(tl.int64) * H * P * N + hpn_off, state, mask=tl.where(k_in == 0, pn_mask, False))
        t = start + kb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        t_ok = t < end
        w = tl.load(w_ptr + h.to(tl.int64) * T + t, mask=t_ok, other=0.0)
        xk = tl.load(
            x_ptr + t[:, None].to(tl.int64) * sx_t + h * sx_h + p[None, :],
            mask=t_ok[:, None] & (p < P)[None, :],
            other=0.0,
        )
        Bk = tl.load(B_ptr + t[:, None] * sB_t + n[None, :], mask=t_ok[:, None] & (n < N)[None, :], other=0.0)
        acc += dot(tl.trans(xk), (Bk.to(tl.float32) * w[:, None]).to(xk.dtype), DOT_F32)
        done = (k_in == QB - 1) | (kb == n_blocks - 1)  # the chunk's last block
        decay = tl.exp(tl.load(atot_ptr + chunk * H + h))
        state = tl.where(done, state * decay + acc, state)
        acc = tl.where(done, 0.0, acc)
    tl.store(final_ptr + s.to(tl.int64) * H * P * N + hpn_off, state, mask=pn_mask)


@triton.jit
def _chunk_state_kernel(
    x_ptr,
    B_ptr,
    w_ptr,
    bounds_ptr,
    local_ptr,
    H,
    P,
    N,
    T,
    sx_t,
    sx_h,
    sB_t,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """End state of chunk c started from zero: x^T (w * B) over its tokens."""
    c, pb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_start, c_end = tl.load(bounds_ptr + 2 * c), tl.load(bounds_ptr + 2 * c + 1)
    if c_start >= c_end:
        return
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(c_start, c_end, BLOCK_K):
        t = k0 + tl.arange(0, BLOCK_K)
        t_ok = t < c_end
        w = tl.load(w_ptr + h.to(tl.int64) * T + t, mask=t_ok, other=0.0)
        xk = tl.load(
            x_ptr + t[:, None].to(tl.int64) * sx_t + h * sx_h + p[None, :],
            mask=t_ok[:, None] & p_ok[None, :],
            other=0.0,
        )
        Bk = tl.load(B_ptr + t[:, None] * sB_t + n[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        acc += dot(tl.trans(xk), (Bk.to(tl.float32) * w[:, None]).to(xk.dtype), DOT_F32)
    tl.store(
        local_ptr + (c.to(tl.int64) * H + h) * P * N + p[:, None] * N + n[None, :],
        acc,
        mask=p_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _chunk_pass_kernel(
    local_ptr,
    atot_ptr,
    init_ptr,
    states_ptr,
    final_ptr,
    cu_ptr,
    S,
    H,
    PN,
    Q: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    """Chain one sequence's chunk states: states[c] = S entering chunk c; S <- exp(a) S + local."""
    tile, sh = tl.program_id(0), tl.program_id(1)
    s, h = sh // H, sh % H
    i, nch = _chunk_counts(cu_ptr, S, Q, BLOCK_S)
    first = tl.sum(tl.where(i < s, nch, 0), axis=0)
    count = tl.sum(tl.where(i == s, nch, 0), axis=0)
    off = tile * BLOCK + tl.arange(0, BLOCK)
    ok = off < PN
    if HAS_INIT:
        state = tl.load(init_ptr + (s.to(tl.int64) * H + h) * PN + off, mask=ok, other=0.0)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    # Loads do not depend on the carried state: issue them two chunks ahead of their use.
    c = first.to(tl.int64)
    loc0 = tl.load(local_ptr + (c * H + h) * PN + off, mask=tl.where(count > 0, ok, False), other=0.0)
    dec0 = tl.load(atot_ptr + c * H + h, mask=count > 0, other=0.0)
    loc1 = tl.load(local_ptr + ((c + 1) * H + h) * PN + off, mask=tl.where(count > 1, ok, False), other=0.0)
    dec1 = tl.load(atot_ptr + (c + 1) * H + h, mask=count > 1, other=0.0)
    for k in range(0, count):
        c = first.to(tl.int64) + k
        more = k + 2 < count
        loc2 = tl.load(local_ptr + ((c + 2) * H + h) * PN + off, mask=tl.where(more, ok, False), other=0.0)
        dec2 = tl.load(atot_ptr + (c + 2) * H + h, mask=more, other=0.0)
        tl.store(states_ptr + (c * H + h) * PN + off, state, mask=ok)
        state = state * tl.exp(dec0) + loc0
        loc0, dec0, loc1, dec1 = loc1, dec1, loc2, dec2
    tl.store(final_ptr + (s.to(tl.int64) * H + h) * PN + off, state, mask=ok)


# (BLOCK_M, BLOCK_K, BLOCK_P, warps, stages), chosen by their sm90 resource use (ptxas, Triton 3.9 on
# the CPU: 168-210 registers, no spills; BLOCK_P = 128 with 4 warps spills).  BLOCK_M = 32 runs on
# mma.sync, BLOCK_M >= 64 on wgmma.  The wgmma race vLLM filters (docs/kernels.md §4.7: a register-
# operand dot left in flight across the loop back-edge) needs one dot per iteration; here each
# iteration's C.B^T dot waits for the previous P.x dot, as in flash attention.  The benchmark
# still checks every config alone with NaN-poisoned outputs.
_OUT_CONFIGS = [
    (32, 64, 64, 4, 2),
    (32, 32, 64, 4, 3),
    (64, 32, 64, 4, 3),
    (128, 32, 64, 8, 3),
    (64, 32, 128, 8, 3),
]
_OUT_CONFIGS_F32 = [(32, 64, 64, 4, 2)]  # fp32 inputs (exact "ieee" dots): tests only
GPU_OUT_CONFIGS = {"ssd_chunk_output": list(_OUT_CONFIGS), "ssd_chunk_output_f32": list(_OUT_CONFIGS_F32)}
if _INTERPRET:  # one config (multi-config autotune needs a GPU driver); few, large-ish blocks
    _OUT_CONFIGS = _OUT_CONFIGS_F32 = [(32, 32, 32, 4, 1)]


@triton.jit
def _chunk_output_body(
    x_ptr,
    z_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    states_ptr,
    acum_ptr,
    delta_ptr,
    bounds_ptr,
    y_ptr,
    H,
    P,
    N,
    T,
    sx_t,
    sx_h,
    sz_t,
    sz_h,
    sB_t,
    sC_t,
    Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_Z: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    blocks_per_chunk = (Q + BLOCK_M - 1) // BLOCK_M
    c = tl.program_id(0) // blocks_per_chunk
    mb = tl.program_id(0) % blocks_per_chunk
    pb, h = tl.program_id(1), tl.program_id(2)
    c_start, c_end = tl.load(bounds_ptr + 2 * c), tl.load(bounds_ptr + 2 * c + 1)
    L = c_end - c_start
    if mb * BLOCK_M >= L:  # past the chunk's end, or an unused slot (0, 0)
        return
    # 64-bit scalar bases at the chunk start, small 32-bit offsets inside it (few registers).
    t0 = c_start.to(tl.int64)
    x_ptr += t0 * sx_t + h * sx_h
    B_ptr += t0 * sB_t
    C_ptr += t0 * sC_t
    h_row = h.to(tl.int64) * T + t0
    acum_ptr += h_row
    delta_ptr += h_row

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # relative to the chunk start
    r_ok = rows < L
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    a_i = tl.load(acum_ptr + rows, mask=r_ok, other=0.0)
    Cm = tl.load(C_ptr + rows[:, None] * sC_t + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    s0 = tl.load(
        states_ptr + (c.to(tl.int64) * H + h) * P * N + p[:, None] * N + n[None, :],
        mask=p_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    # Carried state: tf32 keeps more of the fp32 state than rounding it to bf16 would.
    if DOT_F32:
        acc = tl.dot(Cm.to(tl.float32), tl.trans(s0), input_precision="ieee")
    else:
        acc = tl.dot(Cm.to(tl.float32), tl.trans(s0), input_precision="tf32")
    acc *= tl.exp(a_i)[:, None]

    for j0 in range(0, tl.minimum((mb + 1) * BLOCK_M, L), BLOCK_K):
        cols = j0 + tl.arange(0, BLOCK_K)
        k_ok = cols < L
        a_j = tl.load(acum_ptr + cols, mask=k_ok, other=0.0)
        dl = tl.load(delta_ptr + cols, mask=k_ok, other=0.0)
        Bk = tl.load(B_ptr + cols[:, None] * sB_t + n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        xk = tl.load(x_ptr + cols[:, None] * sx_t + p[None, :], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        causal = rows[:, None] >= cols[None, :]
        decay = tl.exp(tl.where(causal, a_i[:, None] - a_j[None, :], float("-inf")))
        cb = dot(Cm, tl.trans(Bk), DOT_F32)
        acc += dot((cb * decay * dl[None, :]).to(xk.dtype), xk, DOT_F32)

    mask = r_ok[:, None] & p_ok[None, :]
    xr = tl.load(x_ptr + rows[:, None] * sx_t + p[None, :], mask=mask, other=0.0)
    acc += tl.load(D_ptr + h).to(tl.float32) * xr.to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + t0 * sz_t + h * sz_h + rows[:, None] * sz_t + p[None, :], mask=mask, other=0.0)
        acc *= silu(z.to(tl.float32))
    tl.store(y_ptr + (t0 * H + h) * P + rows[:, None] * (H * P) + p[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# Triton's own record of its autotuning, kept in its cache directory between runs (Triton >= 3.2).
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _autotuned(configs: list[tuple[int, int, int, int, int]]):
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_K": k, "BLOCK_P": p}, num_warps=w, num_stages=st)
            for m, k, p, w, st in configs
        ],
        key=["H", "P", "N", "Q"],
        **({} if _INTERPRET else _CACHE_RESULTS),
    )(_chunk_output_body)


_chunk_output_kernel = _autotuned(_OUT_CONFIGS)
_chunk_output_kernel_f32 = _autotuned(_OUT_CONFIGS_F32)


def output_autotuner(f32: bool = False) -> triton.runtime.Autotuner:
    """The output kernel's Triton autotuner (bf16/fp16 inputs, or fp32): its decisions go into a
    card's tuned table (kernels/tuned.py)."""
    return _chunk_output_kernel_f32 if f32 else _chunk_output_kernel


def _state_tiles(device: torch.device, P: int, N: int, programs: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of the sequential pass: smaller tiles until ~1.5 programs per SM.

    BLOCK_P <= 32 also keeps that dot off sm90 wgmma (M < 64), away from its loop race.
    """
    bp, bn = min(32, triton.next_power_of_2(P)), triton.next_power_of_2(N)
    if device.type != "cuda":
        return bp, bn
    # By the programs' power-of-two bucket (as BLOCK_S is), so the tiles, which are constexprs, change
    # only where a warm-up of every bucket has compiled them (runtime/batching/warmup.py).
    programs = triton.next_power_of_2(programs)
    # ~1.5 programs per SM: the pass is a chain of T / BLOCK_Q dependent steps, so one wave of
    # resident programs (2-3 fit per SM at ~170 registers) matters more than more, smaller tiles.
    want = 3 * torch.cuda.get_device_properties(device).multi_processor_count // 2
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
    bounds: torch.Tensor  # (slots, 2) int32: token range of each chunk, (0, 0) when unused
    acum: torch.Tensor  # (H, T) fp32: within-chunk cumulative log decay a_t
    delta: torch.Tensor  # (H, T) fp32: softplus(dt + dt_bias)
    w: torch.Tensor  # (H, T) fp32: exp(a_last - a_t) delta_t, token t's weight in its chunk's end state
    atot: torch.Tensor  # (slots, H) fp32: a_last of each chunk
    states: torch.Tensor  # (slots, H, P, N) fp32: state entering each chunk
    final: torch.Tensor  # (S, H, P, N) fp32
    y: torch.Tensor
    dot_f32: bool
    local: torch.Tensor | None = None  # "parallel": each chunk's own end state

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
        x=x,
        dt=dt,
        A=A.contiguous(),
        B=B,
        C=C,
        D=D.contiguous(),
        z=z,
        dt_bias=dt_bias.contiguous(),
        cu=cu,
        init=None if initial_state is None else initial_state.float().contiguous(),
        Q=Q,
        bounds=torch.empty(slots, 2, device=dev, dtype=torch.int32),
        acum=torch.empty(H, T, device=dev, dtype=f32),
        delta=torch.empty(H, T, device=dev, dtype=f32),
        w=torch.empty(H, T, device=dev, dtype=f32),
        atot=torch.empty(slots, H, device=dev, dtype=f32),
        states=torch.empty(slots, H, P, N, device=dev, dtype=f32),
        final=torch.empty(S, H, P, N, device=dev, dtype=f32),
        y=torch.empty(T, H, P, device=dev, dtype=x.dtype),
        dot_f32=x.dtype == f32 or (_INTERPRET and x.dtype == torch.bfloat16),
        local=torch.empty(slots, H, P, N, device=dev, dtype=f32) if parallel else None,
    )


def _launch_cumsum(w: _Scan) -> None:
    T, S, H, P, N = w.dims
    _chunk_cumsum_kernel[(w.slots, H)](
        w.dt,
        w.A,
        w.dt_bias,
        w.cu,
        w.bounds,
        w.acum,
        w.delta,
        w.w,
        w.atot,
        S,
        H,
        T,
        w.dt.stride(0),
        w.dt.stride(1),
        Q=w.Q,
        BLOCK_S=w.block_s,
        num_warps=4,
    )


def _launch_sequential(w: _Scan, block_q: int | None = None, warps: int = 4, stages: int = 2) -> None:
    T, S, H, P, N = w.dims
    bp, bn = _state_tiles(w.x.device, P, N, S * H)
    block_q = min(block_q or (16 if _INTERPRET else 128), w.Q)
    _state_pass_kernel[(triton.cdiv(P, bp), triton.cdiv(N, bn), S * H)](
        w.x,
        w.B,
        w.w,
        w.atot,
        w.init if w.init is not None else w.final,
        w.states,
        w.final,
        w.cu,
        S,
        H,
        P,
        N,
        T,
        w.x.stride(0),
        w.x.stride(1),
        w.B.stride(0),
        Q=w.Q,
        BLOCK_Q=block_q,
        BLOCK_P=bp,
        BLOCK_N=bn,
        BLOCK_S=w.block_s,
        HAS_INIT=w.init is not None,
        DOT_F32=w.dot_f32,
        num_warps=warps,
        num_stages=stages,
    )


def _launch_chunk_states(w: _Scan, block_p: int = 64, block_k: int = 64, warps: int = 4, stages: int = 3) -> None:
    T, S, H, P, N = w.dims
    assert w.local is not None
    if _INTERPRET:
        block_p, block_k = min(block_p, 32), min(block_k, 16)
    block_p = min(block_p, triton.next_power_of_2(P))
    _chunk_state_kernel[(w.slots, triton.cdiv(P, block_p), H)](
        w.x,
        w.B,
        w.w,
        w.bounds,
        w.local,
        H,
        P,
        N,
        T,
        w.x.stride(0),
        w.x.stride(1),
        w.B.stride(0),
        BLOCK_K=min(block_k, w.Q),
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N),
        DOT_F32=w.dot_f32,
        num_warps=warps,
        num_stages=stages,
    )


def _launch_chunk_pass(w: _Scan, block: int = 512, warps: int = 4) -> None:
    T, S, H, P, N = w.dims
    assert w.local is not None
    block = min(block, triton.next_power_of_2(P * N))
    _chunk_pass_kernel[(triton.cdiv(P * N, block), S * H)](
        w.local,
        w.atot,
        w.init if w.init is not None else w.final,
        w.states,
        w.final,
        w.cu,
        S,
        H,
        P * N,
        Q=w.Q,
        BLOCK=block,
        BLOCK_S=w.block_s,
        HAS_INIT=w.init is not None,
        num_warps=warps,
        num_stages=1,
    )


def _launch_output(w: _Scan) -> None:
    T, S, H, P, N = w.dims
    zz = w.z if w.z is not None else w.x
    kernel = _chunk_output_kernel_f32 if w.dot_f32 else _chunk_output_kernel

    def grid(meta):
        return (w.slots * triton.cdiv(w.Q, meta["BLOCK_M"]), triton.cdiv(P, meta["BLOCK_P"]), H)

    if w.x.is_cuda:
        tuned.seed_once(kernel, "ssd_chunk_output_f32" if w.dot_f32 else "ssd_chunk_output", w.x.device)
    kernel[grid](
        w.x,
        zz,
        w.B,
        w.C,
        w.D,
        w.states,
        w.acum,
        w.delta,
        w.bounds,
        w.y,
        H,
        P,
        N,
        T,
        w.x.stride(0),
        w.x.stride(1),
        zz.stride(0),
        zz.stride(1),
        w.B.stride(0),
        w.C.stride(0),
        Q=w.Q,
        BLOCK_N=triton.next_power_of_2(N),
        HAS_Z=w.z is not None,
        DOT_F32=w.dot_f32,
    )


def _run(args: tuple, variant: str, Q: int) -> _Scan:
    w = _prepare(*args, Q, variant == "parallel")
    _launch_cumsum(w)
    if variant == "parallel":
        _launch_chunk_states(w)
        _launch_chunk_pass(w)
    else:
        _launch_sequential(w)
    _launch_output(w)
    return w


VARIANTS = ("sequential", "parallel")
# What "auto" times on the first call of each shape bucket, and uses when it cannot time.
AUTO_CHOICES: tuple[tuple[str, int], ...] = (
    ("sequential", 128),
    ("sequential", 256),
    ("parallel", 128),
    ("parallel", 256),
)
_auto: dict[tuple, tuple[str, int]] = {}
measured: dict[str, list[Any]] = {}  # cache key -> [variant, Q], measured on this machine (measured_choices)


def _auto_key(x: torch.Tensor, B: torch.Tensor, z, init, cu: torch.Tensor) -> tuple:
    T, H, P = x.shape
    return auto_key_of(T, cu.numel() - 1, H, P, B.shape[-1], x.dtype, z is None, init is None, x.device)


def auto_key_of(
    T: int, S: int, H: int, P: int, N: int, dtype: torch.dtype, no_z: bool, no_init: bool, device: torch.device
) -> tuple:
    """The shape bucket `auto_choice` decides once for: the layer's dims and the powers of two above
    the forward's tokens and sequences."""
    return (H, P, N, dtype, no_z, no_init, triton.next_power_of_2(max(T, 1)), triton.next_power_of_2(S), device)


def _gpu_ms(fn, reps: int = 4) -> float:
    """GPU milliseconds of ``reps`` back-to-back calls, without host launch gaps: a spin kernel
    keeps the GPU busy while the host queues the calls (eager timing of a host-bound call would
    only measure the host)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(4_000_000)  # ~2 ms of spinning at H200 clocks
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


_TUNE_CACHE: TuneCache | None = None


def _tune_cache(device: torch.device) -> TuneCache:
    """The machine's record of earlier decisions (kernels/tune_cache.py): valid only for exactly
    this software and this GPU."""
    global _TUNE_CACHE
    if _TUNE_CACHE is None:
        props = torch.cuda.get_device_properties(device)
        identity = {
            "plamo2_tools": __version__,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "device": props.name,
            "capability": f"{props.major}.{props.minor}",
        }
        _TUNE_CACHE = TuneCache("ssd_chunk_scan", identity)
    return _TUNE_CACHE


def _known_choice(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and (value[0], value[1]) in AUTO_CHOICES


def auto_choice(args: tuple) -> tuple[str, int]:
    """(variant, Q) for these inputs: the fastest of AUTO_CHOICES on this shape bucket by GPU time,
    measured once per machine (a warm-up call that compiles and autotunes, then two interleaved
    rounds of 4 calls per choice; the better round counts) and kept in the tuning cache."""
    x, B, z, init, cu = args[0], args[3], args[6], args[9], args[8]
    key = _auto_key(x, B, z, init, cu)
    compile_watch.note("ssd_chunk_scan.choice", key[:-1])
    if key in _auto:
        return _auto[key]
    if _INTERPRET or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return AUTO_CHOICES[0]
    cache, ckey = _tune_cache(x.device), key_of(key[:-1])  # the device is the cache's identity
    known = cache.get(ckey, _known_choice)  # measured on this machine, by this software
    if known is not None:
        measured[ckey] = list(known)  # this card's own measurement: a table made here may keep it
    else:  # the card's shipped table, at the nearest token / sequence bucket
        table = tuned.table_for(tuned.current_card(x.device))
        shipped = table.entries("ssd_chunk_scan") if table is not None else {}
        known = tuned.nearest_choice(shipped, key[:-1], _known_choice)
    if known is not None:
        _auto[key] = (known[0], int(known[1]))
        return _auto[key]
    compile_watch.tuned()
    times: dict[tuple[str, int], float] = {}
    for choice in AUTO_CHOICES:
        try:
            _run(args, *choice)
        except Exception as e:  # a choice that cannot compile or launch here is skipped, loudly
            warnings.warn(f"ssd_chunk_scan: {choice} failed and is skipped: {e!r}", stacklevel=2)
            continue
        times[choice] = float("inf")
    for _ in range(2):  # interleaved rounds: clock or cache drift does not favour one choice
        for choice in times:
            times[choice] = min(times[choice], _gpu_ms(lambda choice=choice: _run(args, *choice)))
    if not times:
        raise RuntimeError("ssd_chunk_scan: no (variant, chunk size) choice runs on this device")
    _auto[key] = min(times, key=times.__getitem__)
    measured[ckey] = list(_auto[key])
    cache.put(ckey, list(_auto[key]))
    return _auto[key]


def measured_choices() -> dict[str, list[Any]]:
    """The picks measured on this machine, timed by this process or read back from its tuning
    cache (what `warmup --tuned-out` writes into a card's table; never those taken from a table)."""
    return dict(measured)


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
    """See ``Ops.ssd_chunk_scan``.  ``variant=None`` on CUDA picks (variant, Q) itself (module doc;
    ``chunk_size`` is then only a hint); an explicit variant runs at ``chunk_size``."""
    args = (x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_state)
    if variant is None and x.device.type == "cuda" and not _INTERPRET:
        variant, chunk_size = auto_choice(args)
    variant = variant or VARIANTS[0]
    assert variant in VARIANTS, variant
    w = _run(args, variant, chunk_size)
    return w.y, w.final
