"""Inference state of one rank for a batch of S sequences: per Mamba layer a conv state and a
float32 SSM state, per attention layer a KV cache.

The KV cache keeps every position (S, capacity, Hkv_r, d); sliding-window layers simply attend to
the last `window` keys of it, which is HF's truncated cache seen through a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import Plamo2Config
from ..model.tensors import RankSizes

Tensor = torch.Tensor


@dataclass
class LayerState:
    conv: Tensor | None = None  # (S, I/tp, K-1): last K-1 raw conv inputs, oldest first
    ssm: Tensor | None = None  # (S, Hm/tp, d, N) float32
    k: Tensor | None = None  # (S, capacity, Hkv_r, d)
    v: Tensor | None = None

    def select(self, index: Tensor) -> LayerState:
        """The state of a subset of sequences (a copy)."""
        return LayerState(*(None if t is None else t[index] for t in (self.conv, self.ssm, self.k, self.v)))

    def rows(self, start: int, stop: int) -> LayerState:
        """Sequences [start, stop) as views (no copy): static addresses for CUDA graphs."""
        return LayerState(*(None if t is None else t[start:stop] for t in (self.conv, self.ssm, self.k, self.v)))

    def load(self, slots: Tensor, part: LayerState) -> None:
        """Put the states of `part` (its first prompt positions of KV) into rows `slots`."""
        for mine, theirs in ((self.conv, part.conv), (self.ssm, part.ssm)):
            if mine is not None and theirs is not None:
                mine[slots] = theirs
        for mine, theirs in ((self.k, part.k), (self.v, part.v)):
            if mine is not None and theirs is not None:
                mine[slots, : theirs.shape[1]] = theirs

    def move(self, src: int, dst: int) -> None:
        """Copy sequence row `src` to row `dst` (slot compaction)."""
        for t in (self.conv, self.ssm, self.k, self.v):
            if t is not None:
                t[dst].copy_(t[src])

    def update(self, index: Tensor, part: LayerState) -> None:
        for mine, theirs in ((self.conv, part.conv), (self.ssm, part.ssm), (self.k, part.k), (self.v, part.v)):
            if mine is not None:
                mine[index] = theirs


def new_states(
    cfg: Plamo2Config,
    layers: list[int],
    sizes: RankSizes,
    batch: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device,
    ssm_dtype: torch.dtype = torch.float32,
) -> dict[int, LayerState]:
    d = cfg.hidden_size_per_head
    states = {}
    for i in layers:
        if cfg.layer_is_mamba[i]:
            inner = sizes.mamba_inner(cfg)
            states[i] = LayerState(
                conv=torch.zeros(batch, inner, cfg.mamba_d_conv - 1, dtype=dtype, device=device),
                ssm=torch.zeros(batch, sizes.mamba_heads, d, cfg.mamba_d_state, dtype=ssm_dtype, device=device),
            )
        else:
            shape = (batch, capacity, sizes.kv_heads, d)
            states[i] = LayerState(
                k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device)
            )
    return states
