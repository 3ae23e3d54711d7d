"""The one comparison of a deployment against the reference: pure functions over numpy arrays.

Per sequence, at every compared position i (the prediction made after reading `ids[:i+1]`, see
`target.py`), the reference gives float64 log-probabilities over the whole vocabulary and the
target gives either the same (`full` KL) or only its top-K alternatives plus the log-probability
of the sequence's next token (`top-k` KL, what OpenAI-compatible servers return).  Every position
gets:

* **KL(reference ‖ target)**.  Full: `Σ_v p(v) (log p(v) − log q(v))` over the vocabulary.
  Top-K (`kl_topk`): the reference's K most likely tokens R (K = how many the target returned at
  that position) and one bucket for everything else; `q(t)` for t in R is the target's value when
  t is in its top-K, else the target's K-th value (the most t can have and stay out of its top-K),
  and the target's bucket holds `1 − Σ_R q(t)` (at least `BUCKET_FLOOR`).  When the two top-K sets
  agree, as they do for a faithful target, this is exactly the KL of the (K+1)-bucket coarse
  graining, which by the data-processing inequality never exceeds the full KL: a top-K KL is a
  lower bound, so its thresholds catch less, never more.
* **top-1**: the reference's argmax and the target's (the best of its top-K); they *agree* when
  equal.  A flip is a *near tie* when the reference itself puts less than `tie_margin` nats between
  its own top-1 and the target's (PLaMo's sampled text cannot tell such tokens apart; random
  synthetic models are full of them), otherwise it is a divergence.
* **log-prob difference** of the sequence's next token: `log q(next) − log p(next)`, exact for
  every target kind (servers return the chosen or echoed token's own log-prob).

A position *diverges* when its KL exceeds `kl_position`, its |log-prob difference| exceeds
`logprob_diff`, or its top-1 flips by `tie_margin` or more (NaN anywhere diverges).  The first
divergent position (smallest prompt index, then smallest position) is what a report names.

Greedy continuations are compared along the target's own path: the reference is run on the
prompt + the target's tokens, so every step is judged with the same per-position rule (the
reference's argmax at step j is what it would have chosen after the same prefix), and the greedy
match length is the number of steps before the first token the reference would not have chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

KL_FULL = "full"  # over the whole vocabulary
KL_TOPK = "top-k"  # over the reference's top-K plus one bucket (module docstring)
BUCKET_FLOOR = 1e-30  # the target's "rest" bucket never holds less (a top-K summing to 1 in float32)


@dataclass(frozen=True)
class Thresholds:
    """Pass criteria for one target precision (docs/deploy.md says where each number comes from)."""

    precision: str
    kl_position: float  # nats: a position whose KL(ref ‖ target) is above this diverges
    kl_mean: float  # nats: the mean KL over every compared position must stay at or below this
    logprob_diff: float  # nats: |log q(next) − log p(next)| above this diverges
    tie_margin: float  # nats: a top-1 flip where the reference's own gap is below this is a near tie

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# fp32 against the float64 reference: accumulated fp32 rounding only (measured on the tiny presets:
# KL ≤ 1e-10, |Δ log p| ≤ 1e-5); the bounds leave two to three orders of magnitude for TF32 GPUs
# and long sequences while a one-key window error (KL ~1e-3 on tiny3) or a swapped head still fails.
# Half precision rounds every activation (bf16 significand 8 bits, fp16 11): docs/deploy.md
# lists the measured per-position KL of our own runtime in each; the bounds sit above those by a
# factor of ~10.  Quantized: llama.cpp's own reported mean KLD is ~1e-3 (Q8_0) to ~0.1 (Q4_0) on
# real models; a broken graph (RoPE off, wrong window) is ≥ 1 nat on average.
THRESHOLDS: dict[str, Thresholds] = {
    "float32": Thresholds("float32", kl_position=1e-5, kl_mean=1e-6, logprob_diff=1e-2, tie_margin=1e-3),
    "float16": Thresholds("float16", kl_position=2e-2, kl_mean=2e-3, logprob_diff=0.25, tie_margin=0.05),
    "bfloat16": Thresholds("bfloat16", kl_position=0.1, kl_mean=1e-2, logprob_diff=0.5, tie_margin=0.1),
    "quantized": Thresholds("quantized", kl_position=1.0, kl_mean=0.1, logprob_diff=2.0, tie_margin=0.5),
}
PRECISIONS = tuple(THRESHOLDS)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (max-shifted: no overflow, -inf stays -inf)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kl_full(ref_lp: np.ndarray, target_lp: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) per row from log-probabilities (n, V): tokens the reference rules out (p = 0)
    contribute nothing, tokens the target rules out where p > 0 make it +inf."""
    p = np.exp(ref_lp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (ref_lp - target_lp), 0.0)
    return terms.sum(axis=-1)


def kl_topk(ref_lp: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray) -> np.ndarray:
    """KL over the reference's top-K and one bucket for the rest (module docstring), per row.

    `top_ids` / `top_lps` (n, Kmax): the target's alternatives at each position, padded with id -1
    (and any log-prob) where it gave fewer; K is the number of valid entries of the row."""
    n = ref_lp.shape[0]
    out = np.empty(n, dtype=np.float64)
    for r in range(n):
        valid = top_ids[r] >= 0
        ids, lps = top_ids[r][valid].astype(np.int64), top_lps[r][valid].astype(np.float64)
        k = int(ids.size)
        if k == 0:
            out[r] = np.nan
            continue
        row = ref_lp[r]
        ref_top = np.argsort(-row, kind="stable")[:k]
        known = dict(zip(ids.tolist(), lps.tolist(), strict=True))
        ceiling = float(lps.min())  # a token outside the target's top-K has at most its K-th value
        q = np.array([known.get(int(t), ceiling) for t in ref_top], dtype=np.float64)
        p = row[ref_top]
        rest = np.delete(row, ref_top)
        p_rest_log = _logsumexp(rest)
        q_rest = max(1.0 - float(np.exp(q).sum()), BUCKET_FLOOR)
        terms = np.where(np.exp(p) > 0, np.exp(p) * (p - q), 0.0).sum()
        if np.isfinite(p_rest_log):
            terms += math.exp(p_rest_log) * (p_rest_log - math.log(q_rest))
        out[r] = terms
    return out


def _logsumexp(x: np.ndarray) -> float:
    if x.size == 0:
        return -math.inf
    m = float(np.max(x))
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(x - m).sum()))


def top_arrays(top: Sequence[dict[int, float]], k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-position {token id: log-prob} dicts -> (ids, log-probs) arrays (n, Kmax), padded with -1
    / -inf, each row the K largest (a server adds the chosen token to its top-K: K+1 entries)."""
    rows = [sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[: (k or len(d))] for d in top]
    width = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    lps = np.full((len(rows), width), -np.inf, dtype=np.float64)
    for i, r in enumerate(rows):
        for j, (t, v) in enumerate(r):
            ids[i, j], lps[i, j] = t, v
    return ids, lps


@dataclass(frozen=True)
class PositionScores:
    """One sequence's compared positions (absolute positions in the sequence, ascending)."""

    positions: np.ndarray  # (n,) int
    next_tokens: np.ndarray  # (n,) the token each position predicts in this sequence
    kl: np.ndarray  # (n,) KL(ref ‖ target), full or top-K
    ref_top1: np.ndarray  # (n,) the reference's argmax
    target_top1: np.ndarray  # (n,) the target's argmax (-1 where it gave nothing)
    ref_logprob: np.ndarray  # (n,) log p(next) under the reference
    target_logprob: np.ndarray  # (n,) log q(next) under the target
    ref_gap: np.ndarray  # (n,) log p(ref top-1) − log p(target top-1) ≥ 0 (inf: the target gave none)
    divergent: np.ndarray  # (n,) bool

    @property
    def logprob_diff(self) -> np.ndarray:
        return self.target_logprob - self.ref_logprob

    @property
    def flips(self) -> np.ndarray:
        return self.ref_top1 != self.target_top1


def score_positions(
    ref_lp: np.ndarray,
    next_tokens: Sequence[int],
    thresholds: Thresholds,
    positions: Sequence[int] | None = None,
    target_lp: np.ndarray | None = None,
    top: Sequence[dict[int, float]] | None = None,
    target_token_lp: Sequence[float] | None = None,
) -> PositionScores:
    """Compare one sequence's positions: the reference's log-probs (n, V) and the target's full
    log-probs (n, V), or its top-K dicts plus its log-prob of each next token."""
    ref_lp = np.asarray(ref_lp, dtype=np.float64)
    n = ref_lp.shape[0]
    nxt = np.asarray(next_tokens, dtype=np.int64)
    rows = np.arange(n)
    pos = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    if nxt.shape != (n,) or pos.shape != (n,):
        raise ValueError("score_positions: one next token and one position per reference row")
    ref_top1 = np.argmax(ref_lp, axis=-1) if n else np.zeros(0, dtype=np.int64)
    if target_lp is not None:
        target_lp = np.asarray(target_lp, dtype=np.float64)
        if target_lp.shape != ref_lp.shape:
            raise ValueError(f"score_positions: target log-probs {target_lp.shape} vs reference {ref_lp.shape}")
        kl = kl_full(ref_lp, target_lp)
        tgt_top1 = np.argmax(target_lp, axis=-1) if n else np.zeros(0, dtype=np.int64)
        tgt_next = target_lp[rows, nxt]
    else:
        if top is None or target_token_lp is None or len(top) != n or len(target_token_lp) != n:
            raise ValueError("score_positions: a top-K target needs one top dict and one token log-prob per row")
        ids, lps = top_arrays(top)
        kl = kl_topk(ref_lp, ids, lps) if n else np.zeros(0)
        best = np.argmax(lps, axis=-1) if ids.size else np.zeros(n, dtype=np.int64)
        tgt_top1 = ids[rows, best] if ids.size else np.full(n, -1, dtype=np.int64)
        tgt_next = np.asarray(target_token_lp, dtype=np.float64)
    ref_next = ref_lp[rows, nxt]
    safe_top = np.where(tgt_top1 >= 0, tgt_top1, 0)
    gap = np.where(tgt_top1 >= 0, ref_lp[rows, ref_top1] - ref_lp[rows, safe_top], np.inf)
    diff = tgt_next - ref_next
    with np.errstate(invalid="ignore"):
        divergent = ~(kl <= thresholds.kl_position) | ~(np.abs(diff) <= thresholds.logprob_diff)
        divergent |= (tgt_top1 != ref_top1) & ~(gap < thresholds.tie_margin)
    return PositionScores(pos, nxt, kl, ref_top1, tgt_top1, ref_next, tgt_next, gap, divergent)


def reasons(s: PositionScores, i: int, t: Thresholds) -> list[str]:
    """Why row i diverges, in words."""
    out = []
    if not s.kl[i] <= t.kl_position:
        out.append(f"KL {s.kl[i]:.3g} > {t.kl_position:g}")
    d = float(s.logprob_diff[i])
    if not abs(d) <= t.logprob_diff:
        out.append(f"Δlog p(next) {d:+.3g} (|Δ| > {t.logprob_diff:g})")
    if s.target_top1[i] != s.ref_top1[i] and not s.ref_gap[i] < t.tie_margin:
        out.append(f"top-1 differs, reference gap {s.ref_gap[i]:.3g} ≥ {t.tie_margin:g} nats")
    return out


def first_divergent(s: PositionScores) -> int | None:
    """The row index of the first divergent position, or None."""
    hits = np.flatnonzero(s.divergent)
    return int(hits[0]) if hits.size else None


def greedy_match(s: PositionScores) -> int:
    """Steps of a greedy continuation (scored along the target's own path, `next_tokens` = its
    tokens) before the first token the reference would not have chosen."""
    miss = np.flatnonzero(s.ref_top1 != s.next_tokens)
    return int(miss[0]) if miss.size else int(s.next_tokens.size)


def summary(scores: Sequence[PositionScores], thresholds: Thresholds) -> dict[str, Any]:
    """Aggregates over every position of these sequences (None where there is no position)."""
    n = sum(s.kl.size for s in scores)
    if n == 0:
        return {
            "positions": 0,
            "mean_kl": None,
            "max_kl": None,
            "top1_agreement": None,
            "near_tie_flips": 0,
            "max_abs_logprob_diff": None,
            "mean_abs_logprob_diff": None,
            "divergent_positions": 0,
        }
    kl = np.concatenate([s.kl for s in scores])
    diff = np.abs(np.concatenate([s.logprob_diff for s in scores]))
    flips = np.concatenate([s.flips for s in scores])
    near = flips & (np.concatenate([s.ref_gap for s in scores]) < thresholds.tie_margin)
    return {
        "positions": int(n),
        "mean_kl": float(np.mean(kl)),
        "max_kl": float(np.max(kl)),
        "top1_agreement": float(np.mean(~flips)),
        "near_tie_flips": int(np.sum(near)),
        "max_abs_logprob_diff": float(np.max(diff)),
        "mean_abs_logprob_diff": float(np.mean(diff)),
        "divergent_positions": int(sum(int(np.sum(s.divergent)) for s in scores)),
    }


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float as a string ("inf", "nan"): JSON has no such numbers,
    and dropping them (None) would hide a failure."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class Divergence:
    """Where a target first leaves the reference."""

    prompt: int
    position: int
    phase: str  # "teacher-forced" (scored over the reference's sequence) or "greedy" (the target's own path)
    reference_token: int
    target_token: int  # the target's top-1 there (-1: it gave none)
    next_token: int  # the token the sequence has there
    kl: float
    logprob_diff: float
    why: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_divergence(phases: dict[str, Sequence[PositionScores | None]], thresholds: Thresholds) -> Divergence | None:
    """The first divergent position over every prompt (smallest prompt index, then position; at one
    position a teacher-forced finding comes before a greedy one)."""
    best: tuple[tuple[int, int, int], Divergence] | None = None
    for rank, (phase, per_prompt) in enumerate(phases.items()):
        for p, s in enumerate(per_prompt):
            if s is None:
                continue
            i = first_divergent(s)
            if i is None:
                continue
            key = (p, int(s.positions[i]), rank)
            if best is None or key < best[0]:
                d = Divergence(
                    p,
                    int(s.positions[i]),
                    phase,
                    int(s.ref_top1[i]),
                    int(s.target_top1[i]),
                    int(s.next_tokens[i]),
                    float(s.kl[i]),
                    float(s.logprob_diff[i]),
                    reasons(s, i, thresholds),
                )
                best = (key, d)
    return None if best is None else best[1]


def judge(
    teacher_forced: Sequence[PositionScores] | None, greedy: Sequence[PositionScores], thresholds: Thresholds
) -> dict[str, Any]:
    """The verdict of one target under one reference: no divergent position anywhere, and the mean
    KL (over the teacher-forced positions, else the greedy ones) within `kl_mean`."""
    tf = summary(teacher_forced, thresholds) if teacher_forced is not None else None
    gr = summary(greedy, thresholds)
    matches = [greedy_match(s) for s in greedy]
    steps = [int(s.next_tokens.size) for s in greedy]
    first = first_divergence({"teacher-forced": list(teacher_forced or []), "greedy": list(greedy)}, thresholds)
    failures = []
    if first is not None:
        failures.append(
            f"first divergence at prompt {first.prompt}, position {first.position} ({first.phase}): "
            + "; ".join(first.why)
        )
    main = tf if tf is not None else gr
    mean = main["mean_kl"]
    if main["positions"] and not mean <= thresholds.kl_mean:
        failures.append(f"mean KL {mean:.3g} > {thresholds.kl_mean:g}")
    return {
        "thresholds": thresholds.to_dict(),
        "teacher_forced": tf,
        "greedy": {
            **gr,
            "match_tokens": matches,
            "steps": steps,
            "match_fraction": (sum(matches) / sum(steps)) if sum(steps) else None,
        },
        "first_divergence": first.to_dict() if first is not None else None,
        "failures": failures,
        "passed": not failures,
    }


def per_position(phase: str, per_prompt: Sequence[PositionScores | None]) -> list[dict[str, Any]]:
    """The per-position series a report plots (KL and log-prob difference per position)."""
    out = []
    for p, s in enumerate(per_prompt):
        if s is None or s.positions.size == 0:
            continue
        out.append(
            {
                "prompt": p,
                "phase": phase,
                "positions": s.positions.tolist(),
                "kl": s.kl.tolist(),
                "logprob_diff": s.logprob_diff.tolist(),
                "divergent": s.positions[s.divergent].tolist(),
            }
        )
    return out
