"""Triton backend of ``plamo2_tools.kernels.Ops`` (same signatures as ``torch_ops``)."""

from __future__ import annotations

import torch

from plamo2_tools.kernels import torch_ops
from plamo2_tools.kernels.attention import decode_attention
from plamo2_tools.kernels.conv1d import causal_conv1d, causal_conv1d_update
from plamo2_tools.kernels.fused import bcdt_rms_norm, norm_add_norm, qk_norm_rope
from plamo2_tools.kernels.gemv import linear
from plamo2_tools.kernels.norm import head_rms_norm, rms_norm
from plamo2_tools.kernels.ssd import ssd_chunk_scan
from plamo2_tools.kernels.state_update import ssd_state_update
from plamo2_tools.kernels.swiglu import silu_mul

__all__ = [
    "attention",
    "bcdt_rms_norm",
    "causal_conv1d",
    "causal_conv1d_update",
    "head_rms_norm",
    "linear",
    "norm_add_norm",
    "qk_norm_rope",
    "rms_norm",
    "silu_mul",
    "ssd_chunk_scan",
    "ssd_state_update",
]


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Pure decode (one query per sequence, i.e. Tq == S) runs the split-K Triton kernel; any
    batch with prefill goes to SDPA, which wins there.  Every sequence has at least one query."""
    if q.shape[0] == kv_lens.shape[0]:
        return decode_attention(q, k_cache, v_cache, kv_lens, scale, window)
    return torch_ops.attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, scale, window)
