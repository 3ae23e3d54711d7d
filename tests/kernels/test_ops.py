"""Every op of every backend against the float64 oracles of ``plamo2_tools.model.reference_ops``.

Shapes are tiny so that Triton's CPU interpreter stays fast; varlen batches are checked one
sequence at a time against the single-sequence oracles.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_matrix import DEVICE

from plamo2_tools.kernels import get_ops, torch_ops
from plamo2_tools.model import reference_ops as ref

# ||y - ref|| / ||ref|| bounds: bf16/fp16 outputs carry one rounding (~2e-3 / 3e-4 rms) plus
# rounded intermediates (stored residuals, states); fp32 only accumulation-order noise.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rel_err(y: torch.Tensor, ref_y: torch.Tensor) -> float:
    y = y.double().cpu()
    assert torch.isfinite(y).all(), "non-finite output (unwritten elements are NaN-poisoned)"
    return ((y - ref_y).norm() / ref_y.norm()).item()


def d64(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().double().cpu() for t in ts]


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)


# ---------------------------------------------------------------- norms and SwiGLU


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(case, with_residual: bool) -> None:
    ops, dtype = case
    x, res = randn(7, 96, dtype=dtype), randn(7, 96, dtype=dtype) * 3
    w = 1 + 0.3 * randn(96)
    y, r = ops.rms_norm(x, w, 1e-6, res if with_residual else None)
    x64, res64, w64 = d64(x, res, w)
    r64 = x64 + res64 if with_residual else x64
    assert y.dtype == x.dtype and r.dtype == x.dtype
    assert rel_err(r, r64) < TOL[dtype]
    assert rel_err(y, ref.rms_norm(r64, w64, 1e-6)) < TOL[dtype]


def test_head_rms_norm(case) -> None:
    ops, dtype = case
    x, w = randn(5, 3, 32, dtype=dtype) * 2, 1 + 0.3 * randn(3, 32)
    y = ops.head_rms_norm(x, w, 1e-6)
    x64, w64 = d64(x, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref.rms_norm(x64, w64, 1e-6)) < TOL[dtype]


def test_silu_mul(case) -> None:
    ops, dtype = case
    x = randn(6, 2 * 80, dtype=dtype) * 2
    (x64,) = d64(x)
    y = ops.silu_mul(x)
    assert y.shape == (6, 80) and y.dtype == dtype
    assert rel_err(y, F.silu(x64[:, :80]) * x64[:, 80:]) < TOL[dtype]


# ---------------------------------------------------------------- causal conv1d

K = 4


def conv_oracle(x, w, cu, state, has_init):
    """Per-sequence float64 reference: y (T, C) and final states (S, C, K-1)."""
    x64, w64, st64 = d64(x, w, state)
    ys, finals = [], []
    for s in range(len(cu) - 1):
        init = st64[s] if has_init is not None and bool(has_init[s]) else None
        y, f = ref.causal_conv1d_silu(x64[cu[s] : cu[s + 1]], w64, init)
        ys.append(y)
        finals.append(f)
    return torch.cat(ys), torch.stack(finals)


@pytest.mark.parametrize(
    "lens,use_state",
    [([1], False), ([9], True), ([2, 1, 7, 20, 3], True), ([2, 1, 7, 20, 3], False)],
)
def test_causal_conv1d(case, lens: list[int], use_state: bool) -> None:
    ops, dtype = case
    Cch, cu = 24, seqlens(lens)
    x, w = randn(sum(lens), Cch, dtype=dtype), randn(Cch, K) * 0.5
    state = randn(len(lens), Cch, K - 1, dtype=dtype) if use_state else None
    has_init = torch.arange(len(lens), device=DEVICE) % 2 == 0 if use_state else None
    y_ref, final_ref = conv_oracle(x, w, cu.tolist(), state, has_init)
    y = ops.causal_conv1d(x, w, cu, state, has_init)
    assert y.dtype == dtype
    assert rel_err(y, y_ref) < TOL[dtype]
    if use_state:
        assert rel_err(state, final_ref) < TOL[dtype]


def test_causal_conv1d_in_pieces(case) -> None:
    """Prefill in pieces (2, 1, then 6 tokens) == one prefill, via the conv state."""
    ops, dtype = case
    Cch = 24
    x, w = randn(9, Cch, dtype=dtype), randn(Cch, K) * 0.5
    full_state = torch.zeros(1, Cch, K - 1, device=DEVICE, dtype=dtype)
    y_full = ops.causal_conv1d(x, w, seqlens([9]), full_state, torch.tensor([False]))
    state = torch.zeros(1, Cch, K - 1, device=DEVICE, dtype=dtype)
    pieces, t0 = [], 0
    for i, n in enumerate([2, 1, 6]):
        has = torch.tensor([i > 0], device=DEVICE)
        pieces.append(ops.causal_conv1d(x[t0 : t0 + n], w, seqlens([n]), state, has))
        t0 += n
    assert rel_err(torch.cat(pieces), d64(y_full)[0]) < TOL[dtype]
    assert rel_err(state, d64(full_state)[0]) < TOL[dtype]


def test_causal_conv1d_update(case) -> None:
    ops, dtype = case
    Bsz, Cch = 3, 40
    x, w, state = (
        randn(Bsz, Cch, dtype=dtype),
        randn(Cch, K) * 0.5,
        randn(Bsz, Cch, K - 1, dtype=dtype),
    )
    y_ref, final_ref = conv_oracle(x, w, list(range(Bsz + 1)), state, torch.ones(Bsz))
    y = ops.causal_conv1d_update(x, state, w)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(state, final_ref) < TOL[dtype]


# ---------------------------------------------------------------- SSD


def mamba_inputs(T: int, H: int, P: int, N: int, dtype: torch.dtype, gate: bool = True):
    """Realistic ranges: delta = softplus(dt + dt_bias) in ~[1e-3, 1e-1], A in -[1, 16]."""
    delta0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1)))
    dt_bias = torch.log(torch.expm1(delta0)).to(DEVICE)
    dt = (0.5 * randn(T, H)).to(dtype)
    A = -torch.empty(H, device=DEVICE).uniform_(1, 16)
    B, C = randn(T, N, dtype=dtype), randn(T, N, dtype=dtype)
    D = randn(H)
    x = randn(T, H, P, dtype=dtype)
    z = randn(T, H, P, dtype=dtype) if gate else None
    return x, dt, A, B, C, D, z, dt_bias


def ssd_oracle(x, dt, A, B, C, D, z, dt_bias, cu, init):
    x, dt, A, B, C, D, z, dt_bias, init = d64(x, dt, A, B, C, D, z, dt_bias, init)
    delta = F.softplus(dt + dt_bias)
    ys, finals = [], []
    for s in range(len(cu) - 1):
        sl = slice(cu[s], cu[s + 1])
        y, f = ref.ssd_recurrence(
            x[sl],
            delta[sl],
            A,
            B[sl],
            C[sl],
            D,
            None if z is None else z[sl],
            None if init is None else init[s],
        )
        ys.append(y)
        finals.append(f)
    return torch.cat(ys), torch.stack(finals)


@pytest.mark.parametrize(
    "lens,chunk,with_init,gate",
    [
        ([1], 16, False, True),  # T = 1
        ([37], 16, True, True),  # ragged last chunk
        ([5, 1, 21, 40, 13], 16, True, True),  # boundaries off the chunk grid, short sequences
        ([5, 1, 21, 40, 13], 32, False, False),
        ([70, 30], 64, True, True),
    ],
)
def test_ssd_chunk_scan(case, lens: list[int], chunk: int, with_init: bool, gate: bool) -> None:
    ops, dtype = case
    H, P, N = 3, 16, 16
    args = mamba_inputs(sum(lens), H, P, N, dtype, gate)
    cu = seqlens(lens)
    init = randn(len(lens), H, P, N) if with_init else None
    y_ref, final_ref = ssd_oracle(*args, cu.tolist(), init)
    y, final = ops.ssd_chunk_scan(*args, cu, init, chunk_size=chunk)
    assert y.dtype == dtype and final.dtype == torch.float32
    assert final.shape == (len(lens), H, P, N)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(final, final_ref) < TOL[dtype]


def test_ssd_chunk_scan_in_pieces(case) -> None:
    """Prefill of 29 tokens == 11 then 18 tokens carried by the final state (chunk 16)."""
    ops, dtype = case
    x, dt, A, B, C, D, z, dt_bias = mamba_inputs(29, 2, 16, 16, dtype)
    y_full, s_full = ops.ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, seqlens([29]), chunk_size=16)
    parts, state = [], None
    for sl in (slice(0, 11), slice(11, 29)):
        y, state = ops.ssd_chunk_scan(
            x[sl],
            dt[sl],
            A,
            B[sl],
            C[sl],
            D,
            z[sl],
            dt_bias,
            seqlens([sl.stop - sl.start]),
            state,
            chunk_size=16,
        )
        parts.append(y)
    assert rel_err(torch.cat(parts), d64(y_full)[0]) < TOL[dtype]
    assert rel_err(state, d64(s_full)[0]) < TOL[dtype]


@pytest.mark.parametrize("variant", ["sequential", "parallel"])
@pytest.mark.parametrize("lens,chunk", [([37], 16), ([5, 1, 0, 21, 40, 13], 16), ([70, 30], 32)])
def test_ssd_chunk_scan_variants(variant: str, lens: list[int], chunk: int) -> None:
    """Both ways of forming the chunk states (Triton only), incl. an empty sequence."""
    from plamo2_tools.kernels import ssd

    dtype = torch.float32
    args = mamba_inputs(sum(lens), 2, 16, 16, dtype)
    cu = seqlens(lens)
    init = randn(len(lens), 2, 16, 16)
    y_ref, final_ref = ssd_oracle(*args, cu.tolist(), init)
    y, final = ssd.ssd_chunk_scan(*args, cu, init, chunk_size=chunk, variant=variant)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(final, final_ref) < TOL[dtype]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", [False, True])
def test_ssd_state_update(case, state_dtype: torch.dtype, gate: bool) -> None:
    ops, dtype = case
    Bsz, H, P, N = 3, 4, 16, 16
    x, dt, A, B, C, D, z, dt_bias = mamba_inputs(Bsz, H, P, N, dtype, gate)
    state = randn(Bsz, H, P, N).to(state_dtype)
    y_ref, final_ref = ssd_oracle(x, dt, A, B, C, D, z, dt_bias, list(range(Bsz + 1)), state)
    y = ops.ssd_state_update(state, x, dt, A, B, C, D, z, dt_bias)
    tol = max(TOL[dtype], TOL[state_dtype])
    assert y.dtype == dtype and state.dtype == state_dtype
    assert rel_err(y, y_ref) < tol
    assert rel_err(state, final_ref) < tol


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (2, 2)])
def test_attention(case, window: int | None, hq: int, hkv: int) -> None:
    """Prefill (n = kv_len), decode (n = 1) and chunked prefill (1 < n < kv_len) in one batch."""
    ops, dtype = case
    d, Lmax = 32, 40
    kv_lens, n_q = [7, 20, 33, 1], [7, 1, 5, 1]
    cu = seqlens(n_q)
    q = randn(sum(n_q), hq, d, dtype=dtype)
    k_cache, v_cache = randn(4, Lmax, hkv, d, dtype=dtype), randn(4, Lmax, hkv, d, dtype=dtype)
    scale = d**-0.5
    out = ops.attention(q, k_cache, v_cache, cu, torch.tensor(kv_lens, device=DEVICE), scale, window)
    q64, k64, v64 = d64(q, k_cache, v_cache)
    c = cu.tolist()
    expect = torch.cat(
        [ref.attention(q64[c[s] : c[s + 1]], k64[s, :L], v64[s, :L], scale, window) for s, L in enumerate(kv_lens)]
    )
    assert out.dtype == dtype
    assert rel_err(out, expect) < TOL[dtype]


@pytest.mark.parametrize("n_q,kv_len", [(600, 600), (300, 650)])
def test_attention_long_window(case, n_q: int, kv_len: int) -> None:
    """Prefill / chunked prefill longer than the query blocks of the windowed SDPA path."""
    ops, dtype = case
    hq, hkv, d, window = 4, 1, 16, 7
    q = randn(n_q, hq, d, dtype=dtype)
    k_cache, v_cache = randn(1, kv_len, hkv, d, dtype=dtype), randn(1, kv_len, hkv, d, dtype=dtype)
    lens = torch.tensor([kv_len], device=DEVICE)
    out = ops.attention(q, k_cache, v_cache, seqlens([n_q]), lens, 0.25, window)
    q64, k64, v64 = d64(q, k_cache, v_cache)
    assert rel_err(out, ref.attention(q64, k64[0], v64[0], 0.25, window)) < TOL[dtype]


@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (6, 2), (2, 2)])
def test_attention_decode(case, window: int | None, hq: int, hkv: int) -> None:
    """One query per sequence (the Triton split-K path), ragged cache lengths incl. 1."""
    ops, dtype = case
    d, kv_lens = 32, [1, 6, 20, 37]
    S = len(kv_lens)
    q = randn(S, hq, d, dtype=dtype)
    k_cache, v_cache = randn(S, 40, hkv, d, dtype=dtype), randn(S, 40, hkv, d, dtype=dtype)
    lens = torch.tensor(kv_lens, device=DEVICE)
    out = ops.attention(q, k_cache, v_cache, seqlens([1] * S), lens, 0.3, window)
    q64, k64, v64 = d64(q, k_cache, v_cache)
    expect = torch.cat(
        [ref.attention(q64[s : s + 1], k64[s, :L], v64[s, :L], 0.3, window) for s, L in enumerate(kv_lens)]
    )
    assert rel_err(out, expect) < TOL[dtype]


# ---------------------------------------------------------------- dispatch


def test_get_ops_dispatch() -> None:
    assert get_ops("auto", "cpu") is torch_ops
    assert get_ops("auto") is torch_ops
    with pytest.raises(ValueError):
        get_ops("cuda")
