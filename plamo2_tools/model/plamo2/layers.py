"""One rank of PLaMo 2: the decoder layers of its PP stage with TP-sharded weights, exactly the
tensors `convert` wrote for it (vLLM's Plamo2ForCausalLM per-rank state).  The hot operations go
through `kernels.Ops`; every row-parallel projection ends in a TP all-reduce (model/forward.py has
the embedding, the head and the four-norm layer every PLaMo family shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..forward import (
    Batch,
    Comm,
    KVCache,
    MixerState,
    RankModel,
    plamo_layers,
    rope_cos_sin,
)
from .config import Plamo2Config
from .tensors import RankSizes

Tensor = torch.Tensor


@dataclass
class MambaState(MixerState):
    """A Mamba layer's state: a fixed size per sequence, whatever its length."""

    conv: Tensor  # (S, I/tp, K-1): the last K-1 raw conv inputs, oldest first
    ssm: Tensor  # (S, Hm/tp, d, N) float32


class MambaMixer:
    def __init__(self, cfg: Plamo2Config, w: dict[str, Tensor], sizes: RankSizes, ops: Any, comm: Comm) -> None:
        self.cfg, self.ops, self.comm = cfg, ops, comm
        self.heads = sizes.mamba_heads
        self.inner = sizes.mamba_inner(cfg)
        self.in_proj = w["in_proj.weight"]  # [z of the rank's heads; x of the same heads]
        self.conv = w["conv1d.weight"][:, 0, :].contiguous()  # (I/tp, K)
        self.bcdt_proj = w["bcdt_proj.weight"]  # row-parallel: partial sums over the rank's channels
        self.dt_proj = w["dt_proj.weight"]
        self.A, self.D, self.dt_bias = w["A"], w["D"], w["dt_bias"]
        self.B_norm, self.C_norm, self.dt_norm = w["B_norm.weight"], w["C_norm.weight"], w["dt_norm.weight"]
        self.out_proj = w["out_proj.weight"]

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> MambaState:
        cfg = self.cfg
        return MambaState(
            conv=torch.zeros(batch, self.inner, cfg.mamba_d_conv - 1, dtype=dtype, device=device),
            ssm=torch.zeros(
                batch, self.heads, cfg.hidden_size_per_head, cfg.mamba_d_state, dtype=torch.float32, device=device
            ),
        )

    def __call__(self, a: Tensor, batch: Batch, state: MambaState, context: dict[Any, Any]) -> Tensor:
        ops, cfg = self.ops, self.cfg
        T, d, eps = a.shape[0], cfg.hidden_size_per_head, cfg.rms_norm_eps
        zx = ops.linear(a, self.in_proj)
        z, x = zx[:, : self.inner], zx[:, self.inner :]  # the conv kernels take a row stride: no copy
        if batch.decode:
            x = ops.causal_conv1d_update(x, state.conv, self.conv)
        else:
            x = ops.causal_conv1d(x, self.conv, batch.cu_seqlens, state.conv, batch.has_state)
        bcdt = self.comm.all_reduce(ops.linear(x, self.bcdt_proj))
        B, C, dt = ops.bcdt_rms_norm(bcdt, self.B_norm, self.C_norm, self.dt_norm, eps)  # one launch, not six
        dt = ops.linear(dt, self.dt_proj)
        x, z = x.view(T, self.heads, d), z.reshape(T, self.heads, d)
        if batch.decode:
            y = ops.ssd_state_update(state.ssm, x, dt, self.A, B, C, self.D, z, self.dt_bias)
        else:
            y, final = ops.ssd_chunk_scan(
                x,
                dt,
                self.A,
                B,
                C,
                self.D,
                z,
                self.dt_bias,
                batch.cu_seqlens,
                initial_state=state.ssm,
                chunk_size=cfg.mamba_chunk_size,
            )
            state.ssm.copy_(final)
        return self.comm.all_reduce(ops.linear(y.reshape(T, self.inner), self.out_proj))


class AttentionMixer:
    def __init__(
        self, cfg: Plamo2Config, w: dict[str, Tensor], sizes: RankSizes, layer: int, ops: Any, comm: Comm
    ) -> None:
        self.cfg, self.ops, self.comm = cfg, ops, comm
        d = cfg.hidden_size_per_head
        self.q_heads = sizes.q_heads
        self.kv_heads = sizes.kv_heads  # Hkv/tp, or 1 replicated head
        self.qkv_proj, self.o_proj = w["qkv_proj.weight"], w["o_proj.weight"]
        self.q_norm, self.k_norm = w["q_norm.weight"], w["k_norm.weight"]
        self.window = cfg.attention_window(layer)  # keys besides the query itself (HF's convention)
        self.rope_base = cfg.rope_base(layer)  # PLaMo 2.1: per layer
        self.scale = d**-0.5

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache.zeros(batch, capacity, self.kv_heads, self.cfg.hidden_size_per_head, dtype, device)

    def __call__(self, a: Tensor, batch: Batch, state: KVCache, context: dict[Any, Any]) -> Tensor:
        ops, cfg = self.ops, self.cfg
        T, d = a.shape[0], cfg.hidden_size_per_head
        # q/k norms, RoPE (fp32 tables) and the K/V cache writes in one launch (about 16 unfused).
        q = ops.qk_norm_rope(
            ops.linear(a, self.qkv_proj),
            self.q_norm,
            self.k_norm,
            cfg.rms_norm_eps,
            *context[self.rope_base],
            state.k,
            state.v,
            batch.seq_index,
            batch.positions,
        )
        o = ops.attention(q, state.k, state.v, batch.cu_seqlens, batch.kv_lens, self.scale, self.window)
        return self.comm.all_reduce(ops.linear(o.reshape(T, self.q_heads * d), self.o_proj))


class Plamo2RankModel(RankModel):
    def prepare(self, batch: Batch) -> dict[Any, Any]:
        """One RoPE table per base in use (PLaMo 2.1 picks the base per layer); Mamba layers use
        none, so only the attention layers' bases get a table."""
        bases = {layer.mixer.rope_base for layer in self.layers if isinstance(layer.mixer, AttentionMixer)}
        d = self.cfg.hidden_size_per_head
        return {b: rope_cos_sin(batch.positions, d, b, torch.float32) for b in bases}


def build_rank_model(
    family: Any,
    cfg: Plamo2Config,
    stage: tuple[int, int],
    weights: dict[str, Tensor],
    ops: Any,
    comm: Comm,
    dtype: torch.dtype | None = None,
) -> Plamo2RankModel:
    def mixer(i: int, w: dict[str, Tensor], sizes: RankSizes) -> Any:
        if cfg.layer_is_mamba[i]:
            return MambaMixer(cfg, w, sizes, ops, comm)
        return AttentionMixer(cfg, w, sizes, i, ops, comm)

    layers, sizes = plamo_layers(family, cfg, stage, weights, ops, comm, mixer)
    act = dtype or next(iter(weights.values())).dtype
    return Plamo2RankModel(cfg, layers, weights, ops, comm, (sizes.vocab_start, sizes.vocab_rows), act)
