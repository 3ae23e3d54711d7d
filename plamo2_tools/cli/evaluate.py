"""Evaluation commands: `eval` (lm-eval's gsm8k, offline), `gsm8k-task`, and the `lm-eval` pass-through."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserError
from .console import err, out, print_json
from .options import Backend, Device, ForwardOption, Json, Launch, NoVerify, TrustRemoteCode
from .validators import (
    check_eval_numbers,
    check_output_dir,
    check_runtime_options,
    forward_options,
    parse_batch_size,
    parse_limit,
)


def eval_shards(
    shards: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert` (any TP x PP).")],
    tasks: Annotated[
        str, typer.Option(help="The lm-eval task to run: gsm8k, the one task this command runs (offline, local data).")
    ] = "gsm8k",
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples (default: the task's, 5).")] = None,
    limit: Annotated[str | None, typer.Option(help="First N test documents (or a fraction < 1).")] = None,
    batch_size: Annotated[
        str, typer.Option(help='Sequences decoding at once: a number, or "auto" (as many as memory holds).')
    ] = "auto",
    gsm8k_dir: Annotated[Path | None, typer.Option(help="Holds train/test.jsonl (default: $PLAMO2_GSM8K_DIR).")] = None,
    output_path: Annotated[Path | None, typer.Option(help="Write results and samples under DIR/<shards>/.")] = None,
    launch: Launch = False,
    device: Device = "cpu",
    backend: Backend = "auto",
    max_gen_toks: Annotated[int, typer.Option(help="Most new tokens per answer when the task sets none.")] = 256,
    max_length: Annotated[int | None, typer.Option(help="Context limit (default: the config's).")] = None,
    trust_remote_code: TrustRemoteCode = False,
    allow_unverified_data: Annotated[bool, typer.Option(help="Accept non-official GSM8K files.")] = False,
    bootstrap_iters: Annotated[int, typer.Option(help="Bootstrap iterations for stderrs (0: none).")] = 100_000,
    log_samples: Annotated[bool, typer.Option(help="Write per-sample logs (needs --output-path).")] = True,
    option: ForwardOption = None,
    no_verify: NoVerify = False,
    as_json: Json = False,
) -> None:
    """Score a shard directory on GSM8K with lm-eval's own task, offline, from local data files.

    Uses the installed lm-eval gsm8k task (prompt, filters, metrics; version 3) with only the
    dataset pointed at the local files, whose sha256 must be the official one.  Results land where
    lm-eval puts them (DIR/<sanitized shards path>/results_<date>.json, samples_gsm8k_<date>.jsonl)
    plus a stable results.json.
    """
    from ..eval.gsm8k_task import load_gsm8k_data
    from ..eval.harness import EvalRequest, check_tasks, run_eval  # torch-free until run_eval runs
    from ..model import family_of
    from ..shards.integrity import verify_shard_files
    from ..shards.manifest import load_manifest

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    check_tasks(task_list)
    check_runtime_options(device, backend)
    batch = parse_batch_size(batch_size)
    check_eval_numbers(batch, max_gen_toks, max_length, num_fewshot, bootstrap_iters)
    parsed_limit = parse_limit(limit)
    if output_path is not None:
        check_output_dir(output_path, "--output-path")
    manifest = load_manifest(shards)  # refuses a directory being written or unfinished
    options = family_of(manifest.config).check_runtime_options(forward_options(option))
    positions = manifest.config.max_position_embeddings
    if max_length is not None and max_length > positions:
        raise UserError(f"--max-length {max_length}: the model has {positions} positions")
    # Side files, presence and headers now (cheap); each file's digest is taken while the runtime
    # copies it to the device (runtime/rank/weights.py), and a mismatch refuses the run there.
    verify_shard_files(manifest, range(manifest.mapping.world_size), digests=False)
    data = load_gsm8k_data(gsm8k_dir, allow_unverified=allow_unverified_data)
    request = EvalRequest(
        shards=str(shards),
        data=data.to_dict(),
        tasks=task_list,
        num_fewshot=num_fewshot,
        limit=parsed_limit,
        batch_size=batch,
        output_path=str(output_path) if output_path else None,
        device=device,
        backend=backend,
        max_gen_toks=max_gen_toks,
        max_length=max_length,
        trust_remote_code=trust_remote_code,
        bootstrap_iters=bootstrap_iters,
        log_samples=log_samples and output_path is not None,
        verify_files=not no_verify,
        forward_options=options,
    )
    outcome = run_eval(request, launch=launch)
    if outcome is None:  # a torchrun rank other than the first: rank 0 prints and writes
        return
    if not data.verified:  # with the results it qualifies (a refusal while loading stays one line)
        err.print("[yellow]warning:[/] not the official GSM8K files; scores do not compare with published numbers")
    if as_json:
        print_json(outcome.summary())
        return
    out.print(outcome.header, highlight=False, markup=False, soft_wrap=True)
    out.print(outcome.table, highlight=False, markup=False)
    for name, path in outcome.files.items():
        out.print(f"{name}: {path}", highlight=False, markup=False, soft_wrap=True)
    mode = "torchrun ranks" if launch else "in-process ranks"
    out.print(f"done in {outcome.wall_seconds:.1f} s ({mode})", highlight=False)


def gsm8k_task(
    out_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write gsm8k.yaml (created if missing).")],
    gsm8k_dir: Annotated[Path | None, typer.Option(help="Holds train/test.jsonl (default: $PLAMO2_GSM8K_DIR).")] = None,
    allow_unverified_data: Annotated[bool, typer.Option(help="Accept non-official GSM8K files.")] = False,
    as_json: Json = False,
) -> None:
    """Write DIR/gsm8k.yaml for lm-eval's own CLI: lm-eval's gsm8k task (v3) with the dataset pointed
    at local GSM8K files, the same task `plamo2-tools eval` runs.

    Then run it with lm-eval's own CLI:

    \b
    plamo2-tools lm-eval run --model plamo --model_args pretrained=SHARDS --tasks gsm8k --include_path DIR
    """
    from ..eval.gsm8k_task import load_gsm8k_data, write_task_yaml

    check_output_dir(out_dir, "DIR")
    data = load_gsm8k_data(gsm8k_dir, allow_unverified=allow_unverified_data)
    path = write_task_yaml(data, out_dir)
    if as_json:
        print_json({"path": str(path), "data": data.to_dict()})
    else:
        out.print(f"wrote {path}; use it with --tasks gsm8k --include_path {out_dir}", highlight=False, markup=False)


def lm_eval_passthrough(ctx: typer.Context) -> None:
    """lm-eval's own CLI with the plamo model (PLaMo 2 and 3) registered; every argument goes to lm-eval.

    For example:

    \b
    plamo2-tools lm-eval run --model plamo --model_args pretrained=SHARDS --tasks gsm8k \\
        --include_path DIR --output_path OUT --log_samples
    """
    from ..eval.lm_eval_cli import main as lm_eval_main

    raise typer.Exit(lm_eval_main(ctx.args))
