"""One rank of PLaMo 3: the decoder layers of its PP stage with TP-sharded weights, exactly the
tensors `convert` wrote for it (vLLM 0.26's Plamo3ForCausalLM per-rank state).  Every layer is
PLaMo's four-norm layer (model/forward.py) around an attention mixer; sliding layers see the
window of the chosen convention, and every layer type has its own RoPE table (YaRN on the full
layers when the config asks for it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..forward import (
    Batch,
    Comm,
    KVCache,
    RankModel,
    plamo_layers,
    rope_cos_sin,
)
from .config import Plamo3Config
from .rope import inv_freq
from .tensors import RankSizes

Tensor = torch.Tensor


class AttentionMixer:
    def __init__(
        self,
        cfg: Plamo3Config,
        w: dict[str, Tensor],
        sizes: RankSizes,
        layer: int,
        ops: Any,
        comm: Comm,
        convention: str,
    ) -> None:
        self.cfg, self.ops, self.comm = cfg, ops, comm
        self.q_heads, self.kv_heads = sizes.q_heads, sizes.kv_heads
        self.qkv_proj, self.o_proj = w["qkv_proj.weight"], w["o_proj.weight"]
        # The fused q/k-norm + RoPE + cache-write kernel takes one scale row per head: PLaMo 3's
        # single [d] vector, repeated (a few KiB per layer).
        self.q_norm = w["q_norm.weight"].expand(self.q_heads, -1).contiguous()
        self.k_norm = w["k_norm.weight"].expand(self.kv_heads, -1).contiguous()
        self.window = cfg.window_keys(layer, convention)  # keys besides the query; None = full causal
        self.rope_kind = cfg.layer_types[layer]
        self.scale = cfg.head_dim**-0.5

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache.zeros(batch, capacity, self.kv_heads, self.cfg.head_dim, dtype, device)

    def __call__(self, a: Tensor, batch: Batch, state: KVCache, context: dict[Any, Any]) -> Tensor:
        T, d, ops = a.shape[0], self.cfg.head_dim, self.ops
        q = ops.qk_norm_rope(
            ops.linear(a, self.qkv_proj),
            self.q_norm,
            self.k_norm,
            self.cfg.rms_norm_eps,
            *context[self.rope_kind],
            state.k,
            state.v,
            batch.seq_index,
            batch.positions,
        )
        o = self.ops.attention(q, state.k, state.v, batch.cu_seqlens, batch.kv_lens, self.scale, self.window)
        return self.comm.all_reduce(self.ops.linear(o.reshape(T, self.q_heads * d), self.o_proj))


class Plamo3RankModel(RankModel):
    def embed_tokens(self, ids: Tensor) -> Tensor:
        h = super().embed_tokens(ids)
        # PFN's ports scale by sqrt(D) when the config says so (docs/plamo3.md §4.1; vLLM 0.26 ignores it).
        return h * self.cfg.hidden_size**0.5 if self.cfg.scale_embedding else h

    def place_rope(self, device: torch.device) -> None:
        """Each layer type's inverse frequencies, made once on the model's device: `prepare` also
        runs inside CUDA-graph capture, where a copy from (unpinned) host memory is refused."""
        cfg: Plamo3Config = self.cfg
        self.rope_freqs: dict[str, tuple[Tensor, float, float]] = {}
        for kind in {layer.mixer.rope_kind for layer in self.layers}:
            rope = cfg.rope_full if kind == "full_attention" else cfg.rope_sliding
            freqs, scale = inv_freq(cfg.head_dim, rope)
            self.rope_freqs[kind] = (freqs.to(device), scale, rope.theta)

    def prepare(self, batch: Batch) -> dict[Any, Any]:
        """One RoPE table per layer type on this stage (plain on sliding layers, YaRN-scaled on
        full ones when configured)."""
        d = self.cfg.head_dim
        return {
            kind: rope_cos_sin(batch.positions, d, theta, torch.float32, freqs, scale)
            for kind, (freqs, scale, theta) in self.rope_freqs.items()
        }


def build_rank_model(
    family: Any,
    cfg: Plamo3Config,
    stage: tuple[int, int],
    weights: dict[str, Tensor],
    ops: Any,
    comm: Comm,
    dtype: torch.dtype | None = None,
    window_convention: str = "hf",
) -> Plamo3RankModel:
    def mixer(i: int, w: dict[str, Tensor], sizes: RankSizes) -> AttentionMixer:
        return AttentionMixer(cfg, w, sizes, i, ops, comm, window_convention)

    layers, sizes = plamo_layers(family, cfg, stage, weights, ops, comm, mixer)
    if "lm_head.weight" in weights and not cfg.tie_word_embeddings:
        # vLLM's untied head holds extra rows after each rank's vocabulary block (zeros, never
        # loaded); the logits of this rank are its first vocab_rows.
        weights = {**weights, "lm_head.weight": weights["lm_head.weight"][: sizes.vocab_rows]}
    first = next(iter(weights.values()))
    model = Plamo3RankModel(
        cfg, layers, weights, ops, comm, (sizes.vocab_start, sizes.vocab_rows), dtype or first.dtype
    )
    model.place_rope(first.device)
    return model
