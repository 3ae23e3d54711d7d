"""PLaMo 3's RoPE per layer type: plain NeoX RoPE, or YaRN on the full-attention layers when
`rope_scaling_factor != 1` (docs/plamo3.md, "YaRN"), as vLLM's YaRNScalingRotaryEmbedding computes
it: the frequencies blend interpolation (base frequency / factor) and extrapolation with a linear
ramp between two correction dimensions, and cos/sin are scaled by 0.1 ln(factor) + 1."""

from __future__ import annotations

import math

import torch

from .config import Rope


def correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension whose wavelength fits `rotations` turns into the original context."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(dim: int, rope: Rope) -> tuple[torch.Tensor, float]:
    """(float64 inverse frequencies (dim/2,), cos/sin scale)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if not rope.is_yarn:
        return extrapolation, 1.0
    assert rope.original_max_positions is not None
    interpolation = 1.0 / (rope.yarn_factor * pos_freqs)
    low = correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_positions)
    high = correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_positions)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    if low == high:
        high += 0.001  # vLLM's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
    freqs = interpolation * (1 - keep) + extrapolation * keep
    scale = 0.1 * math.log(rope.yarn_factor) + 1.0 if rope.yarn_factor > 1 else 1.0
    return freqs, scale
