"""The reference forward: PLaMo 2 in plain PyTorch on the unsharded HF checkpoint, step by step as
docs/model.md §3 writes it.  This is the oracle every later check trusts, so it is written
to be read, not to be fast: sequential Mamba recurrence, explicit attention masks, HF's sliding
window semantics, weights streamed one layer at a time so memory stays at one layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import reference_ops as ops
from ..plamo import NORM_OFFSETS
from ..plamo_reference import reference_logits as plamo_reference_logits
from .config import Plamo2Config

QK_NORM_EPS = 1e-6  # hard-coded in HF's remote code (vLLM uses rms_norm_eps; equal in every release)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE over the whole head dim.  x: (T, H, d)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def mamba_mixer(a: torch.Tensor, w: dict[str, torch.Tensor], cfg: Plamo2Config) -> torch.Tensor:
    T = a.shape[0]
    Hm, d, N = cfg.mamba_num_heads, cfg.hidden_size_per_head, cfg.mamba_d_state
    zx = (a @ w["in_proj.weight"].T).view(T, Hm, 2 * d)
    z, x = zx[..., :d], zx[..., d:]  # per head the gate comes first
    x, _ = ops.causal_conv1d_silu(x.reshape(T, Hm * d), w["conv1d.weight"][:, 0, :])
    bcdt = x @ w["bcdt_proj.weight"].T
    B, C, dt = bcdt[:, :N], bcdt[:, N : 2 * N], bcdt[:, 2 * N :]
    B = ops.rms_norm(B, w["B_norm_weight"], cfg.rms_norm_eps)
    C = ops.rms_norm(C, w["C_norm_weight"], cfg.rms_norm_eps)
    dt = ops.rms_norm(dt, w["dt_norm_weight"], cfg.rms_norm_eps) @ w["dt_proj.weight"].T
    delta = F.softplus(dt + w["dt_bias"])
    A = -torch.exp(w["A_log"])
    y, _ = ops.ssd_recurrence(x.view(T, Hm, d), delta, A, B, C, w["D"], z)
    return y.reshape(T, Hm * d) @ w["out_proj.weight"].T


def attention_mixer(a: torch.Tensor, w: dict[str, torch.Tensor], cfg: Plamo2Config, layer: int) -> torch.Tensor:
    T = a.shape[0]
    Hq, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size_per_head
    qkv = a @ w["qkv_proj.weight"].T
    q = qkv[:, : Hq * d].view(T, Hq, d)
    k = qkv[:, Hq * d : (Hq + Hkv) * d].view(T, Hkv, d)
    v = qkv[:, (Hq + Hkv) * d :].view(T, Hkv, d)
    q = ops.rms_norm(q, w["q_weight"], QK_NORM_EPS)  # (Hq, d) weight: one scale per head
    k = ops.rms_norm(k, w["k_weight"], QK_NORM_EPS)
    positions = torch.arange(T)
    base = cfg.rope_base(layer)  # PLaMo 2.1: per layer
    q, k = rope(q, positions, base), rope(k, positions, base)
    o = ops.attention(q, k, v, scale=d**-0.5, window=cfg.attention_window(layer))
    return o.reshape(T, Hq * d) @ w["o_proj.weight"].T


def decoder_layer(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: Plamo2Config, layer: int) -> torch.Tensor:
    eps = cfg.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return ops.rms_norm(x, NORM_OFFSETS[name] + w[f"{name}.weight"], eps)

    mixer_w = {k.removeprefix("mixer."): v for k, v in w.items() if k.startswith("mixer.")}
    a = norm(h, "pre_mixer_norm")
    if cfg.layer_is_mamba[layer]:
        m = mamba_mixer(a, mixer_w, cfg)
    else:
        m = attention_mixer(a, mixer_w, cfg, layer)
    h = h + norm(m, "post_mixer_norm")
    b = norm(h, "pre_mlp_norm")
    gate, up = (b @ w["mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
    f = (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return h + norm(f, "post_mlp_norm")


@torch.no_grad()
def reference_logits(
    ckpt: Any,  # model.checkpoint.HFCheckpoint
    sequences: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """float32 CPU logits (T_i, V) for each token sequence, computed in `dtype` on `device`."""
    cfg = ckpt.config
    return plamo_reference_logits(ckpt, sequences, dtype, device, lambda h, w, i: decoder_layer(h, w, cfg, i))
