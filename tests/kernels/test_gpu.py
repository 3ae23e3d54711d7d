"""Real PLaMo 2 shapes in bf16 on a GPU (skipped without CUDA): Triton vs the float64 oracles."""

from __future__ import annotations

import pytest
import torch
from kernel_matrix import DEVICE
from test_ops import TOL, conv_oracle, mamba_inputs, randn, rel_err, seqlens, ssd_oracle

from plamo2_tools.kernels import get_ops
from plamo2_tools.model import reference_ops as ref

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("H", [32, 64])
def test_ssd_chunk_scan_plamo(H: int) -> None:
    """Both chunk sizes and both state-pass variants against one float64 oracle run."""
    from plamo2_tools.kernels import ssd

    lens = [700, 1, 300, 1047]
    args = mamba_inputs(sum(lens), H, 128, 64, BF16)
    init = randn(len(lens), H, 128, 64)
    cu = seqlens(lens)
    y_ref, final_ref = ssd_oracle(*args, cu.tolist(), init)
    for chunk in (128, 256):
        for variant in ssd.VARIANTS:
            y, final = ssd.ssd_chunk_scan(*args, cu, init, chunk_size=chunk, variant=variant)
            assert rel_err(y, y_ref) < TOL[BF16], (chunk, variant)
            assert rel_err(final, final_ref) < TOL[BF16], (chunk, variant)
    y, final = get_ops("triton").ssd_chunk_scan(*args, cu, init)  # run-time (variant, Q) pick
    assert rel_err(y, y_ref) < TOL[BF16] and rel_err(final, final_ref) < TOL[BF16]


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_ssd_state_update_plamo(state_dtype: torch.dtype) -> None:
    x, dt, A, B, C, D, z, dt_bias = mamba_inputs(64, 32, 128, 64, BF16)
    state = randn(64, 32, 128, 64).to(state_dtype)
    y_ref, final_ref = ssd_oracle(x, dt, A, B, C, D, z, dt_bias, list(range(65)), state)
    y = get_ops("triton").ssd_state_update(state, x, dt, A, B, C, D, z, dt_bias)
    assert rel_err(y, y_ref) < TOL[BF16]
    assert rel_err(state, final_ref) < TOL[BF16]


def test_causal_conv1d_plamo() -> None:
    lens, Cch = [1500, 2, 546], 4096
    x, w = randn(sum(lens), Cch, dtype=BF16), randn(Cch, 4) * 0.5
    state = randn(3, Cch, 3, dtype=BF16)
    has_init = torch.tensor([True, True, False], device=DEVICE)
    y_ref, final_ref = conv_oracle(x, w, seqlens(lens).tolist(), state, has_init)
    y = get_ops("triton").causal_conv1d(x, w, seqlens(lens), state, has_init)
    assert rel_err(y, y_ref) < TOL[BF16]
    assert rel_err(state, final_ref) < TOL[BF16]


@pytest.mark.parametrize("hq,hkv", [(16, 1), (32, 4)])
def test_decode_attention_plamo(hq: int, hkv: int) -> None:
    kv_lens = [1, 100, 2049, 3000, 4096]
    S = len(kv_lens)
    q = randn(S, hq, 128, dtype=BF16)
    k, v = randn(S, 4096, hkv, 128, dtype=BF16), randn(S, 4096, hkv, 128, dtype=BF16)
    out = get_ops("triton").attention(q, k, v, seqlens([1] * S), torch.tensor(kv_lens, device=DEVICE), 128**-0.5, 2048)
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    expect = torch.cat(
        [ref.attention(q64[s : s + 1], k64[s, :L], v64[s, :L], 128**-0.5, 2048) for s, L in enumerate(kv_lens)]
    )
    assert rel_err(out, expect) < TOL[BF16]
