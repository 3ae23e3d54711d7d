"""Every oracle of reference_ops (and the reference's RoPE) against an independent formulation from
tests/model/independent.py, in float64 on fresh random inputs."""

from __future__ import annotations

import independent as ind
import pytest
import torch
import torch.nn.functional as F

from plamo2_tools.model import reference_ops
from plamo2_tools.model.plamo2 import reference

TOL = 1e-12


def rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < tol if a.numel() else True


# ---- RMSNorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 48), (3, 4, 16), (1, 1)])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm(shape: tuple[int, ...], eps: float) -> None:
    g = torch.Generator().manual_seed(100 * len(shape) + shape[-1])
    x, w = rand(g, *shape, scale=3.0), rand(g, shape[-1])
    assert_close(reference_ops.rms_norm(x, w, eps), F.rms_norm(x, (shape[-1],), w, eps))


def test_rms_norm_per_head_weight() -> None:
    # q/k norm: a (H, d) weight broadcast over tokens, normalising over d only.
    g = torch.Generator().manual_seed(3)
    x, w = rand(g, 5, 4, 16), rand(g, 4, 16)
    assert_close(reference_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), None, 1e-6) * w)


# ---- causal conv ----------------------------------------------------------------------------
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("T", [0, 1, 2, 3, 9])
def test_causal_conv1d_silu(T: int, K: int, with_state: bool) -> None:
    g = torch.Generator().manual_seed(100 * T + 10 * K + with_state)
    C = 6
    x, w = rand(g, T, C), rand(g, C, K)
    state = rand(g, C, K - 1) if with_state else None
    y, final = reference_ops.causal_conv1d_silu(x, w, state)
    history = torch.cat([state if with_state else torch.zeros(C, K - 1, dtype=x.dtype), x.T], 1)  # (C, K-1+T)
    if T:
        assert_close(y, F.silu(ind.causal_conv(x, w, state)))
    else:
        assert y.shape == (0, C)
    # The state is the last K-1 raw inputs, oldest first (it may reach back into the old state).
    assert_close(final, history[:, -(K - 1) :])


def test_causal_conv1d_chunks_chain() -> None:
    # Prefill in pieces with the carried state == prefill at once (what decode relies on).
    g = torch.Generator().manual_seed(5)
    x, w = rand(g, 11, 8), rand(g, 8, 4)
    whole, final = reference_ops.causal_conv1d_silu(x, w)
    a, s = reference_ops.causal_conv1d_silu(x[:4], w)
    b, s = reference_ops.causal_conv1d_silu(x[4:5], w, s)
    c, s = reference_ops.causal_conv1d_silu(x[5:], w, s)
    assert_close(torch.cat([a, b, c]), whole)
    assert_close(s, final)


# ---- SSD recurrence -------------------------------------------------------------------------
def ssd_inputs(g: torch.Generator, T: int, H: int, P: int, N: int, big_dt: bool) -> dict[str, torch.Tensor]:
    # big_dt: decays far from 1, so the state's history matters at every scale.
    dt_lo, dt_hi = (0.05, 2.0) if big_dt else (1e-3, 0.1)
    u = torch.rand(T, H, generator=g, dtype=torch.float64)
    return {
        "x": rand(g, T, H, P),
        "delta": dt_lo * (dt_hi / dt_lo) ** u,
        "A": -torch.exp(torch.rand(H, generator=g, dtype=torch.float64) * 2.8),
        "B": rand(g, T, N),
        "C": rand(g, T, N),
        "D": rand(g, H),
        "z": rand(g, T, H, P),
        "initial_state": rand(g, H, P, N),
    }


@pytest.mark.parametrize("big_dt", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize(("T", "chunk"), [(1, 1), (1, 4), (4, 4), (7, 3), (16, 4), (13, 8), (20, 32)])
def test_ssd_recurrence_vs_chunked_ssd(T: int, chunk: int, with_init: bool, big_dt: bool) -> None:
    g = torch.Generator().manual_seed(1000 * T + chunk + 7 * with_init + 13 * big_dt)
    H, P, N = 3, 4, 5
    i = ssd_inputs(g, T, H, P, N, big_dt)
    init = i["initial_state"] if with_init else None
    y, final = reference_ops.ssd_recurrence(i["x"], i["delta"], i["A"], i["B"], i["C"], i["D"], i["z"], init)
    y_ind, final_ind = ind.ssd_chunked(i["x"], i["delta"], i["A"], i["B"], i["C"], chunk, init)
    y_ind = (y_ind + i["D"][:, None] * i["x"]) * F.silu(i["z"])
    assert_close(y, y_ind)
    assert_close(final, final_ind)


def test_ssd_recurrence_without_gate() -> None:
    g = torch.Generator().manual_seed(9)
    i = ssd_inputs(g, 9, 2, 3, 4, big_dt=True)
    y, _ = reference_ops.ssd_recurrence(i["x"], i["delta"], i["A"], i["B"], i["C"], i["D"])
    y_ind, _ = ind.ssd_chunked(i["x"], i["delta"], i["A"], i["B"], i["C"], 4)
    assert_close(y, y_ind + i["D"][:, None] * i["x"])


def test_ssd_recurrence_empty_keeps_state() -> None:
    g = torch.Generator().manual_seed(2)
    i = ssd_inputs(g, 0, 2, 3, 4, big_dt=False)
    y, final = reference_ops.ssd_recurrence(
        i["x"], i["delta"], i["A"], i["B"], i["C"], i["D"], initial_state=i["initial_state"]
    )
    assert y.shape == (0, 2, 3)
    assert torch.equal(final, i["initial_state"])


# ---- attention ------------------------------------------------------------------------------
ATTENTION_CASES = [
    # (Tq, Tk, Hq, Hkv, window)
    (9, 9, 4, 4, None),
    (9, 9, 4, 1, None),
    (17, 17, 8, 2, None),
    (17, 17, 8, 2, 5),  # longer than the window: each query sees itself + 5 previous keys
    (17, 17, 6, 3, 0),  # window 0: only itself
    (12, 12, 4, 2, 11),  # window = T - 1: same as full causal
    (1, 17, 8, 2, 5),  # decode: one query at the last position
    (4, 17, 8, 4, 3),  # chunked prefill: the last 4 positions
]


@pytest.mark.parametrize(("Tq", "Tk", "Hq", "Hkv", "window"), ATTENTION_CASES)
def test_attention_vs_sdpa(Tq: int, Tk: int, Hq: int, Hkv: int, window: int | None) -> None:
    g = torch.Generator().manual_seed(Tq * 1000 + Tk * 10 + Hq + Hkv + (window or 0))
    d = 8
    q, k, v = rand(g, Tq, Hq, d, scale=2.0), rand(g, Tk, Hkv, d, scale=2.0), rand(g, Tk, Hkv, d)
    out = reference_ops.attention(q, k, v, scale=d**-0.5, window=window)
    assert_close(out, ind.sdpa(q, k, v, window))
    if Hkv < Hq:
        # PyTorch's own GQA expansion agrees, and tiled grouping (h -> h % Hkv) would not.
        o2 = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=ind.band_mask(Tq, Tk, window),
            enable_gqa=True,
        ).transpose(0, 1)
        assert_close(out, o2)
    if 1 < Hkv < Hq:
        tiled = torch.arange(Hq) % Hkv
        o3 = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k[:, tiled].transpose(0, 1),
            v[:, tiled].transpose(0, 1),
            attn_mask=ind.band_mask(Tq, Tk, window),
        ).transpose(0, 1)
        assert (out - o3).abs().max() > 1e-3


def test_band_mask_semantics() -> None:
    # The test's own mask, spelled out: query 5 with window 2 sees keys 3, 4, 5 (itself + 2).
    m = ind.band_mask(8, 8, 2)
    assert m[5].nonzero().flatten().tolist() == [3, 4, 5]
    assert m[0].nonzero().flatten().tolist() == [0]
    assert ind.band_mask(8, 8, None)[7].all()


# ---- RoPE -----------------------------------------------------------------------------------
@pytest.mark.parametrize("theta", [10000.0, 1e6])
@pytest.mark.parametrize("d", [8, 16, 128])
def test_rope_vs_complex_rotation(d: int, theta: float) -> None:
    g = torch.Generator().manual_seed(d)
    x = rand(g, 40, 3, d)
    pos = torch.arange(40)
    assert_close(reference.rope(x, pos, theta), ind.rope_complex(x, pos.double(), theta), 1e-11)


def test_rope_scores_depend_on_position_difference_only() -> None:
    # Why HF's pre-RoPE cache with re-applied relative positions equals vLLM's absolute RoPE.
    g = torch.Generator().manual_seed(4)
    q, k = rand(g, 1, 2, 16), rand(g, 1, 2, 16)

    def score(i: int, j: int) -> torch.Tensor:
        qi = reference.rope(q, torch.tensor([i]), 10000.0)
        kj = reference.rope(k, torch.tensor([j]), 10000.0)
        return (qi * kj).sum(-1)

    assert_close(score(7, 3), score(104, 100), 1e-10)
    assert (score(7, 3) - score(7, 4)).abs().max() > 1e-3
