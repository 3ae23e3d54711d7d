"""Commands that run the model: `logits`, `verify`, `generate`, `demo`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .. import timeline
from ..errors import CheckFailed, UserError
from ..serve import API_KEY_ENV  # the package's __init__ imports nothing heavy
from ..token_ids import check_tokens
from .console import RequestProgress, err, out, print_json, step_progress
from .options import Backend, CudaGraph, Device, ForwardOption, Json, Launch, NoVerify, TrustRemoteCode
from .validators import (
    check_output_file,
    check_runtime_options,
    check_sampling,
    forward_options,
    int_list,
    is_shard_dir,
    parse_max_batch,
    runtime_args,
)


def logits(
    path: Annotated[Path, typer.Argument(help="An HF checkpoint (reference forward) or a shard directory.")],
    input_ids: Annotated[str, typer.Option(help="Comma-separated token ids, e.g. 1,2,3.")],
    out_file: Annotated[Path, typer.Option("--out", help="Where to write float32 logits (tokens, vocab) as .npy.")],
    precision: Annotated[str, typer.Option(help="Reference forward precision: float64 or float32.")] = "float64",
    backend: Backend = "auto",
    device: Device = "cpu",
    option: ForwardOption = None,
    no_verify: NoVerify = False,
) -> None:
    """Logits of one token sequence, written as a float32 .npy array of shape (tokens, vocab):
    the runtime's for a shard directory, the reference forward's for an HF checkpoint."""
    import numpy as np

    ids = int_list(input_ids, "--input-ids")
    if not ids:
        raise UserError("--input-ids needs at least one token id")
    check_output_file(out_file, "--out")
    options = forward_options(option)
    if is_shard_dir(path):
        from ..shards.manifest import load_manifest

        check_tokens(ids, load_manifest(path).config, 0, "--input-ids")
        check_runtime_options(device, backend)
        from ..runtime.batching.engine import load_engine

        with load_engine(
            path, device=device, backend=backend, verify_files=not no_verify, forward_options=options
        ) as engine:
            result = engine.prompt_logits([ids])[0]
            if not engine.is_main:  # under torchrun only rank 0 writes
                return
    else:
        from ..shards.owned import ensure_readable_checkpoint

        if precision not in ("float64", "float32"):
            raise UserError("--precision must be float64 or float32")
        ensure_readable_checkpoint(path)
        from ..model.checkpoint import HFCheckpoint

        with HFCheckpoint(path) as ckpt:
            ckpt.check_inventory()
            check_tokens(ids, ckpt.config, 0, "--input-ids")
            chosen = ckpt.family.check_runtime_options(options)
            import torch

            dtype = torch.float64 if precision == "float64" else torch.float32
            result = ckpt.family.reference_logits(ckpt, [ids], dtype, **chosen)[0]
    with open(out_file, "wb") as f:  # a file object: np.save would append .npy to a bare name
        np.save(f, result.numpy())
    err.print(f"wrote logits {tuple(result.shape)} to {out_file}", highlight=False, markup=False)


def print_verify(result: dict[str, Any], title: str) -> None:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    table = Table(title=title)
    for col in ("layout", "dtype", "max|Δ|", "rel err", "KL", "top-1", "greedy", "lp-close", "result"):
        table.add_column(col, no_wrap=True)
    for x in result["layouts"]:
        m = x["metrics"]
        table.add_row(
            f"tp{x['tp']}×pp{x['pp']}" + ("/torchrun" if x["launch"] else ""),
            short.get(x["dtype"], x["dtype"]),
            f"{m['max_abs_logit_diff']:.1e}",
            f"{m['max_rel_err']:.1e}",
            f"{m['mean_kl']:.1e}",
            f"{m['top1_agreement']:.3f}",
            f"{m['greedy_match_fraction']:.3f}",
            "yes" if m["logprobs_close"] else "no",
            "[green]pass[/]" if x["passed"] else "[red]FAIL[/]",
        )
    out.print(table)
    if result.get("forward_options"):
        out.print(
            "forward options: " + ", ".join(f"{k}={v}" for k, v in result["forward_options"].items()), highlight=False
        )
    for x in result["layouts"]:
        for f in x["failures"]:
            out.print(f"  [red]tp={x['tp']} pp={x['pp']}[/]: {f}", highlight=False)


def demo(
    workdir: Annotated[Path, typer.Option(help="Where the checkpoint and shards go.")] = Path("runs/demo"),
    preset: Annotated[str, typer.Option(help="Synthetic model preset (tiny, tiny-gqa, plamo-2-1b, ...).")] = "tiny",
    layouts: Annotated[str, typer.Option(help="TPxPP layouts, comma-separated.")] = "1x1,2x1,2x2",
    launch: Launch = False,
    as_json: Json = False,
) -> None:
    """The main job on an embedded default: synthesise a checkpoint, convert it to several TP x PP
    layouts, check the shards, and verify each layout against the reference forward."""
    from ..demo import run_demo

    try:
        pairs = tuple((int(a), int(b)) for a, b in (x.lower().split("x") for x in layouts.split(",")))
    except ValueError:
        raise UserError(f"--layouts must look like 1x1,2x2 (got {layouts!r})") from None
    result = run_demo(workdir, preset, pairs, launch, log=(lambda m: None) if as_json else err.print)
    if as_json:
        print_json(result)
    else:
        print_verify(result, f"demo: {preset} shards vs the reference forward")
        verdict = "[green]all layouts match the reference[/]" if result["passed"] else "[red]verification failed[/]"
        out.print(f"{verdict}  (shards in {workdir})")
    if not result["passed"]:
        raise CheckFailed("demo: a layout failed verification")


def verify(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="What to check: shard directories (layouts), http(s):// base URLs of OpenAI-compatible "
            "servers, .gguf files, MLX model directories.",
            metavar="TARGET...",
        ),
    ],
    reference: Annotated[Path, typer.Option(help="The original HF checkpoint (the reference forward runs on it).")],
    prompts: Annotated[
        Path | None, typer.Option(help="Prompts: text (one per line) or JSON lines with input_ids/text.")
    ] = None,
    random: Annotated[int, typer.Option(help="Without --prompts: this many random token prompts (8-64 tokens).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    gsm8k_like: Annotated[
        bool, typer.Option("--gsm8k-like", help="The built-in GSM8K-like questions (text) instead of random tokens.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens compared after each prompt.")] = 32,
    launch: Launch = False,
    device: Device = "cpu",
    backend: Backend = "auto",
    precision: Annotated[str, typer.Option(help="Reference forward precision: float64 or float32.")] = "float64",
    reference_device: Annotated[str, typer.Option(help="Where the reference forward runs: cpu or cuda.")] = "cpu",
    prefill_chunk: Annotated[
        int | None, typer.Option(help="Prefill at most this many tokens per sequence per step.")
    ] = None,
    option: ForwardOption = None,
    target_precision: Annotated[
        str,
        typer.Option(
            help="Judge targets as float32, float16, bfloat16 or quantized (auto: what each target "
            "declares; a server, which declares nothing, as bfloat16)."
        ),
    ] = "auto",
    api_key: Annotated[
        str | None, typer.Option(help="Servers: the bearer key.", envvar=API_KEY_ENV, show_envvar=True)
    ] = None,
    timeout: Annotated[float, typer.Option(help="Servers: seconds to wait for each answer.")] = 120.0,
    top_k: Annotated[int, typer.Option(help="Servers: alternatives asked per position (logprobs).")] = 20,
    server_model: Annotated[
        str | None, typer.Option(help="Servers: the model to name in requests (default: the first one listed).")
    ] = None,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON result to this file.")] = None,
    no_verify: NoVerify = False,
    as_json: Json = False,
) -> None:
    """Check deployments against the reference forward of the original checkpoint: per position KL,
    top-1, log-prob of each token and the first divergent position, teacher-forced and along each
    target's own greedy continuation (docs/deploy.md).  PLaMo 3 targets are compared under each window
    convention unless --option window_convention=... pins one.  Exit 1 when a target diverges, naming where."""
    from ..deploy.verify import failure_line, verify_deployments
    from ..kernels.devices import check_device

    check_runtime_options(device, backend)
    check_device(reference_device, "--reference-device")
    if api_key is not None and not api_key.strip():
        raise UserError(f"--api-key (or {API_KEY_ENV}) is empty")
    if output is not None:
        check_output_file(output, "--output")
    result = verify_deployments(
        targets,
        reference,
        prompts,
        gsm8k_like=gsm8k_like,
        random=random,
        seed=seed,
        max_new_tokens=max_new_tokens,
        precision=precision,
        reference_device=reference_device,
        pinned=forward_options(option),
        target_precision=target_precision,
        progress=lambda work: step_progress("verify", work, enabled=not as_json),
        device=device,
        backend=backend,
        launch=launch,
        prefill_chunk=prefill_chunk,
        verify_files=not no_verify,
        api_key=api_key,
        timeout=timeout,
        model=server_model,
        top_k=top_k,
        on_note=None if as_json else _note,
    )
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print_json(result)
    else:
        n = result["prompts"]["count"]
        print_targets(result, f"verify vs {reference} ({precision}, {n} prompts, {max_new_tokens} steps)")
    if not result["passed"]:
        raise CheckFailed(failure_line(result))


def _note(line: str) -> None:
    err.print(f"note: {line}", highlight=False, markup=False)


def print_targets(result: dict[str, Any], title: str) -> None:
    """One row per target and convention: what was compared, the numbers, the verdict."""
    table = Table(title=title)
    for col in (
        "target",
        "kind",
        "precision",
        "KL",
        "convention",
        "mean KL",
        "max KL",
        "top-1",
        "greedy",
        "first divergence",
        "result",
    ):
        table.add_column(col, no_wrap=True)
    for t in result["targets"]:
        for label, r in t["conventions"].items():
            main = r["teacher_forced"] or r["greedy"]
            first = r["first_divergence"]
            g = r["greedy"]
            table.add_row(
                t["location"],
                t["kind"],
                t["precision"],
                t["kl_kind"] + (f"@{t['top_k']}" if t["top_k"] else ""),
                label,
                _sci(main["mean_kl"]),
                _sci(main["max_kl"]),
                _frac(main["top1_agreement"]),
                f"{sum(g['match_tokens'])}/{sum(g['steps'])}",
                f"prompt {first['prompt']} pos {first['position']}" if first else "-",
                "[green]pass[/]" if r["passed"] else "not followed" if t["passed"] else "[red]FAIL[/]",
            )
    out.print(table)
    for t in result["targets"]:
        name = t["location"]
        if len(t["conventions"]) > 1:
            follows = ", ".join(t["follows"]) or "none"
            extra = " (the prompts do not tell them apart)" if t["indistinguishable"] else ""
            out.print(f"  {name}: follows {follows}{extra}", highlight=False)
        if t["mode"] != "teacher-forced + greedy":
            out.print(
                f"  {name}: {t['mode']} ({t['info'].get('prompt_logprobs_detail') or 'no prompt logprobs'})",
                highlight=False,
            )
        parity = t["tokenizer"]
        if parity.get("checked") is False:
            out.print(f"  {name}: tokenizer not checked ({parity['why']})", highlight=False)
        for d in t["info"].get("known_differences") or []:  # what the target's runtime is known to do differently
            out.print(f"  {name}: known difference: {d.get('text', d)}", highlight=False)
        for f in t["failures"]:
            out.print(f"  [red]{name}[/]: {f}", highlight=False)


def _sci(value: Any) -> str:
    return f"{value:.1e}" if isinstance(value, (int, float)) else str(value)


def _frac(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else str(value)


def generate(
    shards: Annotated[Path, typer.Argument(help="A shard directory.")],
    prompt: Annotated[str | None, typer.Option(help="The text to continue.")] = None,
    input_file: Annotated[
        Path | None,
        typer.Option("--input", help="Requests, one a line: a prompt, or a JSON object with /v1/completions' fields."),
    ] = None,
    output: Annotated[
        Path | None, typer.Option(help="With --input: results (JSON lines), written as they finish; resumed if there.")
    ] = None,
    strict: Annotated[bool, typer.Option(help="With --input: refuse the whole file if any line is malformed.")] = False,
    max_batch: Annotated[
        str, typer.Option(help='With --input: sequences decoding at once, or "auto" (as memory allows).')
    ] = "auto",
    max_new_tokens: Annotated[
        int, typer.Option(help="Stop after this many new tokens (--input: lines' default).")
    ] = 64,
    max_context: Annotated[
        int | None,
        typer.Option(help="With --input: tokens per line, prompt + completion (default 4096, at most the model's)."),
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy (--input: lines' default).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with temperature > 0).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (the same on every rank; --input: lines' base seed).")] = 0,
    device: Device = "cpu",
    backend: Backend = "auto",
    trust_remote_code: TrustRemoteCode = False,
    option: ForwardOption = None,
    no_verify: NoVerify = False,
    cuda_graph: CudaGraph = True,
    as_json: Json = False,
) -> None:
    """Continue a prompt with the runtime, streaming text as it is generated; or, with --input and
    --output, run a file of requests through continuous batching (docs/serve.md, "Batch files").

    Runs all ranks in this process; under `torchrun --nproc-per-node N` each process is one real rank
    and rank 0 prints.  Stops at the checkpoint's EOS token(s) or after --max-new-tokens.
    """
    if (prompt is None) == (input_file is None):
        raise UserError("give either --prompt TEXT or --input FILE (with --output FILE)")
    check_sampling(temperature, top_p, max_new_tokens)
    sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    run = runtime_args(shards, device, backend, option, no_verify, trust_remote_code, cuda_graph)
    if input_file is not None:
        generate_file(input_file, output, strict, max_batch, max_context, sampling, run, as_json)
        return
    if output is not None or strict or max_context is not None:
        raise UserError("--output, --strict and --max-context go with --input")
    generate_prompt(prompt, sampling, run, as_json)


def generate_prompt(prompt: str, sampling: dict[str, Any], run: dict[str, Any], as_json: bool) -> None:
    """`generate --prompt`: one continuation, streamed to stdout as it is generated."""
    from ..shards.manifest import load_manifest

    # Cheapest first, torch last (issue 33): the directory, then the tokenizer (transformers), then
    # the runtime (torch); options and the device were checked before (runtime_args).
    shards, max_new_tokens = Path(run["shards"]), sampling["max_tokens"]
    cfg = load_manifest(shards).config
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(shards, trust_remote_code=run["trust_remote_code"])
    ids = list(tok(prompt)["input_ids"])
    if not ids:
        raise UserError("--prompt: the prompt has no tokens")
    check_tokens(ids, cfg, max_new_tokens, "--prompt")
    from ..runtime.batching.engine import Runtime
    from ..runtime.batching.text import TextStream, decode_kept_specials, stop_token_ids

    # Streamed text is its own progress on a terminal; a bar when nothing streams there (rank 0's only).
    show = (as_json or not sys.stdout.isatty()) and os.environ.get("RANK", "0") == "0"
    bar = step_progress("generate", max_new_tokens, enabled=show)
    decode = decode_kept_specials(tok)
    with Runtime(**run) as rt, bar as progress:
        stream = TextStream(decode)

        def on_token(i: int, token: int) -> None:
            progress(1)
            text = stream.push(token)
            if rt.is_main and not as_json and text:
                sys.stdout.write(text)
                sys.stdout.flush()

        timeline.mark("tokens_start")
        start = time.perf_counter()
        gen = rt.generate(
            [ids],
            max_new_tokens,
            eos_token_ids=stop_token_ids(shards, tok),
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            seed=sampling["seed"],
            on_token=on_token,
        )
        seconds = time.perf_counter() - start
        if not rt.is_main:
            return
        tokens = gen.tokens[0]
        if as_json:
            print_json(
                {
                    "prompt": prompt,
                    "prompt_tokens": len(ids),
                    "tokens": tokens,
                    "text": decode(tokens),
                    "seconds": seconds,
                    "timeline": timeline.timeline(),
                }
            )
        else:
            sys.stdout.write(stream.finish() + "\n")
            err.print(f"{len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / max(seconds, 1e-9):.1f} tokens/s)")


def generate_file(
    input_file: Path,
    output: Path | None,
    strict: bool,
    max_batch: str,
    max_context: int | None,
    sampling: dict[str, Any],
    run: dict[str, Any],
    as_json: bool,
) -> None:
    """`generate --input`: the batch file through the online loop (serve/batch.py).  Rank 0 takes
    the output (ours or refused, locked) before the model loads: a refusal comes at once."""
    from ..shards.manifest import load_manifest

    if output is None:
        raise UserError("--input needs --output FILE (the results, one JSON line per request)")
    if not input_file.is_file():
        raise UserError(f"--input {input_file}: no such file")
    if output.resolve() == input_file.resolve():
        raise UserError("--output must not be the --input file")
    check_output_file(output, "--output")
    batch = parse_max_batch(max_batch)
    if max_context is not None and max_context < 2:
        raise UserError(f"--max-context {max_context}: must be >= 2")
    manifest = load_manifest(run["shards"])
    from contextlib import nullcontext

    from ..runtime.batching.engine import Runtime
    from ..serve.batch import ResultsFile, run_batch, run_header

    main = os.environ.get("RANK", "0") == "0"
    bar = RequestProgress(enabled=main and not as_json)
    header = run_header(manifest, sampling, run["forward_options"])
    with (
        ResultsFile(output, header) if main else nullcontext() as results,
        Runtime(**run) as rt,
        bar,
    ):
        summary = run_batch(
            rt,
            str(input_file),
            results,
            sampling,
            strict,
            batch,
            max_context=max_context,
            on_start=bar.start,
            on_result=bar.result,
            on_refused=lambda n, why: bar.warn(f"--input line {n}: {why}"),
        )
    if summary is None:  # a torchrun rank other than 0
        return
    if as_json:
        print_json(dataclasses.asdict(summary))
    else:
        rate = summary.generated_tokens / max(summary.seconds, 1e-9)
        err.print(
            f"{summary.ran} requests run, {summary.skipped} already in {output}, {len(summary.errors)} refused; "
            f"{summary.generated_tokens} tokens in {summary.seconds:.1f} s ({rate:.1f} tokens/s)",
            highlight=False,
            markup=False,
        )
    if summary.errors:
        numbers = ", ".join(str(n) for n, _ in summary.errors[:10]) + (", ..." if len(summary.errors) > 10 else "")
        raise UserError(
            f"{len(summary.errors)} of {summary.lines} input lines were refused (line(s) {numbers}); "
            f"their error records are in {output}"
        )
