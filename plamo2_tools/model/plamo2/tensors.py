"""PLaMo 2's tensors in one table (docs/model.md, "Tensors"), and its TP rules.

Each row of `TENSORS` says, for one kind of tensor: its Hugging Face name, its name in vLLM's
`Plamo2ForCausalLM`, where it lives (once, every layer, Mamba or attention layers), its HF shape,
how tensor parallelism splits it, the value transforms the converter applies, and how `synth`
initialises it.  The layout engine (model/layout.py) derives the HF inventory, the per-rank
layout the converter writes and synth's values from it; nothing else spells out a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import FLOAT32
from ..layout import (
    COLUMN,
    EVERY_LAYER,
    GLOBAL,
    REPLICATED,
    ROW,
    VOCAB,
    Piece,
    TensorKind,
    Transform,
    block,
    cols_rule,
    gate_up_pieces,
    kv_heads_of_rank,
    offset,
    qkv_pieces,
    replicated_rule,
    rows,
    rows_rule,
    vllm_scale_buffers,
    vocab_pieces,
)
from ..plamo import FINAL_NORM_OFFSET, NORM_OFFSETS
from .config import Plamo2Config

MAMBA, ATTENTION = "mamba", "attention"  # the layer kinds (Plamo2Config.layer_kinds)


def in_proj_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """HF rows are per-head [z_h; x_h]; vLLM wants [z of the rank's heads; x of the same heads]."""
    d = cfg.hidden_size_per_head
    first, n = block(cfg.mamba_num_heads, tp, r)
    heads = range(first, first + n)
    return tuple(rows(name, h * 2 * d, d) for h in heads) + tuple(rows(name, h * 2 * d + d, d) for h in heads)


def _qkv(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    return qkv_pieces(name, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size_per_head, tp, r)


def k_norm_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """k_norm follows the rank's KV head(s), replicated like them (vLLM's HF loader gets this
    wrong for 1 < Hkv < tp; docs/model.md §5)."""
    kv = kv_heads_of_rank(cfg.num_key_value_heads, tp, r)
    return (rows(name, kv.start, len(kv)),)


def _gate_up(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    return gate_up_pieces(name, cfg.intermediate_size, tp, r)


def _vocab(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of the vocabulary zero-padded to Vp (only rows < V are real)."""
    return vocab_pieces(name, cfg.vocab_size, cfg.padded_vocab // tp, tp, r)


def _pad(cfg: Plamo2Config) -> tuple[Transform, ...]:
    return (Transform("pad_vocab", cfg.padded_vocab),)


def _norm(name: str) -> TensorKind:
    def shape(c: Plamo2Config) -> tuple[int, ...]:
        return (c.hidden_size,)

    return TensorKind(
        f"{name}.weight",
        f"{name}.weight",
        EVERY_LAYER,
        shape,
        REPLICATED,
        replicated_rule(shape),
        offset(NORM_OFFSETS[name]),
        init="norm_delta",
    )


def _I(c: Plamo2Config) -> int:
    return c.mamba_inner


def _Hm(c: Plamo2Config) -> int:
    return c.mamba_num_heads


# fmt: off
TENSORS: tuple[TensorKind, ...] = (
    TensorKind("model.embed_tokens.weight", "model.embed_tokens.weight", GLOBAL,
               lambda c: (c.vocab_size, c.hidden_size), VOCAB, _vocab, _pad, init="embedding"),
    *(_norm(n) for n in NORM_OFFSETS),
    TensorKind("mlp.gate_up_proj.weight", "mlp.gate_up_proj.weight", EVERY_LAYER,
               lambda c: (2 * c.intermediate_size, c.hidden_size), COLUMN, _gate_up),
    TensorKind("mlp.down_proj.weight", "mlp.down_proj.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, c.intermediate_size), ROW, cols_rule(lambda c: c.intermediate_size)),
    # ---- Mamba mixer
    TensorKind("mixer.in_proj.weight", "mixer.in_proj.weight", MAMBA,
               lambda c: (2 * _I(c), c.hidden_size), COLUMN, in_proj_pieces,
               lambda c: (Transform("regroup_in_proj"),)),
    TensorKind("mixer.conv1d.weight", "mixer.conv1d.weight", MAMBA,
               lambda c: (_I(c), 1, c.mamba_d_conv), COLUMN, rows_rule(_I), init="conv"),
    TensorKind("mixer.bcdt_proj.weight", "mixer.bcdt_proj.weight", MAMBA,
               lambda c: (c.dt_rank + 2 * c.mamba_d_state, _I(c)), ROW, cols_rule(_I)),
    TensorKind("mixer.dt_proj.weight", "mixer.dt_proj.weight", MAMBA,
               lambda c: (c.mamba_num_heads, c.dt_rank), COLUMN, rows_rule(_Hm), init="dt_proj"),
    TensorKind("mixer.dt_bias", "mixer.dt_bias", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, rows_rule(_Hm), init="dt_bias"),
    TensorKind("mixer.A_log", "mixer.A", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, rows_rule(_Hm),
               lambda c: (Transform("neg_exp_f32"),), init="A_log", dtype=FLOAT32),
    TensorKind("mixer.D", "mixer.D", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, rows_rule(_Hm), init="D"),
    TensorKind("mixer.dt_norm_weight", "mixer.dt_norm.weight", MAMBA,
               lambda c: (c.dt_rank,), REPLICATED, replicated_rule(lambda c: (c.dt_rank,)), init="norm_scale"),
    TensorKind("mixer.B_norm_weight", "mixer.B_norm.weight", MAMBA,
               lambda c: (c.mamba_d_state,), REPLICATED, replicated_rule(lambda c: (c.mamba_d_state,)),
               init="norm_scale"),
    TensorKind("mixer.C_norm_weight", "mixer.C_norm.weight", MAMBA,
               lambda c: (c.mamba_d_state,), REPLICATED, replicated_rule(lambda c: (c.mamba_d_state,)),
               init="norm_scale"),
    TensorKind("mixer.out_proj.weight", "mixer.out_proj.weight", MAMBA,
               lambda c: (c.hidden_size, _I(c)), ROW, cols_rule(_I)),
    # ---- attention mixer
    TensorKind("mixer.qkv_proj.weight", "mixer.qkv_proj.weight", ATTENTION,
               lambda c: ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.hidden_size_per_head, c.hidden_size),
               COLUMN, _qkv),
    TensorKind("mixer.q_weight", "mixer.q_norm.weight", ATTENTION,
               lambda c: (c.num_attention_heads, c.hidden_size_per_head), COLUMN,
               rows_rule(lambda c: c.num_attention_heads), init="norm_scale"),
    TensorKind("mixer.k_weight", "mixer.k_norm.weight", ATTENTION,
               lambda c: (c.num_key_value_heads, c.hidden_size_per_head), COLUMN, k_norm_pieces, init="norm_scale"),
    TensorKind("mixer.o_proj.weight", "mixer.o_proj.weight", ATTENTION,
               lambda c: (c.hidden_size, c.num_attention_heads * c.hidden_size_per_head), ROW,
               cols_rule(lambda c: c.num_attention_heads * c.hidden_size_per_head)),
    # ---- after the layers
    TensorKind("model.norm.weight", "model.norm.weight", GLOBAL,
               lambda c: (c.hidden_size,), REPLICATED, replicated_rule(lambda c: (c.hidden_size,)),
               offset(FINAL_NORM_OFFSET), init="norm_delta"),
    TensorKind("lm_head.weight", "lm_head.weight", GLOBAL,
               lambda c: (c.lm_head_rows, c.hidden_size), VOCAB, _vocab, _pad, init="embedding"),
)
# fmt: on
VLLM_EXTRAS = vllm_scale_buffers(ATTENTION)
# FP8 exports (export/fp8.py).  vLLM 0.26's Plamo2ForCausalLM builds seven linears with its quant_config: the
# attention and MLP ones and the Mamba in_proj, bcdt_proj, dt_proj, out_proj (not conv1d).  Quantizing Mamba's
# out_proj (llama.cpp's ssm_out) is what breaks PLaMo 2 (a Q8_0 ssm_out loops: llama.cpp#24501; PFN keeps it in F16),
# and bcdt_proj / dt_proj feed the SSM's B, C and time step (PFN's MLX "mixed" recipe keeps both unquantized), so
# those three stay in the source dtype and are listed in the checkpoint's `ignore`.
FP8_QUANTIZED = (
    "mixer.qkv_proj.weight",
    "mixer.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "mixer.in_proj.weight",
)
FP8_KEPT = ("mixer.bcdt_proj.weight", "mixer.dt_proj.weight", "mixer.out_proj.weight")


# ---- checking a split ---------------------------------------------------------------------------
def tp_problems(cfg: Plamo2Config, tp: int) -> list[str]:
    """Why `tp` cannot split this model (empty when it can)."""
    if tp < 1:
        return [f"tp={tp} must be >= 1"]
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if Hq % tp:
        problems.append(f"tp={tp} does not divide {Hq} attention heads")
    if Hkv >= tp and Hkv % tp:
        problems.append(f"tp={tp} does not divide {Hkv} KV heads")
    if Hkv < tp and tp % Hkv:
        problems.append(f"{Hkv} KV heads cannot be replicated evenly over tp={tp} (tp % Hkv != 0)")
    if cfg.mamba_num_heads % tp:
        problems.append(f"tp={tp} does not divide {cfg.mamba_num_heads} Mamba heads")
    if cfg.intermediate_size % tp:
        problems.append(f"tp={tp} does not divide intermediate_size {cfg.intermediate_size}")
    if cfg.padded_vocab % tp:
        problems.append(f"tp={tp} does not divide the padded vocabulary {cfg.padded_vocab}")
    return problems


def tp_notes(cfg: Plamo2Config, tp: int) -> list[str]:
    """Valid splits that deserve a word of warning."""
    if 1 < cfg.num_key_value_heads < tp:
        return [
            f"KV heads replicated {tp // cfg.num_key_value_heads}x; k_norm follows the KV head "
            "(vLLM's own HF loader mis-slices k_norm here; our shards are correct)"
        ]
    return []


@dataclass(frozen=True)
class RankSizes:
    """What one TP rank holds of each split dimension: the runtime allocates from these."""

    mamba_heads: int
    q_heads: int
    kv_heads: int
    ffn: int
    vocab_start: int
    vocab_rows: int

    def mamba_inner(self, cfg: Plamo2Config) -> int:
        return self.mamba_heads * cfg.hidden_size_per_head


def rank_sizes(cfg: Plamo2Config, tp: int, r: int) -> RankSizes:
    """Derived from the same split rules as the pieces above (heads, KV replication, vocab)."""
    vocab_start, vocab_rows = block(cfg.padded_vocab, tp, r)
    return RankSizes(
        mamba_heads=block(cfg.mamba_num_heads, tp, r)[1],
        q_heads=block(cfg.num_attention_heads, tp, r)[1],
        kv_heads=len(kv_heads_of_rank(cfg.num_key_value_heads, tp, r)),
        ffn=block(cfg.intermediate_size, tp, r)[1],
        vocab_start=vocab_start,
        vocab_rows=vocab_rows,
    )
