"""PLaMo 2's tensors in one table, and everything derived from it (docs/model.md, "Tensors").

Each row of `TENSORS` says, for one kind of tensor: its Hugging Face name, its name in vLLM's
`Plamo2ForCausalLM`, where it lives (once, per layer, per Mamba or attention layer), its HF shape,
how tensor parallelism splits it, the value transforms the converter applies, and how `synth`
initialises it.  The HF inventory (`hf_tensor_shapes`), the per-rank layout the converter writes
(`rank_tensors`), the per-rank sizes the runtime allocates (`rank_sizes`) and synth's initialisers
all read this table; nothing else spells out a tensor.

An output tensor is described by *pieces* of one HF source tensor, concatenated along dim 0:
`Piece(source, 0, start, n)` takes source rows [start, start+n); `Piece(source, 1, start, n)`
takes columns [start, start+n) of every row; `Piece(None, 0, 0, n)` is n zero rows (vocab
padding).  Value transforms (A = -exp(A_log), norm offsets, dtype casts) act element-wise and are
listed in `transforms`; permutations such as the in_proj regrouping are expressed by the pieces
themselves, so slicing code never has to know about them.

The TP split kinds say what the runtime must do after using the tensor:
  column      output rows split over ranks; no communication
  row         input columns split over ranks; the product is a partial sum -> TP all-reduce
  vocab       rows of the padded vocabulary split; embedding -> all-reduce, head -> all-gather
  replicated  every rank holds all of it
(`tests/runtime/test_collectives.py` checks the runtime all-reduces after exactly the `row` and
`vocab` embedding entries.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..dtypes import dtype_name
from ..errors import LayoutError
from ..parallel import Mapping
from .config import FINAL_NORM_OFFSET, NORM_OFFSETS, Plamo2Config


@dataclass(frozen=True)
class Piece:
    source: str | None  # HF tensor name; None = zero rows
    dim: int  # 0: rows [start, start + length); 1: columns [start, start + length) of all rows
    start: int
    length: int


@dataclass(frozen=True)
class Transform:
    name: str  # regroup_in_proj | pad_vocab | neg_exp_f32 | add_offset | cast | fill
    arg: float | int | str | None = None

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}({self.arg})"


@dataclass(frozen=True)
class OutputTensor:
    key: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    transforms: tuple[Transform, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


# ---- splitting n items over tp ranks ------------------------------------------------------------
def _block(n: int, tp: int, r: int) -> tuple[int, int]:
    """Start and length of rank r's contiguous block of n items."""
    return r * (n // tp), n // tp


def _rows(name: str, start: int, length: int) -> Piece:
    return Piece(name, 0, start, length)


def replicated(name: str, rows: int) -> tuple[Piece, ...]:
    return (_rows(name, 0, rows),)


def split_rows(name: str, rows: int, tp: int, r: int, unit: int = 1) -> tuple[Piece, ...]:
    """Rank r's block of `rows // unit` units of `unit` rows (e.g. heads of d rows)."""
    start, n = _block(rows // unit, tp, r)
    return (_rows(name, start * unit, n * unit),)


def split_cols(name: str, cols: int, tp: int, r: int) -> tuple[Piece, ...]:
    start, n = _block(cols, tp, r)
    return (Piece(name, 1, start, n),)


def kv_heads_of_rank(cfg: Plamo2Config, tp: int, r: int) -> range:
    """QKVParallelLinear: a block of KV heads, or one replicated head when Hkv < tp."""
    Hkv = cfg.num_key_value_heads
    if Hkv >= tp:
        start, n = _block(Hkv, tp, r)
        return range(start, start + n)
    g = r // (tp // Hkv)
    return range(g, g + 1)


def vocab_block(cfg: Plamo2Config, tp: int, r: int) -> tuple[int, int]:
    """Rank r's rows [start, start + n) of the vocabulary padded to a multiple of 64."""
    return _block(cfg.padded_vocab, tp, r)


# ---- one small rule per tensor kind: (HF name, cfg, tp, rank) -> pieces -------------------------
Rule = Callable[[str, Plamo2Config, int, int], tuple[Piece, ...]]


def _replicated(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    return replicated(name, _shape_of(name, cfg)[0])


def _rows_by(size: Callable[[Plamo2Config], int]) -> Rule:
    return lambda name, cfg, tp, r: split_rows(name, size(cfg), tp, r)


def _cols_by(size: Callable[[Plamo2Config], int]) -> Rule:
    return lambda name, cfg, tp, r: split_cols(name, size(cfg), tp, r)


def in_proj_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """HF rows are per-head [z_h; x_h]; vLLM wants [z of the rank's heads; x of the same heads]."""
    d = cfg.hidden_size_per_head
    first, n = _block(cfg.mamba_num_heads, tp, r)
    heads = range(first, first + n)
    return tuple(_rows(name, h * 2 * d, d) for h in heads) + tuple(_rows(name, h * 2 * d + d, d) for h in heads)


def qkv_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    d, Hq, Hkv = cfg.hidden_size_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
    q_start, q_n = _block(Hq, tp, r)
    kv = kv_heads_of_rank(cfg, tp, r)
    return (
        _rows(name, q_start * d, q_n * d),
        _rows(name, (Hq + kv.start) * d, len(kv) * d),
        _rows(name, (Hq + Hkv + kv.start) * d, len(kv) * d),
    )


def k_norm_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """k_norm follows the rank's KV head(s), replicated like them (vLLM's HF loader gets this
    wrong for 1 < Hkv < tp; docs/model.md, "vLLM quirks")."""
    kv = kv_heads_of_rank(cfg, tp, r)
    return (_rows(name, kv.start, len(kv)),)


def gate_up_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    F = cfg.intermediate_size
    start, n = _block(F, tp, r)
    return (_rows(name, start, n), _rows(name, F + start, n))


def vocab_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of the vocabulary zero-padded to Vp (only rows < V are real)."""
    V = cfg.vocab_size
    start, n = vocab_block(cfg, tp, r)
    real = max(0, min(start + n, V) - start)
    pieces = [_rows(name, start, real)] if real else []
    if real < n:
        pieces.append(Piece(None, 0, 0, n - real))
    return tuple(pieces)


# ---- the table ------------------------------------------------------------------------------------
# Where a row applies: once for the model, or in every layer / Mamba layers / attention layers.
GLOBAL, EVERY_LAYER, MAMBA, ATTENTION = "global", "layer", "mamba", "attention"
# TP split kinds (see the module docstring).
COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"


# The source of tensors that vLLM's state dict holds but no checkpoint has (see VLLM_EXTRAS).
CONSTANT = "<constant>"


@dataclass(frozen=True)
class TensorKind:
    hf: str | None  # HF name (None: not in a checkpoint); layer rows are relative to "model.layers.layers.{i}."
    vllm: str  # vLLM's name, same convention
    where: str  # GLOBAL | EVERY_LAYER | MAMBA | ATTENTION
    shape: Callable[[Plamo2Config], tuple[int, ...]]  # HF shape
    split: str  # COLUMN | ROW | VOCAB | REPLICATED
    rule: Rule  # the rank's pieces
    transforms: Callable[[Plamo2Config], tuple[Transform, ...]] = lambda cfg: ()
    init: str = "linear"  # synth's initialiser (model/synth.py)
    dtype: torch.dtype | None = None  # forced output dtype (None: the source's or the user's)


def _offset(value: float) -> Callable[[Plamo2Config], tuple[Transform, ...]]:
    return lambda cfg: (Transform("add_offset", value),)


def _pad(cfg: Plamo2Config) -> tuple[Transform, ...]:
    return (Transform("pad_vocab", cfg.padded_vocab),)


def _norm(name: str) -> TensorKind:
    return TensorKind(f"{name}.weight", f"{name}.weight", EVERY_LAYER, lambda c: (c.hidden_size,), REPLICATED,
                      _replicated, _offset(NORM_OFFSETS[name]), init="norm_delta")  # fmt: skip


def _I(c: Plamo2Config) -> int:
    return c.mamba_inner


# fmt: off
TENSORS: tuple[TensorKind, ...] = (
    TensorKind("model.embed_tokens.weight", "model.embed_tokens.weight", GLOBAL,
               lambda c: (c.vocab_size, c.hidden_size), VOCAB, vocab_pieces, _pad, init="embedding"),
    *(_norm(n) for n in NORM_OFFSETS),
    TensorKind("mlp.gate_up_proj.weight", "mlp.gate_up_proj.weight", EVERY_LAYER,
               lambda c: (2 * c.intermediate_size, c.hidden_size), COLUMN, gate_up_pieces),
    TensorKind("mlp.down_proj.weight", "mlp.down_proj.weight", EVERY_LAYER,
               lambda c: (c.hidden_size, c.intermediate_size), ROW, _cols_by(lambda c: c.intermediate_size)),
    # ---- Mamba mixer
    TensorKind("mixer.in_proj.weight", "mixer.in_proj.weight", MAMBA,
               lambda c: (2 * _I(c), c.hidden_size), COLUMN, in_proj_pieces,
               lambda c: (Transform("regroup_in_proj"),)),
    TensorKind("mixer.conv1d.weight", "mixer.conv1d.weight", MAMBA,
               lambda c: (_I(c), 1, c.mamba_d_conv), COLUMN, _rows_by(_I), init="conv"),
    TensorKind("mixer.bcdt_proj.weight", "mixer.bcdt_proj.weight", MAMBA,
               lambda c: (c.dt_rank + 2 * c.mamba_d_state, _I(c)), ROW, _cols_by(_I)),
    TensorKind("mixer.dt_proj.weight", "mixer.dt_proj.weight", MAMBA,
               lambda c: (c.mamba_num_heads, c.dt_rank), COLUMN, _rows_by(lambda c: c.mamba_num_heads), init="dt_proj"),
    TensorKind("mixer.dt_bias", "mixer.dt_bias", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, _rows_by(lambda c: c.mamba_num_heads), init="dt_bias"),
    TensorKind("mixer.A_log", "mixer.A", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, _rows_by(lambda c: c.mamba_num_heads),
               lambda c: (Transform("neg_exp_f32"),), init="A_log", dtype=torch.float32),
    TensorKind("mixer.D", "mixer.D", MAMBA,
               lambda c: (c.mamba_num_heads,), COLUMN, _rows_by(lambda c: c.mamba_num_heads), init="D"),
    TensorKind("mixer.dt_norm_weight", "mixer.dt_norm.weight", MAMBA,
               lambda c: (c.dt_rank,), REPLICATED, _replicated, init="norm_scale"),
    TensorKind("mixer.B_norm_weight", "mixer.B_norm.weight", MAMBA,
               lambda c: (c.mamba_d_state,), REPLICATED, _replicated, init="norm_scale"),
    TensorKind("mixer.C_norm_weight", "mixer.C_norm.weight", MAMBA,
               lambda c: (c.mamba_d_state,), REPLICATED, _replicated, init="norm_scale"),
    TensorKind("mixer.out_proj.weight", "mixer.out_proj.weight", MAMBA,
               lambda c: (c.hidden_size, _I(c)), ROW, _cols_by(_I)),
    # ---- attention mixer
    TensorKind("mixer.qkv_proj.weight", "mixer.qkv_proj.weight", ATTENTION,
               lambda c: ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.hidden_size_per_head, c.hidden_size),
               COLUMN, qkv_pieces),
    TensorKind("mixer.q_weight", "mixer.q_norm.weight", ATTENTION,
               lambda c: (c.num_attention_heads, c.hidden_size_per_head), COLUMN,
               _rows_by(lambda c: c.num_attention_heads), init="norm_scale"),
    TensorKind("mixer.k_weight", "mixer.k_norm.weight", ATTENTION,
               lambda c: (c.num_key_value_heads, c.hidden_size_per_head), COLUMN, k_norm_pieces, init="norm_scale"),
    TensorKind("mixer.o_proj.weight", "mixer.o_proj.weight", ATTENTION,
               lambda c: (c.hidden_size, c.num_attention_heads * c.hidden_size_per_head), ROW,
               _cols_by(lambda c: c.num_attention_heads * c.hidden_size_per_head)),
    # ---- after the layers
    TensorKind("model.norm.weight", "model.norm.weight", GLOBAL,
               lambda c: (c.hidden_size,), REPLICATED, _replicated, _offset(FINAL_NORM_OFFSET), init="norm_delta"),
    TensorKind("lm_head.weight", "lm_head.weight", GLOBAL,
               lambda c: (c.lm_head_rows, c.hidden_size), VOCAB, vocab_pieces, _pad, init="embedding"),
)
# fmt: on


def _vllm_scale(name: str) -> TensorKind:
    return TensorKind(None, f"mixer.attn.{name}", ATTENTION, lambda c: (), REPLICATED, lambda *_: (),
                      lambda c: (Transform("fill", 1.0),), init="", dtype=torch.float32)  # fmt: skip


# What vLLM's state dict holds beyond the weights (docs/shard-format.md, "What vLLM requires beyond
# the weights"): its Attention layer registers four fp32 scalar buffers, 1.0 for an unquantized
# model (vllm/model_executor/layers/attention/attention.py, set_default_quant_scales), and
# ShardedStateLoader refuses a state without them.
VLLM_EXTRAS: tuple[TensorKind, ...] = tuple(_vllm_scale(n) for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"))
KINDS_BY_HF = {k.hf: k for k in TENSORS if k.hf is not None}
LAYER_PREFIX = "model.layers.layers.{}."


def layer_of(name: str) -> tuple[int | None, str]:
    """'model.layers.layers.3.mixer.A_log' -> (3, 'mixer.A_log'); global names -> (None, name)."""
    prefix = "model.layers.layers."
    if not name.startswith(prefix):
        return None, name
    index, rest = name[len(prefix) :].split(".", 1)
    return int(index), rest


def kind_of(name: str) -> TensorKind:
    """The table row of an HF tensor name."""
    return KINDS_BY_HF[layer_of(name)[1]]


def _applies(kind: TensorKind, is_mamba: bool) -> bool:
    return kind.where == EVERY_LAYER or kind.where == (MAMBA if is_mamba else ATTENTION)


def _shape_of(name: str, cfg: Plamo2Config) -> tuple[int, ...]:
    return kind_of(name).shape(cfg)


def hf_tensor_shapes(cfg: Plamo2Config) -> dict[str, tuple[int, ...]]:
    """The tensor inventory of an HF checkpoint, in the model's own order."""
    layer_kinds = [k for k in TENSORS if k.where != GLOBAL and k.hf is not None]
    shapes = {"model.embed_tokens.weight": KINDS_BY_HF["model.embed_tokens.weight"].shape(cfg)}
    for i, is_mamba in enumerate(cfg.layer_is_mamba):
        for k in layer_kinds:
            if _applies(k, is_mamba):
                shapes[LAYER_PREFIX.format(i) + k.hf] = k.shape(cfg)
    shapes["model.norm.weight"] = KINDS_BY_HF["model.norm.weight"].shape(cfg)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = KINDS_BY_HF["lm_head.weight"].shape(cfg)
    return shapes


def accepted_shapes(cfg: Plamo2Config, name: str) -> tuple[tuple[int, ...], ...]:
    """Shapes a checkpoint may hold for `name`: the canonical one, and for an untied lm_head also
    exactly `vocab_size` rows (HF's remote code rounds up to 16; other exports do not).  Rows
    beyond V are never used, so both convert to the same shards."""
    shape = kind_of(name).shape(cfg)
    if name == "lm_head.weight":
        return (shape, (cfg.vocab_size, cfg.hidden_size))
    return (shape,)


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


def pp_problems(cfg: Plamo2Config, pp: int, layers: list[int] | None = None) -> list[str]:
    L = cfg.num_hidden_layers
    if pp < 1:
        return [f"pp={pp} must be >= 1"]
    if pp > L:
        return [f"pp={pp} is more stages than the {L} layers"]
    if layers is not None:
        if len(layers) != pp:
            return [f"--pp-layers has {len(layers)} entries but pp={pp}"]
        if sum(layers) != L or min(layers) < 1:
            return [f"--pp-layers {','.join(map(str, layers))} must be >= 1 each and sum to {L} layers"]
    return []


def make_mapping(cfg: Plamo2Config, tp: int, pp: int, layers: list[int] | None = None) -> Mapping:
    problems = tp_problems(cfg, tp) + pp_problems(cfg, pp, layers)
    if problems:
        raise LayoutError("; ".join(problems))
    return Mapping.even(cfg.num_hidden_layers, tp, pp, layers)


# ---- a whole rank ---------------------------------------------------------------------------------
def _out_shape(src_shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> tuple[int, ...]:
    if not pieces:  # a constant: the kind's own shape
        return src_shape
    if pieces[0].dim == 1:
        return (src_shape[0], sum(p.length for p in pieces), *src_shape[2:])
    return (sum(p.length for p in pieces), *src_shape[1:])


def _output(
    kind: TensorKind,
    cfg: Plamo2Config,
    tp: int,
    r: int,
    key: str,
    source: str,
    source_dtypes: dict[str, torch.dtype],
    out_dtype: torch.dtype | None,
) -> OutputTensor:
    pieces = kind.rule(source, cfg, tp, r)
    dtype = kind.dtype or out_dtype or source_dtypes[source]
    chain = list(kind.transforms(cfg))
    if kind.dtype is None and dtype != source_dtypes[source]:
        chain.append(Transform("cast", dtype_name(dtype)))
    return OutputTensor(key, source, _out_shape(kind.shape(cfg), pieces), dtype, pieces, tuple(chain))


def rank_tensors(
    cfg: Plamo2Config,
    source_dtypes: dict[str, torch.dtype],
    mapping: Mapping,
    rank: int,
    out_dtype: torch.dtype | None = None,
) -> list[OutputTensor]:
    """Every tensor global rank `rank` holds, in vLLM's names, sorted by key."""
    tp = mapping.tp
    r, stage = mapping.ranks(rank)
    first, last = stage == 0, stage == mapping.pp - 1
    out: list[OutputTensor] = []

    def emit(kind: TensorKind, key: str, source: str) -> None:
        out.append(_output(kind, cfg, tp, r, key, source, source_dtypes, out_dtype))

    embed, head = KINDS_BY_HF["model.embed_tokens.weight"], KINDS_BY_HF["lm_head.weight"]
    if first and not (cfg.tie_word_embeddings and mapping.pp == 1):
        # PP = 1 tied: vLLM's state_dict keeps only the lexicographically smaller alias, lm_head.
        emit(embed, embed.vllm, embed.hf)
    start, stop = mapping.stages[stage]
    for i in range(start, stop):
        prefix = LAYER_PREFIX.format(i)
        for kind in TENSORS:
            if kind.where != GLOBAL and _applies(kind, cfg.layer_is_mamba[i]):
                emit(kind, prefix + kind.vllm, prefix + kind.hf)  # type: ignore[operator]
        for kind in VLLM_EXTRAS:
            if _applies(kind, cfg.layer_is_mamba[i]):
                emit(kind, prefix + kind.vllm, CONSTANT)
    if last:
        norm = KINDS_BY_HF["model.norm.weight"]
        emit(norm, norm.vllm, norm.hf)
        emit(head, head.vllm, embed.hf if cfg.tie_word_embeddings else head.hf)
    return sorted(out, key=lambda t: t.key)


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
    vocab_start, vocab_rows = vocab_block(cfg, tp, r)
    return RankSizes(
        mamba_heads=_block(cfg.mamba_num_heads, tp, r)[1],
        q_heads=_block(cfg.num_attention_heads, tp, r)[1],
        kv_heads=len(kv_heads_of_rank(cfg, tp, r)),
        ffn=_block(cfg.intermediate_size, tp, r)[1],
        vocab_start=vocab_start,
        vocab_rows=vocab_rows,
    )


# ---- values ---------------------------------------------------------------------------------------
def apply_transforms(x: torch.Tensor, transforms: tuple[Transform, ...], dtype: torch.dtype) -> torch.Tensor:
    """Source values -> output values, element-wise, computed in float32 and rounded once."""
    for t in transforms:
        if t.name == "fill":
            x = torch.full(x.shape, float(t.arg))  # type: ignore[arg-type]
        elif t.name == "neg_exp_f32":
            x = -torch.exp(x.float())
        elif t.name == "add_offset":
            x = x.float() + float(t.arg)  # type: ignore[arg-type]
    return x.to(dtype)


def invert_transforms(x: torch.Tensor, transforms: tuple[Transform, ...], dtype: torch.dtype) -> torch.Tensor:
    """Output values -> source values (exact for pure reshards, within rounding otherwise)."""
    for t in reversed(transforms):
        if t.name == "neg_exp_f32":
            x = torch.log(-x.float())
        elif t.name == "add_offset":
            x = x.float() - float(t.arg)  # type: ignore[arg-type]
    return x.to(dtype)
