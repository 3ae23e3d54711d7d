"""`plamo2-tools verify TARGET... --reference SRC`: every target judged against the reference
forward by the one comparison of `compare.py` (docs/deploy.md).

For each target: tokenizer parity (when it can tokenize), teacher-forced scores over every prompt
followed by the reference's own greedy continuation (when it can score), and its greedy
continuation of every prompt, compared along its own path.  Under each forward convention the user
did not pin (`reference.Reference.conventions`) the same target outputs are compared with that
convention's reference; the target *follows* the conventions it passes under, and fails only when
it passes under none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..kinds import VERIFY_TARGETS_KIND, VERIFY_TARGETS_SCHEMA_VERSION
from .compare import (
    KL_FULL,
    KL_TOPK,
    PRECISIONS,
    THRESHOLDS,
    Thresholds,
    jsonable,
    judge,
    per_position,
    score_positions,
)
from .prompts import PARITY_TEXT
from .reference import Options, Reference, convention_label
from .target import Continuation, Scores, Target

# The result of `verify TARGET...` (--json, --output), read by `plamo2-tools report` (its "verify"
# section).  Bump the version when a field changes meaning or goes away (adding one is compatible).
# A server says nothing about its precision: judged as bfloat16 (vLLM's and SGLang's default for
# PLaMo) unless --target-precision says otherwise.
ASSUMED_SERVER_PRECISION = "bfloat16"


def verify_work(targets: int, max_new_tokens: int, conventions: int) -> int:
    """Progress units: one per reference forward of the greedy continuation, then per target its
    scoring, its greedy run and one comparison per convention."""
    return max(1, max_new_tokens) + targets * (2 + conventions)


def thresholds_for(info: dict[str, Any], choice: str = "auto") -> tuple[Thresholds, str]:
    """The thresholds a target is judged by, and where its precision came from."""
    if choice != "auto":
        return THRESHOLDS[choice], "--target-precision"
    declared = info.get("precision")
    if isinstance(declared, str) and declared:
        return THRESHOLDS.get(declared, THRESHOLDS["quantized"]), f"the target ({declared})"
    return THRESHOLDS[ASSUMED_SERVER_PRECISION], f"assumed ({ASSUMED_SERVER_PRECISION}: the target does not say)"


class TokenText:
    """Token ids -> their text through the reference's tokenizer (None when it has none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None or token < 0:
            return None
        return str(self.tokenizer.decode([int(token)]))

    def all(self, vocab_size: int) -> list[str]:
        return [self(i) or "" for i in range(vocab_size)]


def tokenizer_parity(target: Target, tokenizer: Any, text: str = PARITY_TEXT) -> dict[str, Any]:
    """The target's tokenization of `text` against the reference tokenizer's (no special tokens)."""
    if tokenizer is None:
        return {"checked": False, "why": "the reference checkpoint has no tokenizer"}
    theirs = target.tokenize(text)
    if theirs is None:
        return {"checked": False, "why": "the target offers no tokenizer"}
    ours = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if theirs == ours:
        return {"checked": True, "equal": True, "tokens": len(ours)}
    j = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return {
        "checked": True,
        "equal": False,
        "tokens": len(ours),
        "target_tokens": len(theirs),
        "first_difference": j,
        "reference_ids": ours[j : j + 5],
        "target_ids": theirs[j : j + 5],
    }


class ReferenceCache:
    """The reference's log-probs along any sequence under any convention, computed once."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self.rows: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def put(self, options: Options, seq: Sequence[int], rows: np.ndarray) -> None:
        self.rows[(convention_label(options), tuple(seq))] = rows

    def along(self, seqs: Sequence[Sequence[int]], options: Options) -> list[np.ndarray]:
        label = convention_label(options)
        todo = [list(s) for s in seqs if (label, tuple(s)) not in self.rows]
        unique = list({tuple(s): s for s in todo}.values())
        if unique:
            for s, rows in zip(unique, self.reference.logprobs(unique, options), strict=True):
                self.rows[(label, tuple(s))] = rows
        return [self.rows[(label, tuple(s))] for s in seqs]


def compare_target(
    scores: Sequence[Scores] | None,
    continuations: Sequence[Continuation],
    sequences: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    ref_sequences: Sequence[np.ndarray],
    ref_paths: Sequence[np.ndarray],
    thresholds: Thresholds,
) -> dict[str, Any]:
    """One target under one convention: teacher-forced positions over `sequences` (reference rows
    `ref_sequences`), greedy steps along prompt + the target's tokens (`ref_paths`)."""
    tf = None
    if scores is not None:
        tf = []
        for seq, sc, ref in zip(sequences, scores, ref_sequences, strict=True):
            span = range(sc.start, len(seq) - 1)
            tf.append(
                score_positions(
                    ref[sc.start :],
                    seq[sc.start + 1 :],
                    thresholds,
                    positions=span,
                    top=sc.top,
                    target_lp=sc.logprobs,
                    target_token_lp=sc.token_logprobs,
                )
            )
    greedy = []
    for prompt, cont, ref in zip(prompts, continuations, ref_paths, strict=True):
        n = len(cont.tokens)
        span = range(len(prompt) - 1, len(prompt) - 1 + n)
        greedy.append(
            score_positions(
                ref[len(prompt) - 1 : len(prompt) - 1 + n],
                cont.tokens,
                thresholds,
                positions=span,
                target_lp=cont.logprobs,
                top=cont.top,
                target_token_lp=cont.token_logprobs,
            )
        )
    result = judge(tf, greedy, thresholds)
    result["positions"] = per_position("teacher-forced", tf or []) + per_position("greedy", greedy)
    return result


def reference_tokenizer(path: Any) -> Any:
    """The reference checkpoint's tokenizer, or None when it has none (then no token texts and no
    parity check; text prompts are refused by their own reader)."""
    from ..errors import Plamo2Error
    from ..runtime.batching.engine import load_tokenizer

    try:
        return load_tokenizer(path)
    except Plamo2Error:
        return None


def open_targets(
    kinds_and_specs: Sequence[tuple[str, str]], reference: Reference, tokenizer: Any, **options: Any
) -> list[Target]:
    """Open every target with what each adapter may want from the reference (`open_target` gives
    each the options its constructor names); those opened already are closed if one fails."""
    from .target import open_target

    cfg = reference.config
    text = TokenText(tokenizer)
    common = {
        "vocab_size": cfg.vocab_size,
        "token_texts": lambda: text.all(cfg.vocab_size),
        "reference": reference.path,
        "reference_config": cfg,
    }
    opened: list[Target] = []
    try:
        for kind, spec in kinds_and_specs:
            opened.append(open_target(kind, spec, **common, **options))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened


ProgressBar = Callable[[int], AbstractContextManager[Callable[[int], None] | None]]


def verify_prompts(
    ref: Reference,
    prompts: Sequence[Sequence[int]] | Path | None = None,
    gsm8k_like: bool = False,
    random: int = 4,
    seed: int = 0,
    tokenizer: Any = None,
) -> tuple[list[list[int]], str]:
    """The prompts (token ids) and how the result names where they came from: given ids ("api"), a
    prompts file (text lines or JSON lines with input_ids/text), the built-in GSM8K-like questions,
    or `random` random token prompts from `seed`.  Text goes through `tokenizer` (the reference's,
    already loaded) or, when that is None, through a load that says why there is none."""
    from ..verify import prompts_from_file, random_prompts

    if isinstance(prompts, Path):
        return prompts_from_file(prompts, ref.path, tokenizer), str(prompts)
    if prompts is not None:
        return [list(map(int, p)) for p in prompts], "api"
    if gsm8k_like:
        from ..runtime.batching.engine import load_tokenizer
        from .prompts import GSM8K_LIKE

        tok = tokenizer if tokenizer is not None else load_tokenizer(ref.path)
        return [list(tok(p)["input_ids"]) for p in GSM8K_LIKE], "gsm8k-like (built in)"
    cfg = ref.config
    return random_prompts(random, cfg.vocab_size, seed, cfg.bos_token_id), f"random(n={random}, seed={seed})"


def verify_deployments(
    targets: Sequence[str],
    reference: Path,
    prompts: Sequence[Sequence[int]] | Path | None = None,
    *,
    gsm8k_like: bool = False,
    random: int = 4,
    seed: int = 0,
    max_new_tokens: int = 32,
    precision: str = "float64",
    reference_device: str = "cpu",
    pinned: Options | None = None,
    target_precision: str = "auto",
    progress: ProgressBar | None = None,
    **target_options: Any,
) -> dict[str, Any]:
    """`plamo2-tools verify TARGET... --reference SRC` as a call (the command and the public face's
    `verify` both run this): each target's kind from its spec (`target.detect_kind`: shard
    directory, http(s) URL, .gguf, MLX or FP8 directory), refused in one line before any model work;
    the reference opened; the prompts checked against its vocabulary and positions; every target
    opened before the reference runs (a server that is down is one line now, not after the reference
    forward), judged by `verify_targets` and closed.  `target_options` go to the targets' adapters
    (device, backend, launch, prefill_chunk, forward_options, verify_files, api_key, timeout, model,
    top_k, on_note); `progress(total)` makes the bar `verify_targets` ticks."""
    from ..token_ids import check_tokens
    from .target import detect_kind

    if max_new_tokens < 1 or random < 1:
        raise UserError("--max-new-tokens and --random must be >= 1")
    if target_precision not in ("auto", *PRECISIONS):
        raise UserError(f"--target-precision {target_precision!r}: one of auto, {', '.join(PRECISIONS)}")
    if isinstance(prompts, Path) and gsm8k_like:
        raise UserError("--prompts and --gsm8k-like: give one")
    kinds = [detect_kind(str(t)) for t in targets]
    ref = Reference(Path(reference), precision, reference_device)
    tokenizer = reference_tokenizer(ref.path)  # once: text prompts, token names and parity all use it
    prompt_ids, source = verify_prompts(ref, prompts, gsm8k_like, random, seed, tokenizer)
    for i, ids in enumerate(prompt_ids):
        check_tokens(ids, ref.config, max_new_tokens, f"prompt {i + 1}")
    pinned = dict(pinned or {})
    options = {"forward_options": pinned, **target_options}
    # Opened before the reference runs: a server that is down or a damaged shard is one line now.
    opened = open_targets(list(zip(kinds, map(str, targets), strict=True)), ref, tokenizer, **options)
    try:
        work = verify_work(len(opened), max_new_tokens, len(ref.conventions(pinned)))
        with (progress or _no_bar)(work) as tick:
            return verify_targets(
                opened, ref, prompt_ids, source, max_new_tokens, pinned, target_precision, tokenizer, tick
            )
    finally:
        for t in opened:
            t.close()


def _no_bar(total: int) -> AbstractContextManager[None]:
    return nullcontext()


def verify_targets(
    targets: Sequence[Target],
    reference: Reference,
    prompts: Sequence[Sequence[int]],
    prompt_source: str,
    max_new_tokens: int,
    pinned: Options | None = None,
    target_precision: str = "auto",
    tokenizer: Any = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Judge every target (already open: a server that is down was refused before this long
    call); `tokenizer` (the reference's, or None) names tokens and checks parity."""
    tick = progress or (lambda n: None)
    conventions = reference.conventions(pinned)
    primary = conventions[0]
    ref_greedy = reference.greedy(prompts, max_new_tokens, primary, progress)
    sequences = [list(p) + t for p, t in zip(prompts, ref_greedy.tokens, strict=True)]
    cache = ReferenceCache(reference)
    for s, rows in zip(sequences, ref_greedy.logprobs, strict=True):
        cache.put(primary, s, rows)
    text = TokenText(tokenizer)
    results = []
    for target in targets:
        results.append(
            _one_target(
                target, cache, prompts, sequences, max_new_tokens, conventions, target_precision, tokenizer, text, tick
            )
        )
    return jsonable(
        {
            "kind": VERIFY_TARGETS_KIND,
            "schema_version": VERIFY_TARGETS_SCHEMA_VERSION,
            "reference": {
                "path": str(reference.path),
                "precision": reference.precision,
                "device": reference.device,
                "family": reference.family.name,
                "vocab_size": reference.config.vocab_size,
            },
            "prompts": {"count": len(prompts), "lengths": [len(p) for p in prompts], "source": prompt_source},
            "max_new_tokens": max_new_tokens,
            "conventions": [convention_label(c) for c in conventions],
            "pinned": dict(pinned or {}),
            "reference_greedy": ref_greedy.tokens,
            "targets": results,
            "passed": all(r["passed"] for r in results),
        }
    )


def _one_target(
    target: Target,
    cache: ReferenceCache,
    prompts: Sequence[Sequence[int]],
    sequences: list[list[int]],
    max_new_tokens: int,
    conventions: list[Options],
    target_precision: str,
    tokenizer: Any,
    text: TokenText,
    tick: Callable[[int], None],
) -> dict[str, Any]:
    parity = tokenizer_parity(target, tokenizer)
    can_score = target.can_score()
    scores = target.score(sequences, 0) if can_score else None
    tick(1)
    continuations = target.greedy(prompts, max_new_tokens)
    tick(1)
    info = target.info()  # after the calls: a server's echo support is known by now
    thresholds, source = thresholds_for(info, target_precision)
    paths = [list(p) + list(c.tokens) for p, c in zip(prompts, continuations, strict=True)]
    by_convention = {}
    for options in conventions:
        ref_seq = cache.along(sequences, options) if scores is not None else [np.zeros((0, 0))] * len(sequences)
        ref_paths = cache.along(paths, options)
        judged = compare_target(scores, continuations, sequences, prompts, ref_seq, ref_paths, thresholds)
        _name_tokens(judged.get("first_divergence"), text)
        by_convention[convention_label(options)] = judged
        tick(1)
    follows = [label for label, r in by_convention.items() if r["passed"]]
    failures = []
    if not follows:
        if len(by_convention) == 1:
            failures += next(iter(by_convention.values()))["failures"]
        else:
            failures += [f"under {label}: {r['failures'][0]}" for label, r in by_convention.items()]
            failures.insert(0, f"diverges under every convention ({', '.join(by_convention)})")
    if parity.get("checked") and not parity.get("equal"):
        failures.append(
            f"tokenizer differs from the reference's at token {parity['first_difference']} "
            f"(reference {parity['reference_ids']}, target {parity['target_ids']})"
        )
    label, chosen = next(iter(by_convention.items()))  # the primary convention's, when none passes
    first = chosen["first_divergence"]
    return {
        "kind": target.kind,
        "location": target.location,
        "info": info,
        "precision": thresholds.precision,
        "precision_source": source,
        "kl_kind": KL_FULL if target.full_logits else KL_TOPK,
        "top_k": 0 if target.full_logits else target.top_k,
        "mode": "teacher-forced + greedy" if can_score else "greedy only",
        "tokenizer": parity,
        "conventions": by_convention,
        "follows": follows,
        "indistinguishable": len(follows) > 1,
        "first_divergence": {**first, "convention": label} if first and not follows else None,
        "failures": failures,
        "passed": not failures,
    }


def _name_tokens(divergence: dict[str, Any] | None, text: TokenText) -> None:
    if divergence is None:
        return
    for key in ("reference_token", "target_token", "next_token"):
        divergence[key.replace("_token", "_text")] = text(divergence[key])


def failure_line(result: dict[str, Any]) -> str:
    """The one line `verify` ends with when a target fails: which target, where, and why."""
    bad = [t for t in result["targets"] if not t["passed"]]
    if not bad:
        return ""
    t = bad[0]
    first = t.get("first_divergence")
    where = ""
    if first:
        under = f" under {first['convention']}" if len(t["conventions"]) > 1 else ""
        every = " under every convention;" if len(t["conventions"]) > 1 else ""
        where = (
            f"{every} at prompt {first['prompt']}, position {first['position']} ({first['phase']}{under}): "
            f"reference token "
            f"{first['reference_token']} {first.get('reference_text')!r}, target {first['target_token']} "
            f"{first.get('target_text')!r}; {'; '.join(first['why'])}"
        )
    else:
        where = ": " + t["failures"][0]
    more = f" (and {len(bad) - 1} more target(s))" if len(bad) > 1 else ""
    return f"{t['location']} diverges from the reference{where}{more}"


__all__ = [
    "compare_target",
    "failure_line",
    "open_targets",
    "reference_tokenizer",
    "thresholds_for",
    "tokenizer_parity",
    "verify_targets",
    "verify_work",
]
