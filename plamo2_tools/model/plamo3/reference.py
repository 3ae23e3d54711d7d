"""The reference forward: PLaMo 3 in plain PyTorch on the unsharded HF checkpoint, step by step as
docs/plamo3.md writes it, with either window convention.  The oracle verify trusts, so it is
written to be read: explicit masks, weights streamed one layer at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import reference_ops as ops
from ..plamo import NORM_OFFSETS
from ..plamo_reference import reference_logits as plamo_reference_logits
from .config import QK_NORM_OFFSET, Plamo3Config
from .rope import inv_freq


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, scale: float) -> torch.Tensor:
    """NeoX rotate-half RoPE over the whole head dim.  x: (T, H, d)."""
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * freqs.to(x.device)[None, :]
    cos = (torch.cat([angles.cos(), angles.cos()], -1) * scale)[:, None, :].to(x.dtype)
    sin = (torch.cat([angles.sin(), angles.sin()], -1) * scale)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention_mixer(
    a: torch.Tensor, w: dict[str, torch.Tensor], cfg: Plamo3Config, layer: int, convention: str
) -> torch.Tensor:
    T = a.shape[0]
    H, K, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (a @ w["qkv_proj.weight"].T).split([H * d, K * d, K * d], dim=-1)
    # One [d] scale shared by every head, over head_dim, before RoPE.
    q = ops.rms_norm(q.reshape(T, H, d), QK_NORM_OFFSET + w["q_norm.weight"], cfg.rms_norm_eps)
    k = ops.rms_norm(k.reshape(T, K, d), QK_NORM_OFFSET + w["k_norm.weight"], cfg.rms_norm_eps)
    freqs, scale = inv_freq(d, cfg.rope(layer))
    positions = torch.arange(T)
    q, k = rope(q, positions, freqs, scale), rope(k, positions, freqs, scale)
    o = ops.attention(q, k, v.reshape(T, K, d), scale=d**-0.5, window=cfg.window_keys(layer, convention))
    return o.reshape(T, H * d) @ w["o_proj.weight"].T


def decoder_layer(
    h: torch.Tensor, w: dict[str, torch.Tensor], cfg: Plamo3Config, layer: int, convention: str
) -> torch.Tensor:
    eps = cfg.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return ops.rms_norm(x, NORM_OFFSETS[name] + w[f"{name}.weight"], eps)

    mixer_w = {k.removeprefix("mixer."): v for k, v in w.items() if k.startswith("mixer.")}
    h = h + norm(attention_mixer(norm(h, "pre_mixer_norm"), mixer_w, cfg, layer, convention), "post_mixer_norm")
    gate, up = (norm(h, "pre_mlp_norm") @ w["mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
    return h + norm((F.silu(gate) * up) @ w["mlp.down_proj.weight"].T, "post_mlp_norm")


@torch.no_grad()
def reference_logits(
    ckpt: Any,  # model.checkpoint.HFCheckpoint
    sequences: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    window_convention: str = "hf",
) -> list[torch.Tensor]:
    """float32 CPU logits (T_i, V) for each token sequence, computed in `dtype` on `device`."""
    cfg: Plamo3Config = ckpt.config
    # PFN's ports scale the embeddings by sqrt(D) when the config says so (vLLM 0.26 ignores the key).
    scale = cfg.hidden_size**0.5 if cfg.scale_embedding else None
    layer = lambda h, w, i: decoder_layer(h, w, cfg, i, window_convention)  # noqa: E731
    return plamo_reference_logits(ckpt, sequences, dtype, device, layer, scale)
