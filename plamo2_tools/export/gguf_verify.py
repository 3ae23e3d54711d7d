"""An exported GGUF file run by llama.cpp against the reference forward: the figures an export
records (docs/export.md, "Verified by construction").

The judgement is `plamo2-tools verify`'s own (`deploy/verify.py:verify_targets` over
`deploy/compare.py`): the same GGUF target, the same thresholds by precision (the file type the
GGUF declares: f32 as float32, f16, bf16, anything quantized as "quantized"), the same per-position
rule and the same first divergence.  Only the prompts are the export's: seeded random token ids,
BOS first, long enough to cross a tiny preset's window, then the reference's greedy continuation.
A family whose reference has runtime options (PLaMo 3's window convention) is compared under each
value, and the record says which one llama.cpp follows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GGUF_VERIFY_KIND = "plamo2-gguf-verify"
MAX_NEW_TOKENS = 8  # greedy steps compared along llama.cpp's own path


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


def _convention(judged: dict[str, Any]) -> dict[str, Any]:
    """What the export records of one convention's judgement (the per-position series stay out)."""
    tf = judged["teacher_forced"] or {}
    return {
        "passed": judged["passed"],
        "mean_kl": tf.get("mean_kl"),
        "max_kl": tf.get("max_kl"),
        "top1_agreement": tf.get("top1_agreement"),
        "max_abs_logprob_diff": tf.get("max_abs_logprob_diff"),
        "divergent_positions": tf.get("divergent_positions"),
        "greedy_match_fraction": judged["greedy"]["match_fraction"],
        "first_divergence": judged["first_divergence"],
        "failures": judged["failures"],
    }


def verify_gguf(
    path: Path,
    src: Path,
    type_name: str,
    count: int = 4,
    length: int = 48,
    seed: int = 0,
    device: str = "cpu",
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict[str, Any]:
    """Run `path` with llama.cpp and judge it against the reference as `verify` does (module doc)."""
    from ..deploy.gguf import GGUFTarget
    from ..deploy.reference import Reference
    from ..deploy.verify import verify_targets

    reference = Reference(src, "float64", device)
    cfg = reference.config
    seqs = prompts(count, length, cfg.vocab_size, cfg.bos_token_id, seed)
    target = GGUFTarget(str(path), reference=src, n_ctx=max(64, length + max_new_tokens), vocab_size=cfg.vocab_size)
    try:
        result = verify_targets(
            [target], reference, seqs, f"{count} seeded random prompts (seed {seed})", max_new_tokens
        )
    finally:
        target.close()
    t = result["targets"][0]
    conventions = {label: _convention(judged) for label, judged in t["conventions"].items()}
    assert reference.family.gguf is not None
    expected = ", ".join(f"{k}={v}" for k, v in sorted(reference.family.gguf.reference_options.items())) or "default"
    follows = expected if expected in t["follows"] else (t["follows"][0] if t["follows"] else None)
    shown = conventions[follows] if follows else next(iter(conventions.values()))
    return {
        "kind": GGUF_VERIFY_KIND,
        "judged_by": "deploy/compare.py (plamo2-tools verify)",
        "prompts": count,
        "tokens": length,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "type": type_name,
        "precision": t["precision"],
        "precision_source": t["precision_source"],
        "thresholds": t["conventions"][next(iter(t["conventions"]))]["thresholds"],
        "runtime": t["info"],
        "conventions": conventions,
        "follows": follows,
        "expected_convention": expected,
        "verdict": "pass" if t["passed"] else "diverges",
        "failures": t["failures"],
        "mean_kl": shown["mean_kl"],
        "max_kl": shown["max_kl"],
        "top1_agreement": shown["top1_agreement"],
        "greedy_match_fraction": shown["greedy_match_fraction"],
        "first_divergence": t["first_divergence"] or shown["first_divergence"],
    }


def describe(result: dict[str, Any]) -> str:
    """One line for the export's report."""
    judged = f"judged as {result['precision']}"
    if result["verdict"] == "pass":
        return (
            f"llama.cpp matches the reference ({result['follows']}; {judged}): mean KL {result['mean_kl']:.2e}, "
            f"max {result['max_kl']:.2e}, top-1 {result['top1_agreement']:.3f}"
        )
    d = result["first_divergence"]
    why = [f["effect"] for f in result["runtime"]["lint"] if f.get("diverges")]
    where = (
        f" at prompt {d['prompt']} position {d['position']} ({d['phase']}; {'; '.join(d['why'])}; top-1 "
        f"{d['reference_token']} vs {d['target_token']})"
        if d
        else f": {result['failures'][0]}"
    )
    return f"llama.cpp diverges from the reference{where}; mean KL {result['mean_kl']:.2e} ({judged})" + (
        f"; known causes: {' | '.join(why)}" if why else ""
    )
