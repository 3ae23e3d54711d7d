"""PLaMo 3's tensors in one table (docs/plamo3.md, "Tensors"), and its TP rules.

Norm offsets are folded in the shard dtype: vLLM's Plamo3 loader copies a norm weight into its
parameter and adds the offset there (`composed_weight_loader(default_weight_loader, x + offset)`),
so with --dtype the weight is cast first and the offset added after (in float32 arithmetic, as
torch on CUDA does for a bf16 tensor plus a Python float, rounded once more); PLaMo 2's loader adds
the offset before the copy (model/plamo2/tensors.py).

Every layer is attention + SwiGLU MLP with PLaMo 2's four norms; q/k norms are one [head_dim]
vector shared by every head (+1 folded in), replicated on every TP rank.  vLLM 0.26's
`Plamo3ForCausalLM` holds exactly these per rank (its loader: qkv split by head with KV heads
replicated when K < TP, gate_up as [gate slice | up slice], vocab padded to 64, an untied head as
`ParallelLMHead(round16(V), org_num_embeddings=V)`, the four fp32 attention scale buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    vllm_scale_buffers,
    vocab_pieces,
)
from ..plamo import FINAL_NORM_OFFSET, NORM_OFFSETS
from .config import QK_NORM_OFFSET, Plamo3Config


def _qkv(name: str, c: Plamo3Config, tp: int, r: int) -> tuple[Piece, ...]:
    return qkv_pieces(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp, r)


def _gate_up(name: str, c: Plamo3Config, tp: int, r: int) -> tuple[Piece, ...]:
    return gate_up_pieces(name, c.intermediate_size, tp, r)


def _embedding(name: str, c: Plamo3Config, tp: int, r: int) -> tuple[Piece, ...]:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of the vocabulary zero-padded to Vp = pad64(V)."""
    return vocab_pieces(name, c.vocab_size, c.padded_vocab // tp, tp, r)


def _head(name: str, c: Plamo3Config, tp: int, r: int) -> tuple[Piece, ...]:
    """The head's rank r holds lm_head_rows / tp rows: first the same original rows as the
    embedding, then zeros (vLLM's added rows round16(V) - V, never loaded).  Tied, the head is the
    embedding itself."""
    if c.tie_word_embeddings:
        return _embedding(name, c, tp, r)
    org = c.padded_vocab // tp
    return vocab_pieces(name, c.vocab_size, org, tp, r) + (Piece(None, 0, 0, c.lm_head_rows // tp - org),)


def _pad_embedding(c: Plamo3Config) -> tuple[Transform, ...]:
    return (Transform("pad_vocab", c.padded_vocab),)


def _pad_head(c: Plamo3Config) -> tuple[Transform, ...]:
    return (Transform("pad_vocab", c.padded_vocab if c.tie_word_embeddings else c.lm_head_rows),)


def _head_shape(c: Plamo3Config) -> tuple[int, ...]:
    return (c.vocab_size, c.hidden_size)  # vLLM's loader asserts exactly V rows


def _norm(name: str) -> TensorKind:
    def shape(c: Plamo3Config) -> tuple[int, ...]:
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
        cast_first=True,
    )


def _qk_norm(name: str) -> TensorKind:
    def shape(c: Plamo3Config) -> tuple[int, ...]:
        return (c.head_dim,)

    return TensorKind(
        name,
        name,
        EVERY_LAYER,
        shape,
        REPLICATED,
        replicated_rule(shape),
        offset(QK_NORM_OFFSET),
        init="norm_delta",
        cast_first=True,
    )


def _qd(c: Plamo3Config) -> int:
    return c.num_attention_heads * c.head_dim


# fmt: off
TENSORS: tuple[TensorKind, ...] = (
    TensorKind("model.embed_tokens.weight", "model.embed_tokens.weight", GLOBAL,
               lambda c: (c.vocab_size, c.hidden_size), VOCAB, _embedding, _pad_embedding, init="embedding"),
    *(_norm(n) for n in NORM_OFFSETS),
    TensorKind("mixer.qkv_proj.weight", "mixer.qkv_proj.weight", EVERY_LAYER,
               lambda c: ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
               COLUMN, _qkv),
    _qk_norm("mixer.q_norm.weight"),
    _qk_norm("mixer.k_norm.weight"),
    TensorKind("mixer.o_proj.weight", "mixer.o_proj.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, _qd(c)), ROW, cols_rule(_qd)),
    TensorKind("mlp.gate_up_proj.weight", "mlp.gate_up_proj.weight", EVERY_LAYER,
               lambda c: (2 * c.intermediate_size, c.hidden_size), COLUMN, _gate_up),
    TensorKind("mlp.down_proj.weight", "mlp.down_proj.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, c.intermediate_size), ROW, cols_rule(lambda c: c.intermediate_size)),
    TensorKind("model.norm.weight", "model.norm.weight", GLOBAL,
               lambda c: (c.hidden_size,), REPLICATED, replicated_rule(lambda c: (c.hidden_size,)),
               offset(FINAL_NORM_OFFSET), init="norm_delta", cast_first=True),
    TensorKind("lm_head.weight", "lm_head.weight", GLOBAL, _head_shape, VOCAB, _head, _pad_head, init="embedding"),
)
# fmt: on
VLLM_EXTRAS = vllm_scale_buffers(EVERY_LAYER)
# FP8 exports (export/fp8.py): the four linears vLLM's Plamo3ForCausalLM builds with its quant_config
# (plamo3.py: qkv_proj, o_proj, gate_up_proj, down_proj); the embedding, the head and every norm stay as they are.
FP8_QUANTIZED = ("mixer.qkv_proj.weight", "mixer.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def tp_problems(cfg: Plamo3Config, tp: int) -> list[str]:
    """Why `tp` cannot split this model (vLLM's asserts, plamo3.py), empty when it can."""
    if tp < 1:
        return [f"tp={tp} must be >= 1"]
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if H % tp:
        problems.append(f"tp={tp} does not divide {H} attention heads")
    if tp <= K and K % tp:
        problems.append(f"tp={tp} does not divide {K} KV heads")
    if tp > K and tp % K:
        problems.append(f"{K} KV heads cannot be replicated evenly over tp={tp} (tp % K != 0)")
    if cfg.intermediate_size % tp:
        problems.append(f"tp={tp} does not divide intermediate_size {cfg.intermediate_size}")
    if cfg.padded_vocab % tp:
        problems.append(f"tp={tp} does not divide the padded vocabulary {cfg.padded_vocab}")
    if not cfg.tie_word_embeddings and cfg.lm_head_rows % tp:
        problems.append(f"tp={tp} does not divide the untied head's {cfg.lm_head_rows} padded rows")
    return problems


def tp_notes(cfg: Plamo3Config, tp: int) -> list[str]:
    K = cfg.num_key_value_heads
    if tp > K:
        return [f"KV heads replicated {tp // K}x (each rank holds one)"]
    return []


@dataclass(frozen=True)
class RankSizes:
    """What one TP rank holds: its q heads, KV heads (or one replicated), FFN slice, vocab block."""

    q_heads: int
    kv_heads: int
    ffn: int
    vocab_start: int
    vocab_rows: int  # of the embedding (and of the head's original rows)


def rank_sizes(cfg: Plamo3Config, tp: int, r: int) -> RankSizes:
    vocab_start, vocab_rows = block(cfg.padded_vocab, tp, r)
    return RankSizes(
        q_heads=block(cfg.num_attention_heads, tp, r)[1],
        kv_heads=len(kv_heads_of_rank(cfg.num_key_value_heads, tp, r)),
        ffn=block(cfg.intermediate_size, tp, r)[1],
        vocab_start=vocab_start,
        vocab_rows=vocab_rows,
    )
