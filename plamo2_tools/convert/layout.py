"""Where every element of every rank comes from: vLLM's `Plamo2ForCausalLM` per-rank layout
(plamo2-spec.md sections 5-6, shard-format.md) as pure functions, one per tensor kind.

An output tensor is described by *pieces* of one HF source tensor, concatenated along dim 0:
`Piece(source, 0, start, n)` takes source rows [start, start+n); `Piece(source, 1, start, n)`
takes columns [start, start+n) of every row; `Piece(None, 0, 0, n)` is n zero rows (vocab
padding).  Value transforms (A = -exp(A_log), norm offsets, dtype casts) act element-wise and are
listed in `transforms`; permutations such as the in_proj regrouping are expressed by the pieces
themselves, so slicing code never has to know about them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import FINAL_NORM_OFFSET, NORM_OFFSETS, Plamo2Config
from ..errors import LayoutError


@dataclass(frozen=True)
class Piece:
    source: str | None  # HF tensor name; None = zero rows
    dim: int  # 0: rows [start, start + length); 1: columns [start, start + length) of all rows
    start: int
    length: int


@dataclass(frozen=True)
class Transform:
    name: str  # regroup_in_proj | pad_vocab | neg_exp_f32 | add_offset | cast
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


@dataclass(frozen=True)
class Mapping:
    """A TP x PP split; global rank = pp_rank * tp + tp_rank (TP innermost, like vLLM/TRT-LLM)."""

    tp: int
    pp: int
    stages: tuple[tuple[int, int], ...]  # [start, stop) layer range of every PP stage

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def ranks(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a global rank."""
        return rank % self.tp, rank // self.tp


# ---- the split itself ------------------------------------------------------------------------
def pp_layer_counts(num_layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices: L // p each, the remainder one each to the stages before the last."""
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    return counts


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
    counts = layers or pp_layer_counts(cfg.num_hidden_layers, pp)
    bounds = [sum(counts[:i]) for i in range(pp + 1)]
    return Mapping(tp, pp, tuple(zip(bounds[:-1], bounds[1:], strict=True)))


# ---- one small function per tensor kind ------------------------------------------------------
def _rows(name: str, start: int, length: int) -> Piece:
    return Piece(name, 0, start, length)


def _block(n: int, tp: int, r: int) -> tuple[int, int]:
    """Start and length of rank r's contiguous block of n items."""
    return r * (n // tp), n // tp


def replicated(name: str, shape: tuple[int, ...]) -> tuple[Piece, ...]:
    return (_rows(name, 0, shape[0]),)


def split_rows(name: str, rows: int, tp: int, r: int, unit: int = 1) -> tuple[Piece, ...]:
    """Rank r's block of `rows // unit` units of `unit` rows (e.g. heads of d rows)."""
    start, n = _block(rows // unit, tp, r)
    return (_rows(name, start * unit, n * unit),)


def split_cols(name: str, cols: int, tp: int, r: int) -> tuple[Piece, ...]:
    start, n = _block(cols, tp, r)
    return (Piece(name, 1, start, n),)


def in_proj_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """HF rows are per-head [z_h; x_h]; vLLM wants [z of the rank's heads; x of the same heads]."""
    d = cfg.hidden_size_per_head
    first, n = _block(cfg.mamba_num_heads, tp, r)
    heads = range(first, first + n)
    return tuple(_rows(name, h * 2 * d, d) for h in heads) + tuple(_rows(name, h * 2 * d + d, d) for h in heads)


def kv_heads_of_rank(cfg: Plamo2Config, tp: int, r: int) -> range:
    """QKVParallelLinear: a block of KV heads, or one replicated head when Hkv < tp."""
    Hkv = cfg.num_key_value_heads
    if Hkv >= tp:
        start, n = _block(Hkv, tp, r)
        return range(start, start + n)
    g = r // (tp // Hkv)
    return range(g, g + 1)


def qkv_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    d, Hq, Hkv = cfg.hidden_size_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
    q_start, q_n = _block(Hq, tp, r)
    kv = kv_heads_of_rank(cfg, tp, r)
    return (
        _rows(name, q_start * d, q_n * d),
        _rows(name, (Hq + kv.start) * d, len(kv) * d),
        _rows(name, (Hq + Hkv + kv.start) * d, len(kv) * d),
    )


def gate_up_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    F = cfg.intermediate_size
    start, n = _block(F, tp, r)
    return (_rows(name, start, n), _rows(name, F + start, n))


def vocab_pieces(name: str, cfg: Plamo2Config, tp: int, r: int) -> tuple[Piece, ...]:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of the vocabulary zero-padded to Vp (only rows < V are real)."""
    V = cfg.vocab_size
    start, n = _block(cfg.padded_vocab, tp, r)
    real = max(0, min(start + n, V) - start)
    pieces = [_rows(name, start, real)] if real else []
    if real < n:
        pieces.append(Piece(None, 0, 0, n - real))
    return tuple(pieces)


# ---- a whole rank ------------------------------------------------------------------------------
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

    def emit(
        key: str,
        source: str,
        shape: tuple[int, ...],
        pieces: tuple[Piece, ...],
        *transforms: Transform,
        dtype: torch.dtype | None = None,
    ) -> None:  # noqa: E501
        dtype = dtype or out_dtype or source_dtypes[source]
        chain = list(transforms)
        if dtype != source_dtypes[source] and not any(t.name == "neg_exp_f32" for t in chain):
            chain.append(Transform("cast", str(dtype).removeprefix("torch.")))
        out.append(OutputTensor(key, source, shape, dtype, pieces, tuple(chain)))

    D, d = cfg.hidden_size, cfg.hidden_size_per_head
    Hm, Hq, F, I, R, N, K = (
        cfg.mamba_num_heads, cfg.num_attention_heads, cfg.intermediate_size, cfg.mamba_inner,
        cfg.dt_rank, cfg.mamba_d_state, cfg.mamba_d_conv,
    )  # fmt: skip
    vocab_rows = cfg.padded_vocab // tp
    pad = Transform("pad_vocab", cfg.padded_vocab)
    if first and not (cfg.tie_word_embeddings and mapping.pp == 1):
        # PP = 1 tied: vLLM's state_dict keeps only the lexicographically smaller alias, lm_head.
        src = "model.embed_tokens.weight"
        emit(src, src, (vocab_rows, D), vocab_pieces(src, cfg, tp, r), pad)
    start, stop = mapping.stages[stage]
    for i in range(start, stop):
        p = f"model.layers.layers.{i}."
        for norm, offset in NORM_OFFSETS.items():
            name = p + norm + ".weight"
            emit(name, name, (D,), replicated(name, (D,)), Transform("add_offset", offset))
        name = p + "mlp.gate_up_proj.weight"
        emit(name, name, (2 * F // tp, D), gate_up_pieces(name, cfg, tp, r))
        name = p + "mlp.down_proj.weight"
        emit(name, name, (D, F // tp), split_cols(name, F, tp, r))
        m = p + "mixer."
        if cfg.layer_is_mamba[i]:
            emit(m + "in_proj.weight", m + "in_proj.weight", (2 * I // tp, D),
                 in_proj_pieces(m + "in_proj.weight", cfg, tp, r), Transform("regroup_in_proj"))  # fmt: skip
            emit(m + "conv1d.weight", m + "conv1d.weight", (I // tp, 1, K), split_rows(m + "conv1d.weight", I, tp, r))
            emit(
                m + "bcdt_proj.weight",
                m + "bcdt_proj.weight",
                (R + 2 * N, I // tp),
                split_cols(m + "bcdt_proj.weight", I, tp, r),
            )
            emit(m + "dt_proj.weight", m + "dt_proj.weight", (Hm // tp, R), split_rows(m + "dt_proj.weight", Hm, tp, r))
            emit(m + "A", m + "A_log", (Hm // tp,), split_rows(m + "A_log", Hm, tp, r),
                 Transform("neg_exp_f32"), dtype=torch.float32)  # fmt: skip
            emit(m + "D", m + "D", (Hm // tp,), split_rows(m + "D", Hm, tp, r))
            emit(m + "dt_bias", m + "dt_bias", (Hm // tp,), split_rows(m + "dt_bias", Hm, tp, r))
            for norm, n in (("dt", R), ("B", N), ("C", N)):
                emit(
                    m + f"{norm}_norm.weight",
                    m + f"{norm}_norm_weight",
                    (n,),
                    replicated(m + f"{norm}_norm_weight", (n,)),
                )
            emit(
                m + "out_proj.weight", m + "out_proj.weight", (D, I // tp), split_cols(m + "out_proj.weight", I, tp, r)
            )
        else:
            kv = kv_heads_of_rank(cfg, tp, r)
            emit(m + "qkv_proj.weight", m + "qkv_proj.weight", ((Hq // tp + 2 * len(kv)) * d, D),
                 qkv_pieces(m + "qkv_proj.weight", cfg, tp, r))  # fmt: skip
            emit(m + "q_norm.weight", m + "q_weight", (Hq // tp, d), split_rows(m + "q_weight", Hq, tp, r))
            emit(m + "k_norm.weight", m + "k_weight", (len(kv), d), (_rows(m + "k_weight", kv.start, len(kv)),))
            emit(
                m + "o_proj.weight",
                m + "o_proj.weight",
                (D, Hq * d // tp),
                split_cols(m + "o_proj.weight", Hq * d, tp, r),
            )
    if last:
        emit("model.norm.weight", "model.norm.weight", (D,), replicated("model.norm.weight", (D,)),
             Transform("add_offset", FINAL_NORM_OFFSET))  # fmt: skip
        src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        emit("lm_head.weight", src, (vocab_rows, D), vocab_pieces(src, cfg, tp, r), pad)
    return sorted(out, key=lambda t: t.key)


# ---- values ------------------------------------------------------------------------------------
def apply_transforms(x: torch.Tensor, transforms: tuple[Transform, ...], dtype: torch.dtype) -> torch.Tensor:
    """Source values -> output values, element-wise, computed in float32 and rounded once."""
    for t in transforms:
        if t.name == "neg_exp_f32":
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
