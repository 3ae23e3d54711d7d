"""The family seam is real: a model family defined only here (a two-layer, attention-only, pre-norm
model unlike PLaMo's four-norm layers) is registered, synthesized, converted at TP2xPP2, checked,
merged back byte-identically, inspected, and run by the runtime against its own reference forward
- with no file of the package edited (docs/architecture.md, "Add a model family")."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from plamo2_tools.convert.engine import convert
from plamo2_tools.convert.merge import merge
from plamo2_tools.inspect import inspect_path
from plamo2_tools.model import Family, hf_tensor_shapes, register
from plamo2_tools.model import reference_ops as ops
from plamo2_tools.model.forward import Batch, LayerState, RankModel, kv_state, layer_weights, rope_cos_sin
from plamo2_tools.model.layout import (
    COLUMN,
    EVERY_LAYER,
    GLOBAL,
    REPLICATED,
    ROW,
    VOCAB,
    TensorKind,
    Transform,
    block,
    cols_rule,
    gate_up_pieces,
    kv_heads_of_rank,
    padded_vocab,
    qkv_pieces,
    replicated_rule,
    vocab_pieces,
)
from plamo2_tools.model.registry import unregister
from plamo2_tools.model.synth import synth
from plamo2_tools.shards.check import check_shards
from plamo2_tools.verify import random_prompts, verify

Tensor = torch.Tensor


# ---- the family: config ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ToyConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    model_type: str = "toy-attn"
    rope_theta: float = 1000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    max_position_embeddings: int = 4096

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ToyConfig:
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab_size)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return ("attention",) * self.num_hidden_layers

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)


# ---- the family: its table (no offsets, so that merge gives every byte back) -----------------------
def _qkv(name: str, c: ToyConfig, tp: int, r: int):
    return qkv_pieces(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp, r)


def _vocab(name: str, c: ToyConfig, tp: int, r: int):
    return vocab_pieces(name, c.vocab_size, c.padded_vocab // tp, tp, r)


def _pad(c: ToyConfig) -> tuple[Transform, ...]:
    return (Transform("pad_vocab", c.padded_vocab),)


def _norm(name: str, where: str) -> TensorKind:
    shape = lambda c: (c.hidden_size,)  # noqa: E731
    return TensorKind(name, name, where, shape, REPLICATED, replicated_rule(shape), init="norm_scale")


# fmt: off
TABLE = (
    TensorKind("model.embed_tokens.weight", "model.embed_tokens.weight", GLOBAL,
               lambda c: (c.vocab_size, c.hidden_size), VOCAB, _vocab, _pad, init="embedding"),
    _norm("attn_norm.weight", EVERY_LAYER),
    TensorKind("attn.qkv.weight", "attn.qkv.weight", EVERY_LAYER,
               lambda c: ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
               COLUMN, _qkv),
    TensorKind("attn.out.weight", "attn.out.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), ROW,
               cols_rule(lambda c: c.num_attention_heads * c.head_dim)),
    _norm("mlp_norm.weight", EVERY_LAYER),
    TensorKind("mlp.gate_up.weight", "mlp.gate_up.weight", EVERY_LAYER,
               lambda c: (2 * c.intermediate_size, c.hidden_size), COLUMN,
               lambda n, c, tp, r: gate_up_pieces(n, c.intermediate_size, tp, r)),
    TensorKind("mlp.down.weight", "mlp.down.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, c.intermediate_size), ROW, cols_rule(lambda c: c.intermediate_size)),
    _norm("model.norm.weight", GLOBAL),
    TensorKind("lm_head.weight", "lm_head.weight", GLOBAL,
               lambda c: (c.vocab_size, c.hidden_size), VOCAB, _vocab, _pad, init="embedding"),
)
# fmt: on


# ---- the family: reference forward, float, unsharded, plain -----------------------------------------
def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].to(x.dtype), torch.cat([ang.sin()] * 2, -1)[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def toy_reference(ckpt: Any, seqs: Sequence[Sequence[int]], dtype: torch.dtype) -> list[Tensor]:
    c: ToyConfig = ckpt.config
    H, K, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    out = []
    for seq in seqs:
        T = len(seq)
        h = ckpt.get("model.embed_tokens.weight").to(dtype)[torch.tensor(list(seq))]
        for i in range(c.num_hidden_layers):
            w = {k: ckpt.get(f"model.layers.layers.{i}.{k}").to(dtype) for k, _ in _layer_names()}
            a = ops.rms_norm(h, w["attn_norm.weight"], c.rms_norm_eps)
            qkv = a @ w["attn.qkv.weight"].T
            q, k, v = qkv.split([H * d, K * d, K * d], -1)
            pos = torch.arange(T)
            q, k = _rope(q.view(T, H, d), pos, c.rope_theta), _rope(k.view(T, K, d), pos, c.rope_theta)
            o = ops.attention(q, k, v.view(T, K, d), scale=d**-0.5)
            h = h + o.reshape(T, H * d) @ w["attn.out.weight"].T
            b = ops.rms_norm(h, w["mlp_norm.weight"], c.rms_norm_eps)
            g, u = (b @ w["mlp.gate_up.weight"].T).chunk(2, -1)
            h = h + (F.silu(g) * u) @ w["mlp.down.weight"].T
        h = ops.rms_norm(h, ckpt.get("model.norm.weight").to(dtype), c.rms_norm_eps)
        out.append((h @ ckpt.get("lm_head.weight").to(dtype).T).float())
    return out


def _layer_names() -> list[tuple[str, TensorKind]]:
    return [(k.hf, k) for k in TABLE if k.where != GLOBAL]  # type: ignore[misc]


# ---- the family: the rank forward the runtime runs ------------------------------------------------------
class ToyLayer:
    def __init__(self, index: int, w: dict[str, Tensor], c: ToyConfig, ops_: Any, comm: Any) -> None:
        self.index, self.w, self.c, self.ops, self.comm = index, w, c, ops_, comm
        tp, r = comm.info.tp, comm.info.tp_rank
        self.hq = block(c.num_attention_heads, tp, r)[1]
        self.hk = len(kv_heads_of_rank(c.num_key_value_heads, tp, r))
        self.mixer = self  # the runtime allocates states through layer.mixer.new_state

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> LayerState:
        return kv_state(batch, capacity, self.hk, self.c.head_dim, dtype, device)

    def __call__(self, h: Tensor, batch: Batch, state: LayerState, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
        c, w, d = self.c, self.w, self.c.head_dim
        T = h.shape[0]
        a, _ = self.ops.rms_norm(h, w["attn_norm.weight"], c.rms_norm_eps)
        q, k, v = F.linear(a, w["attn.qkv.weight"]).split([self.hq * d, self.hk * d, self.hk * d], -1)
        cos, sin = cos_sin
        q, k = _rotate(q.view(T, self.hq, d), cos, sin), _rotate(k.view(T, self.hk, d), cos, sin)
        state.k[batch.seq_index, batch.positions] = k.to(state.k.dtype)
        state.v[batch.seq_index, batch.positions] = v.view(T, self.hk, d).to(state.v.dtype)
        o = self.ops.attention(q.contiguous(), state.k, state.v, batch.cu_seqlens, batch.kv_lens, d**-0.5, None)
        h = h + self.comm.all_reduce(F.linear(o.reshape(T, self.hq * d), w["attn.out.weight"]))
        b, _ = self.ops.rms_norm(h, w["mlp_norm.weight"], c.rms_norm_eps)
        m = F.linear(self.ops.silu_mul(F.linear(b, w["mlp.gate_up.weight"])), w["mlp.down.weight"])
        return h + self.comm.all_reduce(m)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class ToyRankModel(RankModel):
    def stage(self, batch: Batch, states: dict[int, LayerState], h: Tensor, residual: Tensor | None):
        cos_sin = rope_cos_sin(batch.positions, self.cfg.head_dim, self.cfg.rope_theta, torch.float32)
        for layer in self.layers:
            h = layer(h, batch, states[layer.index], cos_sin)
        if not self.comm.info.is_last_stage:
            return h, h  # the hand-over is a pair; this family needs only the hidden state
        h, _ = self.ops.rms_norm(h, self.final_norm, self.eps)
        if batch.logits_index is not None:
            h = h[batch.logits_index]
        logits = self.comm.all_gather(F.linear(h, self.lm_head).float(), dim=-1)
        return (logits[:, : self.cfg.vocab_size],)


class ToyFamily(Family):
    name = "toy-attn"
    description = "a two-layer attention-only test family"
    model_types = ("toy-attn",)
    architectures = ("ToyAttnForCausalLM",)
    config_class = ToyConfig
    tensors = TABLE
    activation_tensor = "mlp.gate_up.weight"
    presets = {
        "toy-tiny": dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            vocab_size=300,
        ),  # fmt: skip
    }

    def summary(self, cfg: ToyConfig) -> dict[str, Any]:
        return cfg.to_dict() | {"padded_vocab": cfg.padded_vocab}

    def tp_problems(self, cfg: ToyConfig, tp: int) -> list[str]:
        return [f"tp={tp} does not divide {n}" for n in (cfg.num_attention_heads, cfg.intermediate_size,
                                                         cfg.padded_vocab) if n % tp]  # fmt: skip

    def reference_logits(self, ckpt: Any, sequences: Sequence[Sequence[int]], dtype: torch.dtype,
                         device: Any = "cpu", **options: Any) -> list[Tensor]:  # fmt: skip
        return toy_reference(ckpt, sequences, dtype)

    def rank_model(self, cfg: ToyConfig, stage: tuple[int, int], weights: dict[str, Any], ops_: Any, comm: Any,
                   dtype: torch.dtype | None = None, **options: Any) -> RankModel:  # fmt: skip
        layers = [ToyLayer(i, layer_weights(weights, self.layer_prefix.format(i)), cfg, ops_, comm)
                  for i in range(*stage)]  # fmt: skip
        vocab = self.vocab_rows(cfg, comm.info.tp, comm.info.tp_rank)
        act = dtype or next(iter(weights.values())).dtype
        return ToyRankModel(cfg, layers, weights, ops_, comm, vocab, act)  # type: ignore[arg-type]


# ---- the test -------------------------------------------------------------------------------------------
@pytest.fixture
def toy_family() -> Iterator[ToyFamily]:
    family = register(ToyFamily())
    yield family
    unregister(family.name)


def test_a_family_defined_outside_the_package_runs_every_command(toy_family: ToyFamily, tmp_path: Path) -> None:
    src = tmp_path / "toy-hf"
    cfg = synth(src, "toy-tiny", seed=3)
    assert isinstance(cfg, ToyConfig) and len(hf_tensor_shapes(cfg)) == 2 + 2 * 6 + 1

    shards = tmp_path / "toy-tp2-pp2"
    result = convert(src, shards, tp=2, pp=2)
    assert result.plan.mapping.world_size == 4
    # The table's rules, not a default, cut rank 1's qkv: its q heads 2-3 and KV head 1 of 2.
    rank1 = load_file(str(shards / "model-rank-1-part-0.safetensors"))
    qkv = load_file(str(src / "model.safetensors"))["model.layers.layers.0.attn.qkv.weight"]
    d = 8
    want = torch.cat([qkv[2 * d : 4 * d], qkv[(4 + 1) * d : (4 + 2) * d], qkv[(4 + 2 + 1) * d : (4 + 2 + 2) * d]])
    assert torch.equal(rank1["model.layers.layers.0.attn.qkv.weight"], want)

    report = check_shards(shards)
    assert report.ok, report.checks
    info = inspect_path(shards)
    assert info["family"] == "toy-attn" and info["mapping"]["tp_size"] == 2

    back = tmp_path / "toy-merged"
    merge(shards, back)
    original, merged = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert original.keys() == merged.keys()
    assert all(torch.equal(original[k], merged[k]) for k in original)
    assert (src / "model.safetensors").read_bytes() == (back / "model.safetensors").read_bytes()

    prompts = random_prompts(3, cfg.vocab_size, seed=5, lengths=(5, 20))
    outcome = verify([shards], src, prompts, "random", max_new_tokens=6, backend="torch")
    layout = outcome["layouts"][0]
    assert outcome["passed"], layout["failures"]
    assert layout["metrics"]["max_rel_err"] < 1e-4 and layout["metrics"]["greedy_match_fraction"] == 1.0


def test_the_seam_test_can_fail(toy_family: ToyFamily, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the guard: a rank forward 1% off in every layer is caught by verify."""
    src = tmp_path / "toy-hf"
    cfg = synth(src, "toy-tiny", seed=3)
    shards = tmp_path / "toy-tp2-pp1"
    convert(src, shards, tp=2, pp=1)
    broken = ToyLayer.__call__

    def perturbed(self: ToyLayer, h: Tensor, batch: Batch, state: LayerState, cos_sin: Any) -> Tensor:
        out = broken(self, h, batch, state, cos_sin)
        return out * (1 + 1e-2 * math.sin(self.index + 1))

    monkeypatch.setattr(ToyLayer, "__call__", perturbed)
    prompts = random_prompts(2, cfg.vocab_size, seed=5, lengths=(5, 12))
    outcome = verify([shards], src, prompts, "random", max_new_tokens=3, backend="torch")
    assert not outcome["passed"]
