"""The check that ends an export: the output opened as a deploy target (`deploy/target.py`: `mlx`
run by mlx-lm, `fp8` the simulated W8A8 forward) and judged by `plamo2-tools verify`'s own machinery
(`deploy/verify.py:verify_targets`, one comparison in `deploy/compare.py`: thresholds by the
target's declared precision, first divergent position, greedy along the target's path, window
conventions), on the exports' fixed prompt set.  This module only picks the prompts, runs the
judge, and says in one line what it found: the side JSON's `verification` is `verify`'s result
(kind `plamo2-verify-targets`) plus that line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

# The exports' prompt set (docs/export.md, "Verified by construction"): PROMPT_COUNT prompts of
# PROMPT_LENGTHS token ids drawn with numpy's PCG64 from PROMPT_SEED, the first id the BOS; no
# tokenizer needed, the same on every machine for a vocabulary size.  MAX_NEW_TOKENS greedy steps.
PROMPT_SEED = 20261207
PROMPT_COUNT = 4
PROMPT_LENGTHS = (12, 40)
MAX_NEW_TOKENS = 8


def fixed_prompts(
    vocab_size: int,
    bos: int | None,
    count: int = PROMPT_COUNT,
    lengths: tuple[int, int] = PROMPT_LENGTHS,
    seed: int = PROMPT_SEED,
) -> list[list[int]]:
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


def prompt_source(count: int, lengths: tuple[int, int], seed: int) -> str:
    return f"export prompt set (count={count}, lengths={lengths[0]}-{lengths[1]}, seed={seed}, BOS first)"


def verify_export(
    kind: str,
    out: Path,
    reference: Path,
    *,
    count: int = PROMPT_COUNT,
    lengths: tuple[int, int] = PROMPT_LENGTHS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    precision: str = "float64",
    **target_options: Any,
) -> dict[str, Any]:
    """`verify OUT --reference REFERENCE` on the export's prompt set, in-process: the result of
    `deploy.verify.verify_targets` with `summary` (one line).  A target that cannot run the model at
    all (mlx-lm refusing a geometry) is a failed verification with its reason in `error`."""
    from ..deploy.reference import Reference
    from ..deploy.verify import open_targets, reference_tokenizer, verify_targets

    ref = Reference(reference, precision)
    cfg = ref.config
    prompts = fixed_prompts(cfg.vocab_size, cfg.bos_token_id, count, lengths)
    source = prompt_source(count, lengths, PROMPT_SEED)
    tokenizer = reference_tokenizer(reference)
    try:
        targets = open_targets([(kind, str(out))], ref, tokenizer, check_writer=False, **target_options)
        try:
            result = verify_targets(targets, ref, prompts, source, max_new_tokens, tokenizer=tokenizer)
        finally:
            for t in targets:
                t.close()
    except CheckpointError as e:  # the runtime refuses the model: a finding, not a crash of ours
        return {
            "reference": {"path": str(reference)},
            "prompts": {"count": count, "source": source},
            "targets": [],
            "passed": False,
            "error": str(e),
            "summary": f"FAILED: {e}",
        }
    result["summary"] = summary_line(result)
    return result


def summary_line(result: dict[str, Any]) -> str:
    """One line from a `verify_targets` result of one target: verdict, the convention it follows,
    the figures under it (or under the first convention when none passes), the first divergence."""
    from ..deploy.verify import failure_line

    t = result["targets"][0]
    label = t["follows"][0] if t["follows"] else next(iter(t["conventions"]))
    r = t["conventions"][label]
    main = r["teacher_forced"] or r["greedy"]
    where = "" if label == "default" else f" ({label})"
    figures = (
        f"mean KL {main['mean_kl']:.3g}, max KL {main['max_kl']:.3g}, top-1 {main['top1_agreement']:.3f}, "
        f"greedy match {r['greedy']['match_fraction']:.3f} ({t['precision']} thresholds)"
    )
    if t["passed"]:
        return f"passed{where}: {figures}"
    return f"DIVERGED{where}: {figures}; {failure_line(result)}"
