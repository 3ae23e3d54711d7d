"""The check that ends an export: the exported file run by its own runtime (a `deploy.target.Target`)
against the float64 reference forward of the source checkpoint, on a fixed set of prompts.

Per teacher-forced position: KL(reference ‖ target) over the full vocabulary, whether the two
argmaxes agree, and the difference of the log-probabilities each gives the next token; the first
divergent position (an argmax that differs, or a KL above the bound) with both tokens; and the
greedy continuation's match length.  A family with a runtime option that changes the reference
(PLaMo 3's window convention) is compared under each value, and the result says which one the
target follows.  The measured figures are the point: a quantized export states its KL, not a
promise; the bounds only decide the verdict (`passed`) and what counts as a divergence.

verify-core's `deploy/compare.py` does this comparison for `plamo2-tools verify TARGET`; this
module is the export's own, kept to what an export records.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..deploy.target import Target
from ..errors import CheckpointError
from ..model.checkpoint import HFCheckpoint
from ..shards.owned import ensure_readable_checkpoint

PROMPT_SEED = 20261207
PROMPT_COUNT = 4
PROMPT_LENGTHS = (12, 40)
MAX_NEW_TOKENS = 8
# Bounds by what the export holds.  float32: mlx-lm computes in float32 what the reference does in
# float64 (then rounds its logits to float32); on the tiny presets the per-position KL measured is
# below 1e-8 (mean ~1e-10), so 1e-6 leaves room for longer sums without hiding a wrong tensor,
# which moves KL by orders of magnitude more (RoPE base 1e6 read as 1e4 on tiny-gqa: mean 0.1).
# Half precision and quantized exports round every weight: their KL is measured and reported, and
# the verdict only flags a mean KL far above what a sound export of that precision gave on the
# synthetic presets (docs/export.md: tiny at 8 bits ~4e-4, --mixed 4 bits ~6e-3, plain 4 bits ~0.1;
# the planted bad recipe `out_proj` at 2 bits ~0.2; random weights make synthetic models far more
# sensitive than trained ones).
EXACT_KL_BOUND = 1e-6  # per position, float32 exports
LOSSY_MEAN_KL = {8: 0.01, 4: 0.15, 2: 1.0}  # by the export's --bits
HALF_MEAN_KL = 0.01  # unquantized bfloat16 / float16 exports


def bound_for(dtype: str, bits: int | None) -> dict[str, float]:
    """The verdict's rule for an export: {"per_position_kl": b} (exact: every position within b and
    the same argmax) or {"mean_kl": b} (lossy: the mean over every position below b)."""
    if bits is not None:
        return {"mean_kl": LOSSY_MEAN_KL[bits]}
    if dtype == "float32":
        return {"per_position_kl": EXACT_KL_BOUND}
    return {"mean_kl": HALF_MEAN_KL}


def fixed_prompts(vocab_size: int, bos: int | None, count: int = PROMPT_COUNT,
                  lengths: tuple[int, int] = PROMPT_LENGTHS, seed: int = PROMPT_SEED) -> list[list[int]]:  # fmt: skip
    """The export's prompt set: the same for every export of a vocabulary size (numpy's PCG64)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = [int(t) for t in rng.integers(0, vocab_size, n)]
        if bos is not None:
            ids[0] = bos
        out.append(ids)
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_positions(ref: np.ndarray, tgt: np.ndarray, nxt: np.ndarray, kl_bound: float) -> dict[str, Any]:
    """ref, tgt: (n, V) log-probabilities; nxt: the token each position predicts."""
    kl = (np.exp(ref) * (ref - tgt)).sum(axis=-1)
    ra, ta = ref.argmax(-1), tgt.argmax(-1)
    rows = np.arange(len(nxt))
    bad = np.flatnonzero((ra != ta) | (kl > kl_bound))
    first = None
    if len(bad):
        i = int(bad[0])
        first = {"position": i, "reference_token": int(ra[i]), "target_token": int(ta[i]), "kl": float(kl[i])}
    return {
        "kl": kl,
        "top1": ra == ta,
        "logprob_diff": tgt[rows, nxt] - ref[rows, nxt],
        "first_divergence": first,
    }


def reference_runs(reference: Path, prompts: list[list[int]], max_new_tokens: int) -> dict[str, dict[str, Any]]:
    """For every value of the family's runtime options: the reference's prompt log-probs and its
    greedy continuation (each step one more full float64 forward)."""
    import torch

    ensure_readable_checkpoint(reference)
    runs: dict[str, dict[str, Any]] = {}
    with HFCheckpoint(reference) as ckpt:
        ckpt.check_inventory()
        family = ckpt.family
        grid = {o.name: o.choices for o in family.runtime_options}
        for values in itertools.product(*grid.values()):
            options = dict(zip(grid, values, strict=True))

            def forward(seqs: Sequence[Sequence[int]], options: dict[str, Any] = options) -> list[np.ndarray]:
                logits = family.reference_logits(ckpt, seqs, torch.float64, "cpu", **options)
                return [log_softmax(lg.double().numpy()) for lg in logits]

            prompt_lp = forward(prompts)
            current = [list(p) for p in prompts]
            steps: list[list[np.ndarray]] = [[lp[-1]] for lp in prompt_lp]
            for k in range(max_new_tokens):
                for i, s in enumerate(steps):
                    current[i].append(int(s[-1].argmax()))
                if k < max_new_tokens - 1:
                    for i, lp in enumerate(forward(current)):
                        steps[i].append(lp[-1])
            key = ",".join(f"{k}={v}" for k, v in options.items()) or "default"
            runs[key] = {"options": options, "prompt": prompt_lp,
                         "tokens": [c[len(p):] for c, p in zip(current, prompts, strict=True)]}  # fmt: skip
    return runs


def judge_run(run: dict[str, Any], prompts: list[list[int]], scores: list[Any], greedy: list[Any],
              bound: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    kl_bound = bound.get("per_position_kl", bound.get("mean_kl", 0.0))
    per_prompt, kls, top1 = [], [], []
    for i, (p, s) in enumerate(zip(prompts, scores, strict=True)):
        ref = run["prompt"][i][s.start : len(p) - 1]
        cmp = compare_positions(ref, s.logprobs, np.asarray(p[s.start + 1 :]), kl_bound)
        kls.append(cmp["kl"])
        top1.append(cmp["top1"])
        ref_tokens, tgt_tokens = run["tokens"][i], greedy[i].tokens
        match = next((j for j, (a, b) in enumerate(zip(ref_tokens, tgt_tokens, strict=False)) if a != b),
                     min(len(ref_tokens), len(tgt_tokens)))  # fmt: skip
        per_prompt.append({
            "length": len(p),
            "max_kl": float(cmp["kl"].max()) if len(cmp["kl"]) else 0.0,
            "max_abs_logprob_diff": float(np.abs(cmp["logprob_diff"]).max()) if len(cmp["kl"]) else 0.0,
            "first_divergence": cmp["first_divergence"],
            "greedy_match": match,
            "greedy_reference": ref_tokens,
            "greedy_target": tgt_tokens,
        })  # fmt: skip
    kl_all, top1_all = np.concatenate(kls), np.concatenate(top1)
    mean_kl, agree = float(kl_all.mean()), float(top1_all.mean())
    firsts = [(i, x["first_divergence"]) for i, x in enumerate(per_prompt) if x["first_divergence"]]
    passed = mean_kl < bound["mean_kl"] if "mean_kl" in bound else not firsts
    return {
        "options": run["options"],
        "mean_kl": mean_kl,
        "max_kl": float(kl_all.max()),
        "top1_agreement": agree,
        "positions": int(len(kl_all)),
        "first_divergence": ({"prompt": firsts[0][0], **firsts[0][1]} if firsts else None),
        "greedy_match_fraction": sum(x["greedy_match"] for x in per_prompt)
        / max(1, sum(len(x["greedy_reference"]) for x in per_prompt)),
        "per_prompt": per_prompt,
        "bounds": bound,
        "passed": passed,
    }  # fmt: skip


def verify_target(target: Target, reference: Path, bound: dict[str, float], prompts: list[list[int]] | None = None,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:  # fmt: skip
    """The figures of one target against the reference under every option value; `passed` when
    one of them passes (the target follows that one; `follows` names it).  The verdict is on the
    teacher-forced positions; greedy continuations are measured and reported (a runtime may decode
    under another window convention than it scores with, as mlx-lm does for PLaMo 3).  A target
    that cannot run the model at all fails with its reason (`error`)."""
    with HFCheckpoint(reference) as ckpt:
        cfg = ckpt.config
    if prompts is None:
        prompts = fixed_prompts(cfg.vocab_size, cfg.bos_token_id)
    head = {"target": target.info(), "reference": str(reference),
            "prompts": {"count": len(prompts), "lengths": [len(p) for p in prompts], "seed": PROMPT_SEED},
            "max_new_tokens": max_new_tokens, "bounds": bound}  # fmt: skip
    try:
        scores = target.score(prompts)
        greedy = target.greedy(prompts, max_new_tokens)
    except CheckpointError as e:  # the runtime refuses the model: a finding, not a crash of ours
        return {**head, "follows": None, "passed": False, "error": str(e), "runs": {}, "summary": f"FAILED: {e}"}
    runs = reference_runs(reference, prompts, max_new_tokens)
    results = {key: judge_run(run, prompts, scores, greedy, bound) for key, run in runs.items()}
    follows = [k for k, r in results.items() if r["passed"]]
    best = follows[0] if follows else min(results, key=lambda k: results[k]["mean_kl"])
    return {
        **head,
        "follows": best if follows else None,
        "passed": bool(follows),
        "runs": results,
        "summary": summary_line(results[best], best, bool(follows)),
    }


def summary_line(r: dict[str, Any], key: str, passed: bool) -> str:
    where = "" if key == "default" else f" ({key})"
    first = r["first_divergence"]
    div = ("no divergence" if first is None else
           f"first divergence at prompt {first['prompt']} position {first['position']}: reference token "
           f"{first['reference_token']}, target {first['target_token']} (KL {first['kl']:.3g})")  # fmt: skip
    return (f"{'passed' if passed else 'DIVERGED'}{where}: mean KL {r['mean_kl']:.3g}, max KL {r['max_kl']:.3g}, "
            f"top-1 {r['top1_agreement']:.3f}, greedy match {r['greedy_match_fraction']:.3f}; {div}")  # fmt: skip
