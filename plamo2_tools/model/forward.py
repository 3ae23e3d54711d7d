"""What a family's rank forward is made of and what the runtime asks of it.

The runtime (runtime/batching) drives a `RankModel`: one global rank's part of the model with
exactly the tensors `convert` wrote for it (vLLM's per-rank state), run over packed batches.  A
family builds one from its own layers (`Family.rank_model`); the blocks every PLaMo family shares
live here: the vocab-parallel embedding and head, the four-norm decoder layer whose post-MLP
norm is fused into the next layer's pre-norm, and NeoX RoPE tables.  The hot operations go
through `kernels.Ops` and the collectives through `Comm`, both handed in, so nothing here knows
about threads, processes or devices.

The residual stream follows vLLM: each layer returns (hidden, residual) and the next norm adds
hidden into residual first, so the PP hand-over is that pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from ..parallel import RankInfo
from .plamo import NORM_OFFSETS

Tensor = torch.Tensor
StateT = TypeVar("StateT", bound="MixerState")


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


class MixerState:
    """One layer's inference state for S sequences, as its mixer defines it (mlx-lm's cache objects
    are the model): a dataclass of tensors whose first dimension is the sequence.  Those named in
    `per_token` hold one entry per position in their second dimension (a KV cache of `capacity`
    positions); the others a fixed size per sequence (a Mamba state).  The runtime takes subsets,
    moves rows between slot pools and counts bytes only through the methods below, so a family's
    new kind of state (its own subclass, in its own folder) needs no change in the runtime.

    Subclasses are `@dataclass`es whose fields are exactly their tensors (`KVCache` here,
    `model/plamo2/layers.py:MambaState`)."""

    per_token: ClassVar[frozenset[str]] = frozenset()  # fields indexed (sequence, position, ...)

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def _map(self: StateT, fn: Callable[[Tensor], Tensor]) -> StateT:
        return type(self)(**{name: fn(t) for name, t in self.tensors().items()})

    def select(self: StateT, index: Tensor) -> StateT:
        """The state of a subset of sequences (a copy)."""
        return self._map(lambda t: t[index])

    def rows(self: StateT, start: int, stop: int) -> StateT:
        """Sequences [start, stop) as views (no copy): static addresses for CUDA graphs."""
        return self._map(lambda t: t[start:stop])

    def load(self, slots: Tensor, part: MixerState) -> None:
        """Put the states of `part` into rows `slots` (of a per-token tensor, its first positions)."""
        theirs = part.tensors()
        for name, mine in self.tensors().items():
            if name in self.per_token:
                mine[slots, : theirs[name].shape[1]] = theirs[name]
            else:
                mine[slots] = theirs[name]

    def move(self, src: int, dst: int) -> None:
        """Copy sequence row `src` to row `dst` (slot compaction)."""
        for t in self.tensors().values():
            t[dst].copy_(t[src])

    def update(self, index: Tensor, part: MixerState) -> None:
        """Write back the rows a `select(index)` copy has advanced."""
        theirs = part.tensors()
        for name, mine in self.tensors().items():
            mine[index] = theirs[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bytes_per_sequence(self) -> tuple[int, int]:
        """(fixed bytes, bytes per position) one sequence holds: what the auto batch size counts."""
        fixed = token = 0
        for name, t in self.tensors().items():
            if name in self.per_token:
                token += t.numel() * t.element_size() // max(1, t.shape[0] * t.shape[1])
            else:
                fixed += t.numel() * t.element_size() // max(1, t.shape[0])
        return fixed, token


@dataclass
class KVCache(MixerState):
    """An attention layer's keys and values at every position (a sliding-window layer attends to
    the last keys of it through its mask)."""

    k: Tensor  # (S, capacity, Hkv_r, d)
    v: Tensor
    per_token = frozenset({"k", "v"})

    @classmethod
    def zeros(
        cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


class Comm(Protocol):
    """The collectives a rank forward needs (runtime/rank/comm.py has the thread and torchrun ones)."""

    info: RankInfo

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather(self, x: Tensor, dim: int) -> Tensor: ...

    def send_next(self, tensors: list[Tensor]) -> None: ...

    def recv_prev(self, like: list[Tensor]) -> list[Tensor]: ...

    def broadcast_from_last(self, x: Tensor) -> Tensor: ...

    def barrier(self) -> None: ...


def rope_cos_sin(
    positions: Tensor, dim: int, theta: float, dtype: torch.dtype, inv_freq: Tensor | None = None, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """NeoX rotate-half tables for (T,) positions, computed in float64 (positions reach 10M).
    `inv_freq` (dim/2,) replaces theta's plain frequencies (YaRN); `scale` multiplies cos and sin."""
    if inv_freq is None:
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float64)[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


class Mixer(Protocol):
    """A layer's token mixer (attention, Mamba, ...): (normed hidden, batch, state, context) -> output,
    all-reduced over TP."""

    def __call__(self, a: Tensor, batch: Batch, state: MixerState, context: dict[Any, Any]) -> Tensor: ...

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> MixerState: ...


PLAMO_NORMS = tuple(NORM_OFFSETS)  # pre-mixer, post-mixer, pre-MLP, post-MLP


class PlamoLayer:
    """A PLaMo decoder layer: four RMS norms (offsets folded into the shards), a mixer and a SwiGLU
    MLP, with vLLM's deferred residual: it returns the MLP output *before* its post-MLP norm,
    which the caller fuses with the next norm (`pending` is the previous layer's post-MLP weight)."""

    def __init__(self, index: int, mixer: Mixer, w: dict[str, Tensor], eps: float, ops: Any, comm: Comm) -> None:
        self.index, self.mixer, self.eps, self.ops, self.comm = index, mixer, eps, ops, comm
        self.norms = {n: w[f"{n}.weight"] for n in PLAMO_NORMS}
        self.gate_up, self.down = w["mlp.gate_up_proj.weight"], w["mlp.down_proj.weight"]

    def __call__(
        self,
        h: Tensor,
        residual: Tensor | None,
        batch: Batch,
        state: MixerState,
        context: dict[Any, Any],
        pending: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        ops, eps, norms = self.ops, self.eps, self.norms
        if pending is None:
            h, residual = ops.rms_norm(h, norms["pre_mixer_norm"], eps, residual)
        else:
            assert residual is not None
            h, residual = ops.norm_add_norm(h, pending, residual, norms["pre_mixer_norm"], eps)
        h = self.mixer(h, batch, state, context)
        h, residual = ops.norm_add_norm(h, norms["post_mixer_norm"], residual, norms["pre_mlp_norm"], eps)
        h = self.comm.all_reduce(ops.linear(ops.silu_mul(ops.linear(h, self.gate_up)), self.down))
        return h, residual


def layer_weights(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors of one layer, names relative to its prefix."""
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def mixer_weights(w: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.removeprefix("mixer."): v for k, v in w.items() if k.startswith("mixer.")}


class RankModel:
    """One global rank: the embedding (first stage), the layers of its PP stage, the final norm and
    head (last stage), over packed batches.  What the runtime calls: `forward`, `stage` (what a
    CUDA graph holds), `embed_tokens`, `new_states`; `layers[i].index`, `dtype`, `device`,
    `hidden_size`.  A family subclass builds `layers` and may override `prepare` (per-forward
    tables its mixers share, e.g. RoPE)."""

    def __init__(
        self,
        cfg: Any,
        layers: list[PlamoLayer],
        weights: dict[str, Tensor],
        ops: Any,
        comm: Comm,
        vocab: tuple[int, int],
        dtype: torch.dtype,
        embed_name: str = "model.embed_tokens.weight",
        tied_alias: str = "lm_head.weight",
    ) -> None:
        self.cfg, self.layers, self.ops, self.comm = cfg, layers, ops, comm
        self.hidden_size, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.vocab_start, self.vocab_rows = vocab
        # A tied embedding may be stored only as lm_head.weight (vLLM's state_dict dedup).
        self.embed = weights.get(embed_name, weights.get(tied_alias))
        self.final_norm = weights.get("model.norm.weight")
        self.lm_head = weights.get("lm_head.weight")
        self.dtype = dtype
        self.device = next(iter(weights.values())).device

    def new_states(self, batch: int, capacity: int) -> dict[int, MixerState]:
        return {layer.index: layer.mixer.new_state(batch, capacity, self.dtype, self.device) for layer in self.layers}

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """Vocab-parallel lookup: rows outside this rank's block contribute zeros, then all-reduce."""
        assert self.embed is not None, "this rank holds no embedding"
        if self.comm.info.tp == 1:  # one lookup instead of five launches
            return self.embed[ids]
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        h = self.embed[local.clamp(0, self.vocab_rows - 1)] * inside[:, None].to(self.embed.dtype)
        return self.comm.all_reduce(h)

    def forward(self, batch: Batch, states: dict[int, MixerState]) -> Tensor | None:
        """Run this rank's part; the last stage returns float32 logits (n, V), others None."""
        info = self.comm.info
        T = batch.input_ids.shape[0]
        if info.is_first_stage:
            h, residual = self.embed_tokens(batch.input_ids), None
        else:
            like = torch.empty(T, self.hidden_size, dtype=self.dtype, device=self.device)
            h, residual = self.comm.recv_prev([like, like])
        out = self.stage(batch, states, h, residual)
        if not info.is_last_stage:
            self.comm.send_next(list(out))
            return None
        return out[0]

    def prepare(self, batch: Batch) -> dict[Any, Any]:
        """Tables the layers of one forward share (none here)."""
        return {}

    def stage(
        self, batch: Batch, states: dict[int, MixerState], h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, ...]:
        """The layers (and on the last stage the head) without the PP hand-over, so that a CUDA graph
        can hold them: (logits,) on the last stage, else the (hidden, residual) to send on."""
        context = self.prepare(batch)
        pending = None  # the previous layer's post-MLP norm, fused into the next norm
        for layer in self.layers:
            h, residual = layer(h, residual, batch, states[layer.index], context, pending)
            pending = layer.norms["post_mlp_norm"]
        assert residual is not None and pending is not None
        if not self.comm.info.is_last_stage:
            return self.ops.rms_norm(h, pending, self.eps)[0], residual
        h, _ = self.ops.norm_add_norm(h, pending, residual, self.final_norm, self.eps)
        if batch.logits_index is not None:
            h = h[batch.logits_index]
        logits = self.comm.all_gather(self.ops.linear(h, self.lm_head).float(), dim=-1)
        return (logits[:, : self.cfg.vocab_size],)


# (layer index, the mixer's weights by name relative to "mixer.", the rank's sizes) -> the mixer
MixerBuilder = Callable[[int, dict[str, Tensor], Any], Mixer]


def plamo_layers(
    family: Any, cfg: Any, stage: tuple[int, int], weights: dict[str, Tensor], ops: Any, comm: Comm, mixer: MixerBuilder
) -> tuple[list[PlamoLayer], Any]:
    """The PLaMo layers of one PP stage around the mixers a family builds, and the rank's sizes
    (`Family.rank_sizes`: what the tensor table's split rules give this TP rank)."""
    sizes = family.rank_sizes(cfg, comm.info.tp, comm.info.tp_rank)
    layers = []
    for i in range(*stage):
        w = layer_weights(weights, family.layer_prefix.format(i))
        layers.append(PlamoLayer(i, mixer(i, mixer_weights(w), sizes), w, cfg.rms_norm_eps, ops, comm))
    return layers, sizes
