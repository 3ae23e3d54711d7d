"""An exported GGUF file run by llama.cpp against the reference forward: the figures an export
records (docs/export.md, "Verified by construction").

A fixed prompt set (seeded random token ids, BOS first, long enough to cross a tiny preset's
window) is run teacher-forced by the GGUF target (`deploy/gguf.py`) and by the family's float64
reference; at every position we take the full-vocabulary KL(reference ‖ llama.cpp) and both
top-1 tokens.  A family whose reference has runtime options (PLaMo 3's window convention) is
compared under each value, and the figures say which one llama.cpp follows.  The verdict compares
the worst position's KL with the limit for the file's type.

This is the export's own small comparison; `plamo2-tools verify FILE.gguf` (deploy/compare.py)
is the general one with the same target.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

# KL(reference ‖ llama.cpp) allowed at the worst position, by the file's type: about 10x the worst
# measured on the tiny PLaMo 3 presets with llama-cpp-python 0.3.36 on CPU (f32 6e-7, f16 3e-6, bf16
# 2e-4, q8_0 1.3e-3, q4_0 0.21; docs/export.md, "Measured"), far below what a wrong fact costs (a RoPE
# base, a window: 1e-3 to 1e-1 from the first affected position).  Synthetic weights quantize badly:
# q4_0 on a real model is far better than this limit.
KL_LIMITS = {"f32": 1e-5, "f16": 5e-5, "bf16": 3e-3, "q8_0": 1.5e-2, "q4_0": 0.5}
DEFAULT_KL_LIMIT = 0.5  # the llama-quantize types (k-quants, i-quants)
GGUF_VERIFY_KIND = "plamo2-gguf-verify"


def prompts(count: int, length: int, vocab: int, bos: int | None, seed: int) -> list[list[int]]:
    """Seeded random token ids (BOS first when the model has one)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, size=length).tolist()
        if bos is not None:
            ids[0] = bos
        out.append([int(t) for t in ids])
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def figures(reference: list[np.ndarray], target: list[np.ndarray], limit: float) -> dict[str, Any]:
    """KL, top-1 agreement and the first divergent position of `target` against `reference`
    (lists of (T, V) logits, one per prompt)."""
    kls, agree, first, first_top1 = [], 0, None, None
    for p, (ref, got) in enumerate(zip(reference, target, strict=True)):
        lr, lt = _log_softmax(ref), _log_softmax(got)
        kl = (np.exp(lr) * (lr - lt)).sum(axis=-1)
        top_r, top_t = lr.argmax(axis=-1), lt.argmax(axis=-1)
        agree += int((top_r == top_t).sum())
        kls.append(kl)
        for i in range(len(kl)):
            at = {"prompt": p, "position": i, "kl": float(kl[i]), "reference_token": int(top_r[i]),
                  "target_token": int(top_t[i])}  # fmt: skip
            if first is None and kl[i] > limit:
                first = at
            if first_top1 is None and top_r[i] != top_t[i]:
                first_top1 = at
    every = np.concatenate(kls)
    return {
        "positions": int(every.size),
        "mean_kl": float(every.mean()),
        "max_kl": float(every.max()),
        "p99_kl": float(np.quantile(every, 0.99)),
        "top1_agreement": agree / every.size,
        "first_divergence": first,
        "first_top1_difference": first_top1,
        "kl_limit": limit,
        "passes": first is None,
    }


def verify_gguf(path: Path, src: Path, type_name: str, count: int = 4, length: int = 48, seed: int = 0,
                device: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """Run `path` with llama.cpp and the reference on the same prompts; the figures (module doc)."""
    import torch

    from ..deploy.gguf import GGUFTarget
    from ..model.checkpoint import HFCheckpoint

    limit = KL_LIMITS.get(type_name, DEFAULT_KL_LIMIT)
    with HFCheckpoint(src) as ckpt:
        cfg, family = ckpt.config, ckpt.family
        seqs = prompts(count, length, cfg.vocab_size, cfg.bos_token_id, seed)
        target = GGUFTarget(str(path), reference=src, n_ctx=max(64, length))
        try:
            got = [target.logits(s)[:, : cfg.vocab_size] for s in seqs]
            info = target.info()
        finally:
            target.close()
        choices = family.runtime_options()
        runs: dict[str, dict[str, Any]] = {}
        for values in itertools.product(*choices.values()):
            options = dict(zip(choices, values, strict=True))
            ref = family.reference_logits(ckpt, seqs, torch.float64, device, **options)
            name = ",".join(f"{k}={v}" for k, v in options.items()) or "default"
            runs[name] = figures([r.numpy() for r in ref], got, limit)
    passing = [name for name, f in runs.items() if f["passes"]]
    expected = ",".join(f"{k}={v}" for k, v in family.gguf.reference_options.items()) or "default"  # type: ignore[union-attr]
    follows = expected if expected in passing else (passing[0] if passing else None)
    best = runs[follows] if follows else min(runs.values(), key=lambda f: f["max_kl"])
    return {
        "kind": GGUF_VERIFY_KIND,
        "prompts": count,
        "tokens": length,
        "seed": seed,
        "type": type_name,
        "runtime": info,
        "comparisons": runs,
        "follows": follows,
        "verdict": "pass" if follows else "diverges",
        "mean_kl": best["mean_kl"],
        "max_kl": best["max_kl"],
        "top1_agreement": best["top1_agreement"],
        "first_divergence": best["first_divergence"],
    }


def describe(result: dict[str, Any]) -> str:
    """One line for the export's report."""
    if result["verdict"] == "pass":
        return (f"llama.cpp matches the reference ({result['follows']}): mean KL {result['mean_kl']:.2e}, "
                f"max {result['max_kl']:.2e}, top-1 {result['top1_agreement']:.3f}")  # fmt: skip
    d = result["first_divergence"]
    limit = next(iter(result["comparisons"].values()))["kl_limit"]
    why = [f["effect"] for f in result["runtime"]["lint"] if f.get("diverges")]
    return (f"llama.cpp diverges from the reference at prompt {d['prompt']} position {d['position']} "
            f"(KL {d['kl']:.2e} > {limit:g}; top-1 {d['reference_token']} vs {d['target_token']}); mean KL "
            f"{result['mean_kl']:.2e}" + (f"; known causes: {' | '.join(why)}" if why else ""))  # fmt: skip
