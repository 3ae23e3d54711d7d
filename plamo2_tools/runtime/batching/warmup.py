"""`plamo2-tools warmup SHARDS`: pay a fresh machine's one-time costs once, before the run that
matters (issue 33), and the shapes that leave a warm process nothing to compile (issue 32).

What a first run on a new machine spends and a second does not lives in caches that outlive the
process: Triton's compiled kernels (`$TRITON_CACHE_DIR`, default `~/.triton/cache`), Triton's
autotuning results (`cache_results`, same directory) and our SSD variant picks
(`$PLAMO2_CACHE_DIR/kernels`, kernels/tune_cache.py).  `warm` fills them by running the shapes a run
will meet: decode steps at every batch bucket of the slot pool (the decode kernels and the batch-1
GEMV), then the prefill forwards of `prefill_shapes`.  `eval`, `serve` and `generate` then find
everything in those caches by themselves: nothing to pass.  CUDA graphs are not kept between
processes; a run captures the buckets it meets as it meets them (graphs.py).

Which prefills: what Triton compiles for a launch is a function of its constexprs and of each
integer argument's class (1, a multiple of 16, other: `compile_watch.int_class`); our kernels derive
their constexprs from the layer's dimensions and from powers of two above the forward's token count
T and its sequence count S (block sizes, the SSD choice's bucket: `ssd.auto_key_of`).  So one
forward per (bucket of T, class of T) x (bucket of S, class of S) that can occur meets every
specialization a prefill of at most the budget's tokens in at most the pool's sequences can ask
for, whatever the lengths inside it (tests/serve/test_warm_shapes.py checks the claim on the CPU,
under Triton's interpreter, with `compile_watch` counting specializations).  A deadline
(`--max-seconds`) cuts the tail of `prefill_order`, likeliest first.

On a card with a shipped table (kernels/tuned.py) nothing is measured, only compiled; elsewhere the
measuring happens here.  `tuned_decisions` is what this process measured, the content of a card's
table (`warmup --tuned-out DIR` writes it: run it with PLAMO2_TUNED=0 on the card, so every
decision is measured rather than read back).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engine import Runtime
from .graphs import buckets


@dataclass(frozen=True)
class WarmupPlan:
    """What to run: prefill shapes (tokens, sequences) and the decode pool (slots, capacity)."""

    prefill: tuple[tuple[int, int], ...]
    slots: int
    capacity: int
    modes: tuple[str, ...] = ("greedy",)


@dataclass
class WarmupResult:
    plan: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    triton_cache: str | None = None
    triton_kernels_before: int | None = None
    triton_kernels_after: int | None = None
    tune_cache: str | None = None
    tuned_table: str | None = None
    left_out: list[list[int]] = field(default_factory=list)  # prefill shapes past max_seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _classes_in(low: int, high: int) -> list[int]:
    """One value of each Triton integer class in (low, high]: 1, a multiple of 16, another."""
    out = []
    if low < 1 <= high:
        out.append(1)
    sixteen = (low // 16 + 1) * 16
    if sixteen <= high:
        out.append(sixteen)
    other = next((v for v in range(high, low, -1) if v != 1 and v % 16), None)
    if other is not None:
        out.append(other)
    return out


def representatives(limit: int) -> list[int]:
    """Values in 1..limit that meet every (power-of-two bucket, integer class) pair there is."""
    out: list[int] = []
    low, high = 0, 1
    while low < limit:
        out += _classes_in(low, min(high, limit))
        low, high = high, high * 2
    return sorted(set(out))


def prefill_shapes(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(T, S): one prefill forward of T tokens in S sequences per specialization class (S <= T), and
    S prompts of one token each (T == S: a forward that the attention runs as a decode)."""
    seqs = representatives(min(max_seqs, max_tokens))
    shapes = {(t, s) for t in representatives(max_tokens) for s in representatives(min(t, max_seqs))}
    return sorted(shapes | {(s, s) for s in seqs})


def prompts_of(tokens: int, seqs: int, token_id: int) -> list[list[int]]:
    """`seqs` prompts of `tokens` tokens in all, as even as can be (the first ones one longer)."""
    base, extra = divmod(tokens, seqs)
    return [[token_id] * (base + (1 if i < extra else 0)) for i in range(seqs)]


def plan_for(
    rt: Runtime,
    max_batch: int | str,
    capacity: int,
    max_prompt_tokens: int | None,
    modes: tuple[str, ...] = ("greedy",),
) -> WarmupPlan:
    """The run's shapes: the slot pool of `max_batch` ("auto": as the device's memory holds) at
    `capacity` tokens, the prefill shapes up to the runtime's prefill budget (or `max_prompt_tokens`)."""
    limit = min(capacity, int(rt.config.max_position_embeddings))
    slots = rt.auto_batch_size(limit).slots if max_batch == "auto" else int(max_batch)
    budget = max_prompt_tokens or rt.engines[0].prefill_tokens or limit
    return WarmupPlan(tuple(prefill_shapes(min(budget, slots * limit), slots)), slots, limit, tuple(modes))


def prefill_order(prefill: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The order shapes are warmed in, likeliest first (a deadline cuts the tail): one sequence at
    every length (a `generate`), then the rest from the largest forwards down (a GSM8K run fills
    its pool with forwards of the whole prefill budget, refills with smaller ones)."""
    single = [b for b in prefill if b[1] == 1]
    return single + sorted((b for b in prefill if b[1] > 1), key=lambda b: (-b[0], -b[1]))


def warm(
    rt: Runtime, plan: WarmupPlan, progress: Callable[[int], None] | None = None, max_seconds: float | None = None
) -> WarmupResult:
    """Run the plan's shapes on `rt` (module doc): decode at every batch bucket, then the prefill
    shapes in `prefill_order`, none started after `max_seconds`; seconds per phase, what was
    left out, and what the caches hold."""
    cache = triton_cache_dir()
    result = WarmupResult(plan=asdict(plan), triton_cache=str(cache), triton_kernels_before=count_kernels(cache))
    vocab = int(rt.config.vocab_size)
    t0 = time.perf_counter()
    deadline = t0 + max_seconds if max_seconds is not None else float("inf")
    for n in reversed(buckets(plan.slots)):  # the pool first (it sizes it), then every smaller batch
        prompts = [[3 + (11 * i) % (vocab - 3), 5] for i in range(n)]
        for mode in plan.modes:  # the pool is kept (it fits every smaller batch): bucket n runs on it
            temperature, top_p = (0.0, 1.0) if mode == "greedy" else (0.7, 0.9 if mode == "top_p" else 1.0)
            rt.generate(prompts, 3, max_batch=n, temperature=temperature, top_p=top_p)
        if progress:
            progress(1)
    t1 = time.perf_counter()
    for tokens, seqs in prefill_order(plan.prefill):  # one forward each (a prefill, no decode step)
        if time.perf_counter() > deadline:
            result.left_out.append([tokens, seqs])
            continue
        rt.generate(prompts_of(tokens, seqs, 3), 1, max_batch=seqs)
        if progress:
            progress(1)
    t2 = time.perf_counter()
    result.seconds = {"decode": t1 - t0, "prefill": t2 - t1}
    result.triton_kernels_after = count_kernels(cache)
    from ...kernels.tune_cache import cache_dir

    tune = cache_dir()
    result.tune_cache = str(tune) if tune else None
    return result


def triton_cache_dir() -> Path:
    override = os.environ.get("TRITON_CACHE_DIR")
    return Path(override) if override else Path.home() / ".triton" / "cache"


def count_kernels(cache: Path) -> int | None:
    """Compiled kernels in Triton's cache (one directory each); None when it does not exist."""
    try:
        return sum(1 for p in cache.iterdir() if p.is_dir())
    except OSError:
        return None


def tuned_decisions() -> dict[str, dict[str, Any]]:
    """What this process decided by measuring, as a card table's kernels (kernels/tuned.py)."""
    from ...kernels import gemv, ssd, tuned

    return {
        "gemv": tuned.autotuner_entries(gemv.gemv_autotuner()),
        "ssd_chunk_output": tuned.autotuner_entries(ssd.output_autotuner(f32=False)),
        "ssd_chunk_output_f32": tuned.autotuner_entries(ssd.output_autotuner(f32=True)),
        "ssd_chunk_scan": ssd.measured_choices(),
    }


def write_tuned_table(directory: Path, device: Any, command: str) -> Path:
    """The card's table from this process's decisions (`warmup --tuned-out DIR`)."""
    import torch
    import triton

    from ...kernels import tuned
    from ...version import __version__

    card = tuned.current_card(device)
    made_with = {
        "plamo2_tools": __version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("PLAMO2_BENCH_COMMIT"),
        "command": command,
        "tuned_tables_read": os.environ.get("PLAMO2_TUNED", "1") != "0",
    }
    return tuned.write_table(directory / f"{card.slug}.json", card, tuned_decisions(), made_with)
