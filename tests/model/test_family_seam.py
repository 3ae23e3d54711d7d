"""The family seam is real: a model family defined only here (a two-layer, pre-norm model unlike
PLaMo's four-norm layers: attention plus a running sum of its inputs that forgets at a rate the user
chooses) is registered, synthesized, converted at TP2xPP2, checked, merged back byte-identically,
inspected, and run by the runtime against its own reference forward - with no file of the package
edited (docs/architecture.md, "Add a model family").  The family brings what PLaMo's do not have:
its own runtime option (`decay`, through `--option` on the real commands and lm-eval's model args)
and its own kind of state (`ToyState`: a KV cache plus a fixed-size running sum per sequence),
which the runtime's slot pools, chunked prefill and memory plan handle without knowing it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from plamo2_tools.convert.engine import convert
from plamo2_tools.convert.merge import merge
from plamo2_tools.inspect import inspect_path
from plamo2_tools.model import Family, hf_tensor_shapes, register
from plamo2_tools.model import reference_ops as ops
from plamo2_tools.model.family import RuntimeOption
from plamo2_tools.model.forward import Batch, MixerState, RankModel, layer_weights, rope_cos_sin
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


def running_sums(a: Tensor, decay: float) -> Tensor:
    """r_t = sum over j <= t of decay^(t-j) a_j, as one matrix product (the runtime runs the recurrence)."""
    T = a.shape[0]
    t = torch.arange(T, dtype=torch.float64)
    powers = (decay ** (t[:, None] - t[None, :])).tril()
    return powers.to(a.dtype) @ a


def toy_reference(ckpt: Any, seqs: Sequence[Sequence[int]], dtype: torch.dtype, decay: float) -> list[Tensor]:
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
            h = h + o.reshape(T, H * d) @ w["attn.out.weight"].T + SUM_WEIGHT * running_sums(a, decay)
            b = ops.rms_norm(h, w["mlp_norm.weight"], c.rms_norm_eps)
            g, u = (b @ w["mlp.gate_up.weight"].T).chunk(2, -1)
            h = h + (F.silu(g) * u) @ w["mlp.down.weight"].T
        h = ops.rms_norm(h, ckpt.get("model.norm.weight").to(dtype), c.rms_norm_eps)
        out.append((h @ ckpt.get("lm_head.weight").to(dtype).T).float())
    return out


def _layer_names() -> list[tuple[str, TensorKind]]:
    return [(k.hf, k) for k in TABLE if k.where != GLOBAL]  # type: ignore[misc]


# ---- the family: the rank forward the runtime runs ------------------------------------------------------
SUM_WEIGHT = 0.5  # how much of the running sum each layer adds to the residual stream
DECAY = RuntimeOption("decay", ("0.5", "0.25"), "how fast the running sum forgets")


@dataclass
class ToyState(MixerState):
    """This family's own kind of state: keys and values per position, and the running sum, a fixed
    size per sequence."""

    k: Tensor  # (S, capacity, hk, d)
    v: Tensor
    total: Tensor  # (S, D) float32
    per_token = frozenset({"k", "v"})


class ToyLayer:
    def __init__(self, index: int, w: dict[str, Tensor], c: ToyConfig, ops_: Any, comm: Any, decay: float) -> None:
        self.index, self.w, self.c, self.ops, self.comm, self.decay = index, w, c, ops_, comm, decay
        tp, r = comm.info.tp, comm.info.tp_rank
        self.hq = block(c.num_attention_heads, tp, r)[1]
        self.hk = len(kv_heads_of_rank(c.num_key_value_heads, tp, r))
        self.mixer = self  # the runtime allocates states through layer.mixer.new_state

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> ToyState:
        kv = (batch, capacity, self.hk, self.c.head_dim)
        return ToyState(
            torch.zeros(kv, dtype=dtype, device=device),
            torch.zeros(kv, dtype=dtype, device=device),
            torch.zeros(batch, self.c.hidden_size, dtype=torch.float32, device=device),
        )

    def running_sum(self, a: Tensor, batch: Batch, state: ToyState) -> Tensor:
        """The recurrence, token by token, each sequence continuing from its state."""
        out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        cu = batch.cu_seqlens.tolist()
        for s in range(len(cu) - 1):
            r = state.total[s] if bool(batch.has_state[s]) else torch.zeros_like(state.total[s])
            for t in range(cu[s], cu[s + 1]):
                r = self.decay * r + a[t].float()
                out[t] = r
            state.total[s] = r
        return out.to(a.dtype)

    def __call__(self, h: Tensor, batch: Batch, state: ToyState, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
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
        h = h + SUM_WEIGHT * self.running_sum(a, batch, state)  # replicated: every TP rank holds the whole sum
        b, _ = self.ops.rms_norm(h, w["mlp_norm.weight"], c.rms_norm_eps)
        m = F.linear(self.ops.silu_mul(F.linear(b, w["mlp.gate_up.weight"])), w["mlp.down.weight"])
        return h + self.comm.all_reduce(m)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class ToyRankModel(RankModel):
    def stage(self, batch: Batch, states: dict[int, MixerState], h: Tensor, residual: Tensor | None):
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
    runtime_options = (DECAY,)
    presets = {
        "toy-tiny": dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            vocab_size=300,
        ),
    }

    def summary(self, cfg: ToyConfig) -> dict[str, Any]:
        return cfg.to_dict() | {"padded_vocab": cfg.padded_vocab}

    def tp_problems(self, cfg: ToyConfig, tp: int) -> list[str]:
        return [
            f"tp={tp} does not divide {n}"
            for n in (cfg.num_attention_heads, cfg.intermediate_size, cfg.padded_vocab)
            if n % tp
        ]

    def reference_logits(
        self,
        ckpt: Any,
        sequences: Sequence[Sequence[int]],
        dtype: torch.dtype,
        device: Any = "cpu",
        decay: str = DECAY.default,
    ) -> list[Tensor]:
        return toy_reference(ckpt, sequences, dtype, float(decay))

    def rank_model(
        self,
        cfg: ToyConfig,
        stage: tuple[int, int],
        weights: dict[str, Any],
        ops_: Any,
        comm: Any,
        dtype: torch.dtype | None = None,
        decay: str = DECAY.default,
    ) -> RankModel:
        layers = [
            ToyLayer(i, layer_weights(weights, self.layer_prefix.format(i)), cfg, ops_, comm, float(decay))
            for i in range(*stage)
        ]
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

    def perturbed(self: ToyLayer, h: Tensor, batch: Batch, state: ToyState, cos_sin: Any) -> Tensor:
        out = broken(self, h, batch, state, cos_sin)
        return out * (1 + 1e-2 * math.sin(self.index + 1))

    monkeypatch.setattr(ToyLayer, "__call__", perturbed)
    prompts = random_prompts(2, cfg.vocab_size, seed=5, lengths=(5, 12))
    outcome = verify([shards], src, prompts, "random", max_new_tokens=3, backend="torch")
    assert not outcome["passed"]


# ---- the family's own option and state, through the real commands and the runtime ----------------------
@pytest.fixture
def toy_layouts(toy_family: ToyFamily, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(checkpoint, TP2xPP2 shards, TP1xPP1 shards) of the toy family."""
    src = tmp_path / "toy-hf"
    synth(src, "toy-tiny", seed=3)
    convert(src, tmp_path / "toy-tp2-pp2", tp=2, pp=2)
    convert(src, tmp_path / "toy-tp1-pp1")
    return src, tmp_path / "toy-tp2-pp2", tmp_path / "toy-tp1-pp1"


def test_the_family_option_reaches_the_reference_and_the_runtime_through_the_cli(
    toy_layouts: tuple[Path, Path, Path], tmp_path: Path, cli: Any, one_line_error: Any
) -> None:
    """`--option decay=0.25` on logits (reference and runtime), verify and generate, nothing in cli/
    naming it.  Fails when the option is dropped on either side (the two decays give logits that
    differ by far more than the tolerance) or when a command does not pass it on."""
    src, shards, _ = toy_layouts
    ids = "1,5,9,200,33,7,12,250,3"

    def logits(path: Path, *option: str) -> np.ndarray:
        out = tmp_path / f"logits-{len(list(tmp_path.iterdir()))}.npy"
        cli("logits", path, "--input-ids", ids, "--out", out, *option)
        return np.load(out)

    ref, rt = logits(src, "--option", "decay=0.25"), logits(shards, "--option", "decay=0.25")
    assert np.abs(ref - rt).max() < 1e-4 * np.abs(ref).max()
    default = logits(shards)
    assert np.abs(default - rt).max() > 1e-2 * np.abs(ref).max()  # the option changes the model
    assert np.abs(default - logits(src)).max() < 1e-4 * np.abs(ref).max()

    # verify: chunked prefill (prompts of different lengths: the subset path) and greedy decode
    result = json.loads(
        cli(
            "verify",
            shards,
            "--reference",
            src,
            "--random",
            3,
            "--max-new-tokens",
            5,
            "--prefill-chunk",
            3,
            "--option",
            "decay=0.25",
            "--json",
        ).stdout
    )
    assert result["passed"] and result["pinned"] == {"decay": "0.25"} and result["conventions"] == ["decay=0.25"]

    made = json.loads(
        cli(
            "generate", shards, "--prompt", "hello world", "--max-new-tokens", 4, "--option", "decay=0.25", "--json"
        ).stdout
    )
    assert made["prompt_tokens"] >= 1 and 1 <= len(made["tokens"]) <= 4

    for option, why in (
        ("decay=0.3", "decay '0.3' is not one of 0.5, 0.25"),
        ("warp=1", "no forward option 'warp' (it has decay)"),
        ("decay", "expected KEY=VALUE"),
    ):
        r = cli("logits", shards, "--input-ids", ids, "--out", tmp_path / "x.npy", "--option", option, expect=2)
        assert why in one_line_error(r, 2)


def test_help_lists_the_registered_families_options(toy_family: ToyFamily, cli: Any) -> None:
    for command in ("logits", "verify", "generate", "serve", "eval"):
        text = " ".join(cli(command, "--help").stdout.split())
        assert "toy-attn: decay=0.5|0.25 (default 0.5)" in text, command
        assert "plamo3: window_convention=hf|vllm (default hf)" in text, command


def test_the_family_state_kind_runs_through_slot_pools_and_the_memory_plan(
    toy_layouts: tuple[Path, Path, Path],
) -> None:
    """ToyState (KV per position + a running sum per sequence) through continuous batching with
    fewer slots than prompts (slots refilled and compacted: `load`, `move`, `rows`), and counted by
    the auto batch size from its own `bytes_per_sequence`.  Fails when the runtime copies only the
    tensors it knows (the running sum of a refilled slot would be another sequence's) or counts
    only KV bytes."""
    from plamo2_tools.runtime.batching.engine import Runtime
    from plamo2_tools.verify import reference_outputs

    src, shards, single = toy_layouts
    prompts = random_prompts(6, 300, seed=7, lengths=(3, 11))
    # Four slots for six prompts: the last two wait and take freed slots; the long last one then
    # runs alone in a high slot and is moved down as the decode batch shrinks.
    limits = [3, 3, 3, 3, 3, 10]
    want = reference_outputs(src, prompts, max(limits), torch.float64, forward_options={"decay": "0.25"})
    with Runtime(shards, backend="torch", forward_options={"decay": "0.25"}) as rt:
        got = rt.generate(prompts, limits, max_batch=4, sync_every=1, return_logits=True)
    assert got.tokens == [w[:n] for w, n in zip(want.tokens, limits, strict=True)]
    assert got.logits is not None
    for mine, theirs, n in zip(got.logits, want.step_logits, limits, strict=True):
        assert (mine.double() - theirs[:n].double()).abs().max() < 1e-4 * theirs.abs().max()
    with Runtime(single, backend="torch") as rt:
        c = rt.config
        per_slot, _ = rt.engines[0].bytes_per_rank(10)
        kv_per_token = 2 * c.num_key_value_heads * c.head_dim * 4  # float32 k and v
        sums = c.hidden_size * 4  # float32, held twice: the slot and its prefill copy
        assert per_slot == c.num_hidden_layers * (2 * sums + 10 * kv_per_token) + 4 * 4 * c.vocab_size


def test_lm_eval_model_args_carry_the_family_option(toy_layouts: tuple[Path, Path, Path]) -> None:
    """lm-eval's `--model_args ...,decay=0.25` reaches the runtime and its record (eval/ names no
    family option); a value the family does not offer is refused."""
    from plamo2_tools.errors import UserError
    from plamo2_tools.eval.plamo2_lm import PlamoLM

    _, _, single = toy_layouts
    lm = PlamoLM.create_from_arg_string(f"pretrained={single},backend=torch,decay=0.25")
    assert lm.runtime.forward_options == {"decay": "0.25"}
    assert lm.get_model_info()["forward_options"] == {"decay": "0.25"}
    with pytest.raises(UserError, match="decay '0.3' is not one of"):
        PlamoLM.create_from_arg_string(f"pretrained={single},backend=torch,decay=0.3")
