"""One rank of PLaMo 2: the decoder layers of its PP stage with TP-sharded weights, exactly the
tensors `convert` wrote for it (vLLM's Plamo2ForCausalLM per-rank state), and the forward pass
over a packed batch.  The hot operations go through `kernels.Ops`; every row-parallel projection
and the vocab-parallel embedding end in a TP all-reduce, the logits in a TP all-gather.

The residual stream follows vLLM: each layer returns (hidden, residual) and the next norm adds
hidden into residual first, so the PP hand-over is that pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..errors import CheckpointError
from ..kernels import Ops
from ..model.config import Plamo2Config
from ..model.tensors import RankSizes, rank_sizes
from ..shards.manifest import Manifest
from .comm import Comm
from .state import LayerState

Tensor = torch.Tensor


@dataclass
class Batch:
    """One forward call: packed tokens of S sequences (a prefill chunk or one decode step)."""

    input_ids: Tensor  # (T,)
    positions: Tensor  # (T,) absolute positions
    seq_index: Tensor  # (T,) which sequence each token belongs to
    cu_seqlens: Tensor  # (S+1,) int32
    kv_lens: Tensor  # (S,) tokens of each sequence after this call
    has_state: Tensor  # (S,) bool: the sequence has earlier tokens in the state
    decode: bool  # every sequence has exactly one token and a state
    logits_index: Tensor | None = None  # token indices whose logits are wanted (None: all)


def load_rank_weights(manifest: Manifest, rank: int, device: torch.device) -> dict[str, Tensor]:
    """The tensors of one global rank, read with safetensors from its shard files."""
    weights: dict[str, Tensor] = {}
    for name in manifest.rank_files(rank):
        path = Path(manifest.path) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest for rank {rank})")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                weights[key] = f.get_tensor(key)
    expected = set(manifest.entries[rank])
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise CheckpointError(f"rank {rank}: shard keys differ from the manifest (missing {missing}, extra {extra})")
    return weights


def rope_cos_sin(positions: Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """NeoX rotate-half tables for (T,) positions, computed in float64: positions reach 10M."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class MambaMixer:
    def __init__(self, cfg: Plamo2Config, w: dict[str, Tensor], sizes: RankSizes, ops: Ops, comm: Comm) -> None:
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

    def __call__(self, a: Tensor, batch: Batch, state: LayerState) -> Tensor:
        ops, cfg = self.ops, self.cfg
        T, d, eps = a.shape[0], cfg.hidden_size_per_head, cfg.rms_norm_eps
        zx = F.linear(a, self.in_proj)
        z, x = zx[:, : self.inner], zx[:, self.inner :]  # the conv kernels take a row stride: no copy
        if batch.decode:
            x = ops.causal_conv1d_update(x, state.conv, self.conv)
        else:
            x = ops.causal_conv1d(x, self.conv, batch.cu_seqlens, state.conv, batch.has_state)
        bcdt = self.comm.all_reduce(F.linear(x, self.bcdt_proj))
        B, C, dt = ops.bcdt_rms_norm(bcdt, self.B_norm, self.C_norm, self.dt_norm, eps)  # one launch, not six
        dt = F.linear(dt, self.dt_proj)
        x, z = x.view(T, self.heads, d), z.reshape(T, self.heads, d)
        if batch.decode:
            y = ops.ssd_state_update(state.ssm, x, dt, self.A, B, C, self.D, z, self.dt_bias)
        else:
            y, final = ops.ssd_chunk_scan(
                x, dt, self.A, B, C, self.D, z, self.dt_bias, batch.cu_seqlens,
                initial_state=state.ssm, chunk_size=cfg.mamba_chunk_size,
            )  # fmt: skip
            state.ssm.copy_(final)
        return self.comm.all_reduce(F.linear(y.reshape(T, self.inner), self.out_proj))


class AttentionMixer:
    def __init__(
        self, cfg: Plamo2Config, w: dict[str, Tensor], sizes: RankSizes, layer: int, ops: Ops, comm: Comm
    ) -> None:
        self.cfg, self.ops, self.comm = cfg, ops, comm
        d = cfg.hidden_size_per_head
        self.q_heads = sizes.q_heads
        self.kv_heads = sizes.kv_heads  # Hkv/tp, or 1 replicated head
        self.qkv_proj, self.o_proj = w["qkv_proj.weight"], w["o_proj.weight"]
        self.q_norm, self.k_norm = w["q_norm.weight"], w["k_norm.weight"]
        self.window = cfg.attention_window(layer)
        self.scale = d**-0.5

    def __call__(self, a: Tensor, batch: Batch, state: LayerState, rope: tuple[Tensor, Tensor]) -> Tensor:
        ops, cfg = self.ops, self.cfg
        T, d = a.shape[0], cfg.hidden_size_per_head
        # q/k norms, RoPE (fp32 tables) and the K/V cache writes in one launch (about 16 unfused).
        q = ops.qk_norm_rope(
            F.linear(a, self.qkv_proj), self.q_norm, self.k_norm, cfg.rms_norm_eps, *rope,
            state.k, state.v, batch.seq_index, batch.positions,
        )  # fmt: skip
        o = ops.attention(q, state.k, state.v, batch.cu_seqlens, batch.kv_lens, self.scale, self.window)
        return self.comm.all_reduce(F.linear(o.reshape(T, self.q_heads * d), self.o_proj))


class DecoderLayer:
    def __init__(
        self, cfg: Plamo2Config, index: int, w: dict[str, Tensor], sizes: RankSizes, ops: Ops, comm: Comm
    ) -> None:
        self.cfg, self.index, self.ops, self.comm = cfg, index, ops, comm
        self.is_mamba = cfg.layer_is_mamba[index]
        mixer = {k.removeprefix("mixer."): v for k, v in w.items() if k.startswith("mixer.")}
        self.mixer = (
            MambaMixer(cfg, mixer, sizes, ops, comm)
            if self.is_mamba
            else AttentionMixer(cfg, mixer, sizes, index, ops, comm)
        )
        self.norms = {
            n: w[f"{n}.weight"] for n in ("pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm", "post_mlp_norm")
        }
        self.gate_up, self.down = w["mlp.gate_up_proj.weight"], w["mlp.down_proj.weight"]

    def __call__(
        self,
        h: Tensor,
        residual: Tensor | None,
        batch: Batch,
        state: LayerState,
        rope: tuple[Tensor, Tensor] | None,  # None in Mamba layers
        pending: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns the MLP output *before* its post-MLP norm, which the caller fuses with the next
        norm; `pending` is the previous layer's post-MLP norm weight still to apply to `h`."""
        ops, eps, norms = self.ops, self.cfg.rms_norm_eps, self.norms
        if pending is None:
            h, residual = ops.rms_norm(h, norms["pre_mixer_norm"], eps, residual)
        else:
            assert residual is not None
            h, residual = ops.norm_add_norm(h, pending, residual, norms["pre_mixer_norm"], eps)
        h = self.mixer(h, batch, state) if self.is_mamba else self.mixer(h, batch, state, rope)  # type: ignore[arg-type]
        h, residual = ops.norm_add_norm(h, norms["post_mixer_norm"], residual, norms["pre_mlp_norm"], eps)
        h = self.comm.all_reduce(F.linear(ops.silu_mul(F.linear(h, self.gate_up)), self.down))
        return h, residual


class RankModel:
    """The layers, embedding and head one global rank holds."""

    def __init__(
        self, cfg: Plamo2Config, stage: tuple[int, int], weights: dict[str, Tensor], ops: Ops, comm: Comm
    ) -> None:
        self.cfg, self.ops, self.comm = cfg, ops, comm
        info = comm.info
        self.sizes = rank_sizes(cfg, info.tp, info.tp_rank)  # the tensor table's split rules
        self.layers = []
        for i in range(*stage):
            prefix = f"model.layers.layers.{i}."
            w = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
            self.layers.append(DecoderLayer(cfg, i, w, self.sizes, ops, comm))
        # PP = 1 with tied embeddings stores only lm_head.weight (vLLM's state_dict dedup).
        self.embed = (
            weights.get("model.embed_tokens.weight", weights.get("lm_head.weight")) if info.is_first_stage else None
        )
        self.final_norm = weights.get("model.norm.weight")
        self.lm_head = weights.get("lm_head.weight")
        self.vocab_rows = self.sizes.vocab_rows
        self.dtype = (self.layers[0].gate_up if self.layers else next(iter(weights.values()))).dtype
        self.device = next(iter(weights.values())).device

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """Vocab-parallel lookup: rows outside this rank's block contribute zeros, then all-reduce."""
        assert self.embed is not None
        if self.comm.info.tp == 1:  # one lookup instead of five launches
            return self.embed[ids]
        local = ids - self.sizes.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        h = self.embed[local.clamp(0, self.vocab_rows - 1)] * inside[:, None].to(self.embed.dtype)
        return self.comm.all_reduce(h)

    def forward(self, batch: Batch, states: dict[int, LayerState]) -> Tensor | None:
        """Run this rank's part; the last stage returns float32 logits (n, V), others None."""
        info = self.comm.info
        T, D = batch.input_ids.shape[0], self.cfg.hidden_size
        if info.is_first_stage:
            h, residual = self.embed_tokens(batch.input_ids), None
        else:
            like = torch.empty(T, D, dtype=self.dtype, device=self.device)
            h, residual = self.comm.recv_prev([like, like])
        out = self.stage(batch, states, h, residual)
        if not info.is_last_stage:
            self.comm.send_next(list(out))
            return None
        return out[0]

    def stage(
        self, batch: Batch, states: dict[int, LayerState], h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, ...]:
        """The layers (and on the last stage the head) without the PP hand-over, so that a CUDA graph
        can hold them: (logits,) on the last stage, else the (hidden, residual) to send on."""
        cfg = self.cfg
        # One table per RoPE base in use (PLaMo 2.1 picks the base per layer: cfg.rope_base).
        # Mamba layers use none, so only the attention layers' bases get a table.
        bases = {cfg.rope_base(layer.index) for layer in self.layers if not layer.is_mamba}
        ropes = {b: rope_cos_sin(batch.positions, cfg.hidden_size_per_head, b, torch.float32) for b in bases}
        pending = None  # the previous layer's post-MLP norm, fused into the next norm
        for layer in self.layers:
            rope = ropes.get(cfg.rope_base(layer.index))
            h, residual = layer(h, residual, batch, states[layer.index], rope, pending)
            pending = layer.norms["post_mlp_norm"]
        assert residual is not None and pending is not None
        if not self.comm.info.is_last_stage:
            return self.ops.rms_norm(h, pending, cfg.rms_norm_eps)[0], residual
        h, _ = self.ops.norm_add_norm(h, pending, residual, self.final_norm, cfg.rms_norm_eps)
        if batch.logits_index is not None:
            h = h[batch.logits_index]
        logits = self.comm.all_gather(F.linear(h, self.lm_head).float(), dim=-1)
        return (logits[:, : cfg.vocab_size],)
