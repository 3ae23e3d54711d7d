"""The layout engine: how a family's tensor table becomes an HF inventory, per-rank shard tensors and
value transforms (docs/architecture.md, "A family").  Nothing here knows a model family;
each family gives its table (`model/<family>/tensors.py`) and this module does the rest.

An output tensor is described by *pieces* of one HF source tensor, concatenated along dim 0:
`Piece(source, 0, start, n)` takes source rows [start, start+n); `Piece(source, 1, start, n)`
takes columns [start, start+n) of every row; `Piece(None, 0, 0, n)` is n zero rows (vocab
padding).  Value transforms (A = -exp(A_log), norm offsets, dtype casts) act element-wise and are
listed in `transforms`; permutations such as PLaMo 2's in_proj regrouping are expressed by the
pieces themselves, so slicing code never has to know about them.

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
from typing import TYPE_CHECKING, Any, Protocol

from ..dtypes import FLOAT32, DType, as_dtype, dtype_name
from ..errors import LayoutError
from ..parallel import Mapping

if TYPE_CHECKING:  # numpy (and numerics) on first use: reading a manifest needs neither (issue 33)
    import numpy as np


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


def parse_transform(text: str) -> Transform:
    """The inverse of `str(Transform)` (how manifests record a transform chain)."""
    if "(" not in text:
        return Transform(text)
    name, arg = text[:-1].split("(", 1)
    value: float | int | str = arg
    if name in ("add_offset", "fill"):
        value = float(arg)
    elif name == "pad_vocab":
        value = int(arg)
    return Transform(name, value)


@dataclass(frozen=True)
class OutputTensor:
    key: str
    source: str
    shape: tuple[int, ...]
    dtype: DType
    pieces: tuple[Piece, ...]
    transforms: tuple[Transform, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# ---- splitting n items over tp ranks ------------------------------------------------------------
def block(n: int, tp: int, r: int) -> tuple[int, int]:
    """Start and length of rank r's contiguous block of n items."""
    return r * (n // tp), n // tp


def rows(name: str, start: int, length: int) -> Piece:
    return Piece(name, 0, start, length)


def replicated(name: str, nrows: int) -> tuple[Piece, ...]:
    return (rows(name, 0, nrows),)


def split_rows(name: str, nrows: int, tp: int, r: int, unit: int = 1) -> tuple[Piece, ...]:
    """Rank r's block of `nrows // unit` units of `unit` rows (e.g. heads of d rows)."""
    start, n = block(nrows // unit, tp, r)
    return (rows(name, start * unit, n * unit),)


def split_cols(name: str, cols: int, tp: int, r: int) -> tuple[Piece, ...]:
    start, n = block(cols, tp, r)
    return (Piece(name, 1, start, n),)


def kv_heads_of_rank(kv_heads: int, tp: int, r: int) -> range:
    """vLLM's QKVParallelLinear: a block of KV heads, or one replicated head when Hkv < tp."""
    if kv_heads >= tp:
        start, n = block(kv_heads, tp, r)
        return range(start, start + n)
    g = r // (tp // kv_heads)
    return range(g, g + 1)


def qkv_pieces(name: str, q_heads: int, kv_heads: int, head_dim: int, tp: int, r: int) -> tuple[Piece, ...]:
    """Packed [q heads | k heads | v heads] rows: the rank's q block, then its KV heads' k and v."""
    q_start, q_n = block(q_heads, tp, r)
    kv = kv_heads_of_rank(kv_heads, tp, r)
    return (
        rows(name, q_start * head_dim, q_n * head_dim),
        rows(name, (q_heads + kv.start) * head_dim, len(kv) * head_dim),
        rows(name, (q_heads + kv_heads + kv.start) * head_dim, len(kv) * head_dim),
    )


def gate_up_pieces(name: str, ffn: int, tp: int, r: int) -> tuple[Piece, ...]:
    """Packed [gate | up] rows: the rank's gate slice, then its up slice (MergedColumnParallel)."""
    start, n = block(ffn, tp, r)
    return (rows(name, start, n), rows(name, ffn + start, n))


def padded_vocab(vocab: int) -> int:
    """ceil(V / 64) * 64: vLLM's VocabParallelEmbedding padding."""
    return math.ceil(vocab / 64) * 64


def vocab_pieces(
    name: str, real_rows: int, rank_rows: int, tp: int, r: int, first: int | None = None
) -> tuple[Piece, ...]:
    """Rank r's `rank_rows` rows of a vocab-parallel table: source rows [first, first + rank_rows)
    that exist (< real_rows), then zero rows.  `first` defaults to r * rank_rows."""
    start = r * rank_rows if first is None else first
    real = max(0, min(start + rank_rows, real_rows) - start)
    pieces = [rows(name, start, real)] if real else []
    if real < rank_rows:
        pieces.append(Piece(None, 0, 0, rank_rows - real))
    return tuple(pieces)


# ---- the table ------------------------------------------------------------------------------------
# Where a row applies: once for the model (GLOBAL), in every layer (EVERY_LAYER), or in the layers
# of one kind (any other string: a value of the config's `layer_kinds`, e.g. "mamba").
GLOBAL, EVERY_LAYER = "global", "layer"
# TP split kinds (see the module docstring).
COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
# The source of tensors that vLLM's state dict holds but no checkpoint has (a family's `extras`).
CONSTANT = "<constant>"

Rule = Callable[[str, Any, int, int], tuple[Piece, ...]]  # (HF name, config, tp, rank) -> pieces
Shape = Callable[[Any], tuple[int, ...]]
Transforms = Callable[[Any], tuple[Transform, ...]]


def no_transforms(cfg: Any) -> tuple[Transform, ...]:
    return ()


@dataclass(frozen=True)
class TensorKind:
    """One row of a family's table: one kind of tensor and every fact about it."""

    hf: str | None  # HF name (None: not in a checkpoint); layer rows are relative to the layer prefix
    vllm: str  # vLLM's name, same convention
    where: str  # GLOBAL | EVERY_LAYER | a layer kind
    shape: Shape  # HF shape
    split: str  # COLUMN | ROW | VOCAB | REPLICATED
    rule: Rule  # the rank's pieces
    transforms: Transforms = no_transforms
    init: str = "linear"  # synth's initialiser (model/synth.py)
    dtype: DType | None = None  # forced output dtype (None: the source's or the user's)
    # A dtype cast (--dtype) happens before the value transforms instead of after them: the
    # consumer's loader copies the weight into its parameter first and folds the offset there
    # (vLLM's PLaMo 3), so the shard must round twice exactly as it does.
    cast_first: bool = False


def offset(value: float) -> Transforms:
    """A norm weight stored as a delta around `value`: the shard holds value + delta."""
    return lambda cfg: (Transform("add_offset", value),)


def replicated_rule(shape: Shape) -> Rule:
    return lambda name, cfg, tp, r: replicated(name, shape(cfg)[0])


def rows_rule(size: Callable[[Any], int], unit: Callable[[Any], int] = lambda cfg: 1) -> Rule:
    return lambda name, cfg, tp, r: split_rows(name, size(cfg), tp, r, unit(cfg))


def cols_rule(size: Callable[[Any], int]) -> Rule:
    return lambda name, cfg, tp, r: split_cols(name, size(cfg), tp, r)


def channel_scale_pieces(kind: TensorKind, source: str, cfg: Any, tp: int, r: int) -> tuple[Piece, ...]:
    """TP rank r's rows of a per-output-channel scale ([rows, 1], e.g. an FP8 weight's `weight_scale`): the same
    row pieces as the weight of a column-parallel linear, all of it for a row-parallel one, whose every rank
    computes every output row (vLLM's ChannelQuantScaleParameter, output_dim 0; tests/compat/test_vllm_fp8.py
    holds vLLM's compressed-tensors loader to this)."""
    if kind.split == COLUMN:
        return kind.rule(source, cfg, tp, r)
    if kind.split == ROW:
        return replicated(source, kind.shape(cfg)[0])
    raise LayoutError(f"{kind.hf}: a {kind.split} tensor has no per-channel scale")


def vllm_scale_buffers(where: str) -> tuple[TensorKind, ...]:
    """What vLLM's state dict holds beyond the weights in every attention layer
    (docs/shard-format.md, "What vLLM requires beyond the weights"): its Attention registers four
    fp32 scalar buffers, 1.0 for an unquantized model (vllm/model_executor/layers/attention/
    attention.py, set_default_quant_scales), and ShardedStateLoader refuses a state without them."""
    return tuple(
        TensorKind(
            None,
            f"mixer.attn.{n}",
            where,
            lambda c: (),
            REPLICATED,
            lambda *_: (),
            lambda c: (Transform("fill", 1.0),),
            init="",
            dtype=FLOAT32,
        )
        for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    )


# ---- the engine: a family's table -> inventory, per-rank tensors ----------------------------------
class LayoutConfig(Protocol):
    """What the engine reads of a config (every family's config has it: model/family.py)."""

    num_hidden_layers: int
    tie_word_embeddings: bool

    @property
    def layer_kinds(self) -> tuple[str, ...]: ...


class Table(Protocol):
    """What the engine reads of a family (model/family.py `Family` has it all)."""

    tensors: tuple[TensorKind, ...]
    extras: tuple[TensorKind, ...]
    layer_prefix: str
    embed_name: str
    final_norm_name: str
    head_name: str

    def tp_problems(self, cfg: Any, tp: int) -> list[str]: ...

    def holds_globals(self, cfg: Any, mapping: Mapping, stage: int) -> set[str]: ...


def layer_of(name: str, prefix: str = "model.layers.layers.{}.") -> tuple[int | None, str]:
    """'model.layers.layers.3.mixer.A_log' -> (3, 'mixer.A_log'); global names -> (None, name)."""
    head = prefix.split("{}")[0]
    if not name.startswith(head):
        return None, name
    index, rest = name[len(head) :].split(".", 1)
    return int(index), rest


def applies(kind: TensorKind, layer_kind: str) -> bool:
    return kind.where == EVERY_LAYER or kind.where == layer_kind


def kind_of(family: Table, name: str) -> TensorKind:
    """The table row of an HF tensor name."""
    rest = layer_of(name, family.layer_prefix)[1]
    for kind in family.tensors:
        if kind.hf == rest:
            return kind
    raise KeyError(name)


def hf_tensor_shapes(family: Table, cfg: LayoutConfig) -> dict[str, tuple[int, ...]]:
    """The tensor inventory of an HF checkpoint, in the model's own order (embedding, layers in
    table order, final norm, head)."""
    rows_ = {k.hf: k for k in family.tensors if k.hf is not None}
    shapes = {family.embed_name: rows_[family.embed_name].shape(cfg)}
    layer_rows = [k for k in family.tensors if k.where != GLOBAL and k.hf is not None]
    for i, layer_kind in enumerate(cfg.layer_kinds):
        for k in layer_rows:
            if applies(k, layer_kind):
                shapes[family.layer_prefix.format(i) + k.hf] = k.shape(cfg)  # type: ignore[operator]
    shapes[family.final_norm_name] = rows_[family.final_norm_name].shape(cfg)
    if not cfg.tie_word_embeddings:
        shapes[family.head_name] = rows_[family.head_name].shape(cfg)
    return shapes


def make_mapping(family: Table, cfg: LayoutConfig, tp: int, pp: int, layers: list[int] | None = None) -> Mapping:
    problems = family.tp_problems(cfg, tp) + pp_problems(cfg.num_hidden_layers, pp, layers)
    if problems:
        raise LayoutError("; ".join(problems))
    return Mapping.even(cfg.num_hidden_layers, tp, pp, layers)


def pp_problems(num_layers: int, pp: int, layers: list[int] | None = None) -> list[str]:
    """Why `pp` stages (optionally with explicit layer counts) cannot split `num_layers` layers."""
    if pp < 1:
        return [f"pp={pp} must be >= 1"]
    if pp > num_layers:
        return [f"pp={pp} is more stages than the {num_layers} layers"]
    if layers is not None:
        if len(layers) != pp:
            return [f"--pp-layers has {len(layers)} entries but pp={pp}"]
        if sum(layers) != num_layers or min(layers) < 1:
            return [f"--pp-layers {','.join(map(str, layers))} must be >= 1 each and sum to {num_layers} layers"]
    return []


def _out_shape(src_shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> tuple[int, ...]:
    if not pieces:  # a constant: the kind's own shape
        return src_shape
    if pieces[0].dim == 1:
        return (src_shape[0], sum(p.length for p in pieces), *src_shape[2:])
    return (sum(p.length for p in pieces), *src_shape[1:])


def output_tensor(
    kind: TensorKind,
    cfg: LayoutConfig,
    tp: int,
    r: int,
    key: str,
    source: str,
    source_dtypes: dict[str, DType],
    out_dtype: DType | None,
) -> OutputTensor:
    """One rank's tensor of one table row: its pieces, shape, dtype and transform chain."""
    pieces = kind.rule(source, cfg, tp, r)
    dtype = kind.dtype or out_dtype or source_dtypes[source]
    chain = list(kind.transforms(cfg))
    if kind.dtype is None and dtype != source_dtypes[source]:
        cast = Transform("cast", dtype_name(dtype))
        chain = [cast, *chain] if kind.cast_first else [*chain, cast]
    return OutputTensor(key, source, _out_shape(kind.shape(cfg), pieces), dtype, pieces, tuple(chain))


def rank_tensors(
    family: Table,
    cfg: LayoutConfig,
    source_dtypes: dict[str, DType],
    mapping: Mapping,
    rank: int,
    out_dtype: DType | None = None,
) -> list[OutputTensor]:
    """Every tensor global rank `rank` holds, in vLLM's names, sorted by key: the layers of its PP
    stage (table rows and the family's constant extras) and the global tensors the family says
    the stage holds (`Family.holds_globals`: which of embedding, final norm and head)."""
    tp = mapping.tp
    r, stage = mapping.ranks(rank)
    out: list[OutputTensor] = []

    def emit(kind: TensorKind, key: str, source: str) -> None:
        out.append(output_tensor(kind, cfg, tp, r, key, source, source_dtypes, out_dtype))

    by_hf = {k.hf: k for k in family.tensors if k.hf is not None}
    embed, norm, head = by_hf[family.embed_name], by_hf[family.final_norm_name], by_hf[family.head_name]
    holds = family.holds_globals(cfg, mapping, stage)
    if "embed" in holds:
        emit(embed, embed.vllm, embed.hf)  # type: ignore[arg-type]
    start, stop = mapping.stages[stage]
    for i in range(start, stop):
        prefix = family.layer_prefix.format(i)
        layer_kind = cfg.layer_kinds[i]
        for kind in family.tensors:
            if kind.where != GLOBAL and applies(kind, layer_kind):
                emit(kind, prefix + kind.vllm, prefix + kind.hf)  # type: ignore[operator]
        for kind in family.extras:
            if applies(kind, layer_kind):
                emit(kind, prefix + kind.vllm, CONSTANT)
    if "norm" in holds:
        emit(norm, norm.vllm, norm.hf)  # type: ignore[arg-type]
    if "head" in holds:
        emit(head, head.vllm, embed.hf if cfg.tie_word_embeddings else head.hf)  # type: ignore[arg-type]
    return sorted(out, key=lambda t: t.key)


# ---- values ---------------------------------------------------------------------------------------
# The chain's meaning, once in numpy (what convert runs) and once in torch (the formulation the
# shards were first written with: the tests' oracle, and what the runtime's callers may use).
def apply_values(x: np.ndarray, src: DType, transforms: tuple[Transform, ...], dtype: DType) -> np.ndarray:
    """Source values (numpy, held as `src.storage`) -> output values held as `dtype.storage`, in
    the chain's order: arithmetic in float32, a `cast` rounds where it stands (last, unless the
    row casts first), and the result is rounded to the output dtype once more at the end (a no-op
    after a final cast).  The same rounding as `apply_transforms`, bit for bit (numerics.py); the
    few casts numpy has no exact rounding for (to float8, float64 to a 16-bit float) go through
    torch, imported only then."""
    from .. import numerics

    try:
        return _apply_values(x, src, transforms, dtype)
    except NotImplementedError:
        return numerics.from_torch(apply_transforms(numerics.to_torch(x, src), transforms, dtype))[0]


def _apply_values(x: np.ndarray, src: DType, transforms: tuple[Transform, ...], dtype: DType) -> np.ndarray:
    import numpy as np

    from .. import numerics

    cur = src
    for t in transforms:
        if t.name == "cast":
            target = as_dtype(str(t.arg))
            x, cur = numerics.cast(x, cur, target), target
        elif t.name == "fill":
            x, cur = np.full(x.shape, float(t.arg), np.float32), FLOAT32  # type: ignore[arg-type]
        elif t.name == "neg_exp_f32":
            x, cur = -numerics.exp_float32(numerics.to_float32(x, cur)), FLOAT32
        elif t.name == "add_offset":
            x, cur = numerics.to_float32(x, cur) + np.float32(t.arg), FLOAT32  # type: ignore[arg-type]
    return numerics.cast(x, cur, dtype)


def invert_values(x: np.ndarray, src: DType, transforms: tuple[Transform, ...], dtype: DType) -> np.ndarray:
    """Output values -> source values (exact for pure reshards, within rounding otherwise); torch
    where numpy has no exact rounding, as in `apply_values`."""
    from .. import numerics

    try:
        return _invert_values(x, src, transforms, dtype)
    except NotImplementedError:
        return numerics.from_torch(invert_transforms(numerics.to_torch(x, src), transforms, dtype))[0]


def _invert_values(x: np.ndarray, src: DType, transforms: tuple[Transform, ...], dtype: DType) -> np.ndarray:
    import numpy as np

    from .. import numerics

    cur = src
    for t in reversed(transforms):
        if t.name == "neg_exp_f32":
            x, cur = numerics.log_float32(-numerics.to_float32(x, cur)), FLOAT32
        elif t.name == "add_offset":
            x, cur = numerics.to_float32(x, cur) - np.float32(t.arg), FLOAT32  # type: ignore[arg-type]
    return numerics.cast(x, cur, dtype)


def apply_transforms(x: Any, transforms: tuple[Transform, ...], dtype: Any) -> Any:
    """`apply_values` in torch (torch tensors in and out; imports torch)."""
    import torch

    dtype = as_dtype(dtype).torch
    for t in transforms:
        if t.name == "cast":
            x = x.to(getattr(torch, str(t.arg)))
        elif t.name == "fill":
            x = torch.full(x.shape, float(t.arg))  # type: ignore[arg-type]
        elif t.name == "neg_exp_f32":
            x = -torch.exp(x.float())
        elif t.name == "add_offset":
            x = x.float() + float(t.arg)  # type: ignore[arg-type]
    return x.to(dtype)


def invert_transforms(x: Any, transforms: tuple[Transform, ...], dtype: Any) -> Any:
    """`invert_values` in torch."""
    import torch

    dtype = as_dtype(dtype).torch
    for t in reversed(transforms):
        if t.name == "neg_exp_f32":
            x = torch.log(-x.float())
        elif t.name == "add_offset":
            x = x.float() - float(t.arg)  # type: ignore[arg-type]
    return x.to(dtype)
