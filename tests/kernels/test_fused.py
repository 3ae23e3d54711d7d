"""The fused decoder-layer ops (norm + add + norm, the B/C/dt norms, q/k norm + RoPE + KV writes)
of every backend against float64 compositions of the reference ops."""

from __future__ import annotations

import torch
from kernel_matrix import DEVICE
from test_ops import TOL, d64, randn, rel_err

from plamo2_tools.model import reference_ops as ref


def rope64(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE in float64 over (T, H, d)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_norm_add_norm(case) -> None:
    ops, dtype = case
    x, res = randn(7, 96, dtype=dtype), randn(7, 96, dtype=dtype) * 3
    w1, w2 = 1 + 0.3 * randn(96), 1 + 0.3 * randn(96)
    y, r = ops.norm_add_norm(x, w1, res, w2, 1e-6)
    x64, res64, w164, w264 = d64(x, res, w1, w2)
    r64 = ref.rms_norm(x64, w164, 1e-6) + res64
    assert y.dtype == dtype and r.dtype == dtype and y.shape == r.shape == (7, 96)
    assert rel_err(r, r64) < TOL[dtype]
    assert rel_err(y, ref.rms_norm(r64, w264, 1e-6)) < TOL[dtype]


def test_bcdt_rms_norm(case) -> None:
    ops, dtype = case
    N, R = 16, 32
    bcdt = randn(5, 2 * N + R, dtype=dtype) * 2
    wB, wC, wdt = 1 + 0.3 * randn(N), 1 + 0.3 * randn(N), 1 + 0.3 * randn(R)
    B, C, dt = ops.bcdt_rms_norm(bcdt, wB, wC, wdt, 1e-6)
    (x64,) = d64(bcdt)
    for got, part, w in ((B, x64[:, :N], wB), (C, x64[:, N : 2 * N], wC), (dt, x64[:, 2 * N :], wdt)):
        assert got.dtype == dtype and got.is_contiguous()
        assert rel_err(got, ref.rms_norm(part, *d64(w), 1e-6)) < TOL[dtype]


def test_qk_norm_rope_writes_the_cache(case) -> None:
    from plamo2_tools.model.forward import rope_cos_sin

    ops, dtype = case
    T, Hq, Hkv, d, theta = 6, 4, 2, 32, 10000.0
    qkv = randn(T, (Hq + 2 * Hkv) * d, dtype=dtype) * 2
    qw, kw = 1 + 0.3 * randn(Hq, d), 1 + 0.3 * randn(Hkv, d)
    seq = torch.tensor([0, 0, 1, 2, 2, 2], device=DEVICE)
    pos = torch.tensor([5, 6, 0, 1000, 1001, 9_000_000], device=DEVICE)  # RoPE angles far from 0
    cos, sin = rope_cos_sin(pos, d, theta, torch.float32)
    k_cache = torch.zeros(3, 8, Hkv, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slot = torch.tensor([5, 6, 0, 1, 2, 3], device=DEVICE)  # cache rows (the tables carry the angles)
    q = ops.qk_norm_rope(qkv, qw, kw, 1e-6, cos, sin, k_cache, v_cache, seq, slot)
    (x64,) = d64(qkv)
    q64, k64, v64 = x64.split([Hq * d, Hkv * d, Hkv * d], -1)
    want_q = rope64(ref.rms_norm(q64.reshape(T, Hq, d), *d64(qw), 1e-6), pos.cpu(), theta)
    want_k = rope64(ref.rms_norm(k64.reshape(T, Hkv, d), *d64(kw), 1e-6), pos.cpu(), theta)
    assert q.shape == (T, Hq, d) and q.dtype == dtype
    assert rel_err(q, want_q) < TOL[dtype]
    s, p = seq.cpu(), slot.cpu()
    assert rel_err(k_cache[s, p], want_k) < TOL[dtype]
    assert torch.equal(v_cache[s, p].cpu(), v64.reshape(T, Hkv, d).to(dtype))
    written = torch.zeros(3, 8, dtype=torch.bool)
    written[s, p] = True
    assert not k_cache.cpu()[~written].any() and not v_cache.cpu()[~written].any()  # nothing else touched
