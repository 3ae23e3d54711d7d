"""`warmup`: fill the persistent kernel caches with what a run on SHARDS will need (issue 33)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserError
from .console import err, out, print_json, step_progress
from .options import Backend, Device, ForwardOption, Json, NoVerify
from .validators import check_output_dir, parse_max_batch, runtime_args

MODES = ("greedy", "sample", "top_p")


def warmup(
    shards: Annotated[Path, typer.Argument(help="A shard directory (the model the later runs will load).")],
    max_batch: Annotated[
        str, typer.Option(help='Decode slots of the runs to come, or "auto" (as memory allows, as eval and serve do).')
    ] = "auto",
    capacity: Annotated[int, typer.Option(help="Tokens per sequence of those runs (prompt + answer).")] = 4096,
    max_prompt_tokens: Annotated[
        int | None, typer.Option(help="Largest prefill forward to warm (default: the runtime's prefill budget).")
    ] = None,
    max_seconds: Annotated[
        float | None, typer.Option(help="Start no prefill shape after this many seconds (the likeliest come first).")
    ] = None,
    modes: Annotated[str, typer.Option(help="Sampling modes to warm, comma-separated: greedy, sample, top_p.")] = (
        "greedy"
    ),
    tuned_out: Annotated[
        Path | None,
        typer.Option(help="Also write this card's tuned-kernel table into DIR (CUDA; run with PLAMO2_TUNED=0)."),
    ] = None,
    device: Device = "cpu",
    backend: Backend = "auto",
    option: ForwardOption = None,
    no_verify: NoVerify = False,
    as_json: Json = False,
) -> None:
    """Compile and tune, now, what a run on SHARDS will need: Triton's kernels at every prefill and
    decode bucket, the autotuner's picks and the SSD variant choices, all kept in the persistent
    caches (~/.triton/cache, ~/.cache/plamo2-tools) that `eval`, `serve` and `generate` read by
    themselves.  Run it once per machine (and after upgrading torch, Triton or plamo2-tools)."""
    from ..shards.manifest import load_manifest

    batch = parse_max_batch(max_batch)
    if capacity < 2:
        raise UserError(f"--capacity {capacity}: must be >= 2")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise UserError(f"--max-prompt-tokens {max_prompt_tokens}: must be >= 1")
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or any(m not in MODES for m in chosen):
        raise UserError(f"--modes {modes!r}: a comma-separated list of {', '.join(MODES)}")
    if tuned_out is not None:
        if not device.startswith("cuda"):
            raise UserError("--tuned-out: a card's table is measured on that card (--device cuda)")
        check_output_dir(tuned_out, "--tuned-out")
    load_manifest(shards)  # a finished shard directory, or one line now
    run = runtime_args(shards, device, backend, option, no_verify)
    from ..runtime.batching.engine import Runtime
    from ..runtime.batching.warmup import plan_for, warm, write_tuned_table

    with Runtime(**run) as rt:
        plan = plan_for(rt, batch, capacity, max_prompt_tokens, chosen)
        steps = len(plan.prefill) + _decode_steps(plan.slots)
        with step_progress("warmup", steps, enabled=not as_json) as progress:
            result = warm(rt, plan, progress, max_seconds)
        if tuned_out is not None:
            command = shlex.join(["plamo2-tools", *sys.argv[1:]])
            result.tuned_table = str(write_tuned_table(tuned_out, rt.engines[0].device, command))
    if as_json:
        print_json(result.to_dict())
        return
    before, after = result.triton_kernels_before, result.triton_kernels_after
    compiled = f"{after - before} kernels compiled" if before is not None and after is not None else "no Triton cache"
    out.print(
        f"warmed {len(plan.prefill)} prefill shapes and {_decode_steps(plan.slots)} decode batch sizes "
        f"({plan.slots} slots of {plan.capacity} tokens) in {sum(result.seconds.values()):.1f} s; {compiled} "
        f"(Triton cache {result.triton_cache}, tuning cache {result.tune_cache})",
        highlight=False,
    )
    if result.tuned_table:
        err.print(f"wrote {result.tuned_table}", highlight=False, markup=False)


def _decode_steps(slots: int) -> int:
    from ..runtime.batching.graphs import buckets

    return len(buckets(slots))
