"""The `plamo2-tools` command line: a thin Typer layer over the library API.

Every command prints one readable line (no traceback) for user errors and exits with the codes
listed in `plamo2_tools.errors`; `--json` prints machine-readable results on stdout only.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from . import __version__
from .errors import Plamo2Error, UserError

app = typer.Typer(
    name="plamo2-tools",
    help="Split, check and run PLaMo 2 checkpoints (hybrid Mamba2 + attention).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs, files) gets wide tables instead of Rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """User errors -> one red line and their exit code; Ctrl-C/SIGTERM -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return fn(*args, **kwargs)
        except Plamo2Error as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]: unfinished output is left as *.partial / journal; run again to resume")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens step by step.")] = False,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        out.print(__version__)
        raise typer.Exit(0)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


class ByteProgress:
    """A Rich bytes-and-rate progress bar on stderr; callable with a byte count.  The total may
    come later (convert knows it once its plan exists): call `start(total)` then."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.description, self.enabled = description, enabled
        self.bar: Progress | None = None
        self.task: Any = None

    def start(self, total: int) -> None:
        if not self.enabled:
            return
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn())  # fmt: skip
        self.bar = Progress(*columns, console=err)
        self.bar.start()
        self.task = self.bar.add_task(self.description, total=total)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def byte_progress(description: str, total: int | None = None, enabled: bool = True) -> Iterator[ByteProgress]:
    progress = ByteProgress(description, enabled)
    if total is not None:
        progress.start(total)
    try:
        yield progress
    finally:
        progress.stop()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


# ---- synth -------------------------------------------------------------------------------------
@app.command()
@handle_errors
def synth(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Directory to create.")],
    preset: Annotated[str, typer.Option(help="plamo-2-1b, plamo-2-8b, tiny, tiny-gqa or tiny-edge.")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same bytes.")] = 0,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16 (default: the preset's).")] = None,
    files: Annotated[int, typer.Option(help="Split the weights into N files with an HF index.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Write a random PLaMo 2 checkpoint in the exact Hugging Face layout.

    Real shapes (plamo-2-1b, plamo-2-8b) for benchmarks; tiny presets for tests.  Values keep the
    model numerically healthy, and a tokenizer that AutoTokenizer loads is included.
    """
    from .synth import DTYPES, checkpoint_bytes, preset_config
    from .synth import synth as run

    cfg = preset_config(preset, dtype)
    total = checkpoint_bytes(cfg, DTYPES[cfg.torch_dtype])
    with byte_progress(f"synth {preset}", total, enabled=not as_json) as progress:
        run(out_dir, preset, seed=seed, dtype=dtype, files=files, force=force, progress=progress)
    result = {"path": str(out_dir), "preset": preset, "parameters": cfg.num_parameters(), "bytes": total,
              "dtype": cfg.torch_dtype, "seed": seed, "files": files}  # fmt: skip
    if as_json:
        print_json(result)
    else:
        out.print(
            f"wrote {preset} ({cfg.num_parameters():,} parameters, {total / 1e9:.3f} GB {cfg.torch_dtype}) to {out_dir}"
        )


# ---- inspect -----------------------------------------------------------------------------------
@app.command()
@handle_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="An HF checkpoint or a shard directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
) -> None:
    """Show the config, the layer map, parameter counts, inventory problems and which TP / PP splits
    are possible (with the reason for each impossible one)."""
    from .inspect import inspect_path

    info = inspect_path(path)
    if as_json:
        print_json(info)
        return
    c = info["config"]
    out.print(f"[bold]{info['path']}[/] ({'HF checkpoint' if info['kind'] == 'hf' else 'plamo2-tools shards'})")
    out.print(
        f"D={c['hidden_size']} L={c['num_hidden_layers']} Hq={c['num_attention_heads']} Hkv={c['num_key_value_heads']} "
        f"d={c['hidden_size_per_head']} Hm={c['mamba_num_heads']} N={c['mamba_d_state']} K={c['mamba_d_conv']} "
        f"F={c['intermediate_size']} V={c['vocab_size']} (padded {c['padded_vocab']}) I={c['mamba_inner']} "
        f"R={c['dt_rank']} tied={c['tie_word_embeddings']} rope_theta={c['rope_theta']:g} "
        f"window={c['attention_window_size']}",
        highlight=False,
    )
    out.print(
        "layers: "
        + " ".join("M" if x["kind"] == "mamba" else "A" for x in info["layers"])
        + "  (M = Mamba, A = attention)"
    )
    if info["kind"] == "hf":
        out.print(f"parameters: {info['parameters']:,} in {info['tensors']} tensors")
    else:
        m = info["mapping"]
        out.print(f"shards: tp={m['tp_size']} pp={m['pp_size']} stages={m['stages']} dtype={info['options']['dtype']}")
    out.print("bytes: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in info["bytes_by_dtype"].items()))
    problems = info.get("inventory_problems") or []
    if problems:
        out.print(f"[red]inventory problems ({len(problems)}):[/]")
        for p in problems:
            out.print(f"  {p}", highlight=False)
    elif info["kind"] == "hf":
        out.print("inventory: [green]all tensors present with the expected shapes[/]")
    table = Table(title="possible splits")
    table.add_column("split")
    table.add_column("ok")
    table.add_column("detail")
    for row in info["splits"]["tp"]:
        table.add_row(f"tp={row['tp']}", "yes" if row["ok"] else "[red]no[/]", "; ".join(row["reasons"] + row["notes"]))
    for row in info["splits"]["pp"]:
        detail = "; ".join(row["reasons"]) or "layers per stage " + ",".join(map(str, row["layers"]))
        table.add_row(f"pp={row['pp']}", "yes" if row["ok"] else "[red]no[/]", detail)
    out.print(table)


# ---- logits ------------------------------------------------------------------------------------
@app.command()
@handle_errors
def logits(
    path: Annotated[Path, typer.Argument(help="An HF checkpoint (reference forward) or a shard directory.")],
    input_ids: Annotated[str, typer.Option(help="Comma-separated token ids, e.g. 1,2,3.")],
    out_file: Annotated[Path, typer.Option("--out", help="Where to write float32 logits (tokens, vocab) as .npy.")],
    precision: Annotated[str, typer.Option(help="Reference forward precision: float64 or float32.")] = "float64",
    backend: Annotated[str, typer.Option(help="Shards only: kernel backend auto, torch or triton.")] = "auto",
    device: Annotated[str, typer.Option(help="Shards only: cpu or cuda.")] = "cpu",
) -> None:
    """Logits of one token sequence, written as a float32 .npy array of shape (tokens, vocab)."""
    import numpy as np
    import torch

    from .convert.manifest import MANIFEST_NAME

    ids = _int_list(input_ids, "--input-ids")
    if not ids:
        raise UserError("--input-ids needs at least one token id")
    if (path / MANIFEST_NAME).exists():
        from .runtime.engine import load_engine

        with load_engine(path, device=device, backend=backend) as engine:
            result = engine.prompt_logits([ids])[0]
            if not engine.is_main:  # under torchrun only rank 0 writes
                return
    else:
        from .checkpoint import HFCheckpoint
        from .reference import reference_logits

        dtypes = {"float64": torch.float64, "float32": torch.float32}
        if precision not in dtypes:
            raise UserError("--precision must be float64 or float32")
        with HFCheckpoint(path) as ckpt:
            ckpt.check_inventory()
            result = reference_logits(ckpt, [ids], dtypes[precision])[0]
    np.save(out_file, result.numpy())
    err.print(f"wrote logits {tuple(result.shape)} to {out_file}")


# ---- convert -----------------------------------------------------------------------------------
@app.command()
@handle_errors
def convert(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a shard directory made by this tool.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size.")] = 1,
    dtype: Annotated[str, typer.Option(help="auto (keep), bfloat16, float16 or float32.")] = "auto",
    pp_layers: Annotated[
        str | None, typer.Option(help="Layers per stage, e.g. 5,6,5 (like VLLM_PP_LAYER_PARTITION).")
    ] = None,
    max_part_size: Annotated[str, typer.Option(help="Largest file per rank, e.g. 5GiB, 500MB.")] = "5GiB",
    force: Annotated[bool, typer.Option(help="Replace a different completed conversion in OUT.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Reshard a PLaMo 2 checkpoint into TP x PP shard files laid out as vLLM's Plamo2ForCausalLM
    holds them per rank (files model-rank-{r}-part-{n}.safetensors, r = pp_rank * tp + tp_rank).

    Streams tensor by tensor with bounded memory, checksums every file and tensor, writes the
    manifest plamo2_shards.json last, and resumes an interrupted run.
    """
    from .convert.engine import convert as run
    from .convert.plan import parse_size

    with byte_progress(f"convert tp={tp} pp={pp}", enabled=not as_json) as progress:
        result = run(
            src, out_dir, tp=tp, pp=pp, pp_layers=_int_list(pp_layers, "--pp-layers"), dtype=dtype,
            max_part_size=parse_size(max_part_size), force=force, progress=progress,
            on_plan=lambda plan: progress.start(plan.payload_bytes),
        )  # fmt: skip
    summary = _convert_summary(result)
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"{result.status}: {out_dir}")
    for col in ("rank", "tp", "pp", "layers", "files", "tensors", "bytes"):
        table.add_column(col, justify="right" if col != "layers" else "left")
    for r in summary["ranks"]:
        table.add_row(
            str(r["rank"]),
            str(r["tp_rank"]),
            str(r["pp_rank"]),
            r["layers"],
            str(r["files"]),
            str(r["tensors"]),
            f"{r['bytes']:,}",
        )
    out.print(table)
    out.print(
        f"{summary['status']} in {summary['seconds']:.2f} s: {summary['bytes_written'] / 1e9:.3f} GB written"
        + (f", {len(summary['files_reused'])} file(s) reused" if summary["files_reused"] else ""),
        highlight=False,
    )


def _convert_summary(result: Any) -> dict[str, Any]:
    plan = result.plan
    m = plan.mapping
    ranks = []
    for r in range(m.world_size):
        tp_rank, pp_rank = m.ranks(r)
        files = [f for f in plan.files if f.rank == r]
        start, stop = m.stages[pp_rank]
        ranks.append({
            "rank": r, "tp_rank": tp_rank, "pp_rank": pp_rank, "layers": f"{start}-{stop - 1}",
            "files": len(files), "tensors": sum(len(f.tensors) for f in files),
            "bytes": sum(f.layout.size for f in files),
        })  # fmt: skip
    return {
        "status": result.status,
        "out": str(result.out),
        "tp": m.tp,
        "pp": m.pp,
        "seconds": result.seconds,
        "bytes_total": plan.total_bytes,
        "bytes_written": result.bytes_written,
        "files_reused": result.files_reused,
        "ranks": ranks,
    }


# ---- merge -------------------------------------------------------------------------------------
@app.command()
@handle_errors
def merge(
    shards: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert`.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Where to write the HF checkpoint.")],
    max_part_size: Annotated[str, typer.Option(help="Largest output file, e.g. 5GiB, 500MB.")] = "5GiB",
    force: Annotated[bool, typer.Option(help="Replace OUT if it exists and is not empty.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Rebuild the Hugging Face checkpoint from shards (the inverse of convert).

    Resharded tensors come back byte-identical; A and the offset norms within the rounding of their
    transform; a dtype cast made by convert is kept (precision cannot come back).
    """
    import time

    from .convert.merge import merge as run
    from .convert.merge import merged_bytes
    from .convert.plan import parse_size

    limit = parse_size(max_part_size)
    start = time.perf_counter()
    with byte_progress(f"merge {shards}", merged_bytes(shards), enabled=not as_json) as progress:
        names = run(shards, out_dir, max_part_size=limit, force=force, progress=progress)
    result = {"out": str(out_dir), "files": names, "bytes": sum((out_dir / n).stat().st_size for n in names),
              "seconds": time.perf_counter() - start}  # fmt: skip
    if as_json:
        print_json(result)
    else:
        out.print(
            f"merged {shards} into {out_dir}: {len(names)} file(s), {result['bytes'] / 1e9:.3f} GB "
            f"in {result['seconds']:.2f} s",
            highlight=False,
        )


# ---- check -------------------------------------------------------------------------------------
@app.command()
@handle_errors
def check(
    path: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Verify a shard directory without running the model: files, sizes and digests, headers and
    metadata, tensor digests, replicas, vocab padding and source coverage.  Exit 1 on a problem."""
    from .convert.check import check_shards
    from .convert.manifest import load_manifest
    from .errors import CheckFailed

    total = sum(f["size"] for f in load_manifest(path).files.values())
    with byte_progress(f"check {path}", total, enabled=not as_json) as progress:
        report = check_shards(path, progress=progress)
    problems = sum(len(v) for v in report.checks.values())
    if as_json:
        print_json(report.to_dict())
    else:
        table = Table(title=f"check: {path}")
        table.add_column("check")
        table.add_column("result")
        for name, found in report.checks.items():
            table.add_row(name, "[green]ok[/]" if not found else f"[red]{len(found)} problem(s)[/]")
        out.print(table)
        for name, found in report.checks.items():
            for line in found:
                out.print(f"  [red]{name}[/]: {line}", highlight=False)
    if not report.ok:
        failed = [name for name, found in report.checks.items() if found]
        raise CheckFailed(f"{path}: {problems} problem(s) in: {', '.join(failed)}")
    if not as_json:
        out.print(f"[green]ok[/]: {path} is complete and matches its manifest")


def _print_verify(result: dict[str, Any], title: str) -> None:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    table = Table(title=title)
    for col in ("layout", "dtype", "max|Δ|", "rel err", "KL", "top-1", "greedy", "lp-close", "result"):
        table.add_column(col, no_wrap=True)
    for x in result["layouts"]:
        m = x["metrics"]
        table.add_row(
            f"tp{x['tp']}×pp{x['pp']}" + ("/torchrun" if x["launch"] else ""), short.get(x["dtype"], x["dtype"]),
            f"{m['max_abs_logit_diff']:.1e}", f"{m['max_rel_err']:.1e}", f"{m['mean_kl']:.1e}",
            f"{m['top1_agreement']:.3f}", f"{m['greedy_match_fraction']:.3f}", "yes" if m["logprobs_close"] else "no",
            "[green]pass[/]" if x["passed"] else "[red]FAIL[/]",
        )  # fmt: skip
    out.print(table)
    for x in result["layouts"]:
        for f in x["failures"]:
            out.print(f"  [red]tp={x['tp']} pp={x['pp']}[/]: {f}", highlight=False)


@app.command()
@handle_errors
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the checkpoint and shards go.")] = Path("runs/demo"),
    preset: Annotated[
        str, typer.Option(help="Synthetic model preset (tiny, tiny-gqa, tiny-edge, plamo-2-1b, ...).")
    ] = "tiny",
    layouts: Annotated[str, typer.Option(help="TPxPP layouts, comma-separated.")] = "1x1,2x1,2x2",
    launch: Annotated[bool, typer.Option(help="Run the runtime as real torchrun ranks (gloo on CPU).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verify result as JSON.")] = False,
) -> None:
    """The main job on an embedded default: synthesise a checkpoint, convert it to several TP x PP
    layouts, check the shards, and verify each layout against the reference forward."""
    from .demo import run_demo
    from .errors import CheckFailed

    try:
        pairs = tuple((int(a), int(b)) for a, b in (x.lower().split("x") for x in layouts.split(",")))
    except ValueError:
        raise UserError(f"--layouts must look like 1x1,2x2 (got {layouts!r})") from None
    result = run_demo(workdir, preset, pairs, launch, log=(lambda m: None) if as_json else err.print)
    if as_json:
        print_json(result)
    else:
        _print_verify(result, f"demo: {preset} shards vs the reference forward")
        verdict = "[green]all layouts match the reference[/]" if result["passed"] else "[red]verification failed[/]"
        out.print(f"{verdict}  (shards in {workdir})")
    if not result["passed"]:
        raise CheckFailed("demo: a layout failed verification")


# ---- verify / generate -------------------------------------------------------------------------
@app.command()
@handle_errors
def verify(
    shards: Annotated[list[Path], typer.Argument(help="One or more shard directories (layouts) to check.")],
    reference: Annotated[Path, typer.Option(help="The original HF checkpoint they were converted from.")],
    prompts: Annotated[
        Path | None, typer.Option(help="Prompts: text (one per line) or JSON lines with input_ids/text.")
    ] = None,
    random: Annotated[int, typer.Option(help="Without --prompts: this many random token prompts (8-64 tokens).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens compared after each prompt.")] = 32,
    launch: Annotated[
        bool, typer.Option(help="Run the runtime as real torchrun ranks (gloo on CPU, NCCL on GPU).")
    ] = False,
    device: Annotated[str, typer.Option(help="Runtime device: cpu or cuda.")] = "cpu",
    backend: Annotated[str, typer.Option(help="Kernels: auto (Triton on CUDA), torch or triton.")] = "auto",
    precision: Annotated[str, typer.Option(help="Reference forward precision: float64 or float32.")] = "float64",
    reference_device: Annotated[str, typer.Option(help="Where the reference forward runs: cpu or cuda.")] = "cpu",
    prefill_chunk: Annotated[
        int | None, typer.Option(help="Prefill at most this many tokens per sequence per step.")
    ] = None,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON result to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Check converted shards by running them: runtime logits and greedy tokens against the reference
    forward of the original checkpoint, per layout.  Exit 1 when a layout fails its thresholds
    (fp32: max relative error < 1e-4 and identical greedy tokens; bf16/fp16: see the table)."""
    from .errors import CheckFailed
    from .runtime.verify import prompts_from_file, random_prompts
    from .runtime.verify import verify as run

    if prompts is not None:
        prompt_ids, source = prompts_from_file(prompts, reference), str(prompts)
    else:
        from .config import Plamo2Config

        cfg = Plamo2Config.from_file(reference)
        prompt_ids, source = (
            random_prompts(random, cfg.vocab_size, seed, cfg.bos_token_id),
            f"random(n={random}, seed={seed})",
        )
    with err.status(f"verifying {len(shards)} layout(s) on {len(prompt_ids)} prompts ..."):
        result = run(
            shards, reference, prompt_ids, source, max_new_tokens, launch, device, backend, precision, prefill_chunk,
            reference_device,
        )  # fmt: skip
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print_json(result)
    else:
        _print_verify(result, f"verify vs {reference} ({precision}, {len(prompt_ids)} prompts, {max_new_tokens} steps)")
    if not result["passed"]:
        raise CheckFailed(f"{sum(not x['passed'] for x in result['layouts'])} layout(s) failed verification")


@app.command()
@handle_errors
def generate(
    shards: Annotated[Path, typer.Argument(help="A shard directory.")],
    prompt: Annotated[str, typer.Option(help="The text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with temperature > 0).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (the same on every rank).")] = 0,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    backend: Annotated[str, typer.Option(help="Kernels: auto, torch or triton.")] = "auto",
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow the checkpoint's own tokenizer code (the real PLaMo 2 tokenizer).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON instead of streaming text.")
    ] = False,
) -> None:
    """Continue a prompt with the runtime, streaming text as it is generated.

    Runs all ranks in this process; under `torchrun --nproc-per-node N` each process is one real rank
    and rank 0 prints.  Stops at the checkpoint's EOS token(s) or after --max-new-tokens.
    """
    import time

    from .runtime.engine import Runtime, load_tokenizer

    with Runtime(shards, device=device, backend=backend) as rt:
        tok = load_tokenizer(shards, trust_remote_code=trust_remote_code)
        ids = list(tok(prompt)["input_ids"])
        eos = set(rt.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        printed = ""
        new: list[int] = []

        def stream(i: int, token: int) -> None:
            nonlocal printed
            new.append(token)
            text = tok.decode(new, skip_special_tokens=False)
            if rt.is_main and not as_json and not text.endswith("\ufffd"):  # wait for whole UTF-8 characters
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text

        start = time.perf_counter()
        gen = rt.generate(
            [ids],
            max_new_tokens,
            eos_token_ids=sorted(eos),
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            on_token=stream,
        )
        seconds = time.perf_counter() - start
        text = tok.decode(gen.tokens[0], skip_special_tokens=False)
        if not rt.is_main:
            return
        if as_json:
            print_json(
                {"prompt": prompt, "prompt_tokens": len(ids), "tokens": gen.tokens[0], "text": text, "seconds": seconds}
            )
        else:
            sys.stdout.write(text[len(printed) :] + "\n")
            err.print(
                f"{len(gen.tokens[0])} tokens in {seconds:.2f} s "
                f"({len(gen.tokens[0]) / max(seconds, 1e-9):.1f} tokens/s)"
            )


# ---- eval --------------------------------------------------------------------------------------
def _parse_limit(text: str | None) -> int | float | None:
    """lm-eval's --limit: N documents, or a fraction of them when below 1."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"--limit must be a number, got {text!r}") from None
    if value <= 0:
        raise typer.BadParameter("--limit must be > 0")
    return int(value) if value >= 1 and value.is_integer() else value


@app.command("eval")
@handle_errors
def eval_shards(
    shards: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert` (any TP x PP).")],
    tasks: Annotated[str, typer.Option(help="Comma-separated lm-eval tasks; gsm8k is supported.")] = "gsm8k",
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples (default: the task's, 5).")] = None,
    limit: Annotated[str | None, typer.Option(help="First N test documents (or a fraction < 1).")] = None,
    batch_size: Annotated[int, typer.Option(help="Requests per runtime call.")] = 8,
    gsm8k_dir: Annotated[Path | None, typer.Option(help="Holds train/test.jsonl (default: $PLAMO2_GSM8K_DIR).")] = None,
    output_path: Annotated[Path | None, typer.Option(help="Write results and samples under DIR/<shards>/.")] = None,
    launch: Annotated[bool, typer.Option(help="Ranks as torchrun processes, not threads.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    backend: Annotated[str, typer.Option(help="Kernel backend: auto, torch or triton.")] = "auto",
    max_gen_toks: Annotated[int, typer.Option(help="Most new tokens per answer when the task sets none.")] = 256,
    max_length: Annotated[int | None, typer.Option(help="Context limit (default: the config's).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Run the checkpoint's tokenizer code (PLaMo 2).")] = False,
    allow_unverified_data: Annotated[bool, typer.Option(help="Accept non-official GSM8K files.")] = False,
    bootstrap_iters: Annotated[int, typer.Option(help="Bootstrap iterations for stderrs (0: none).")] = 100_000,
    log_samples: Annotated[bool, typer.Option(help="Write per-sample logs (needs --output-path).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary instead of the table.")] = False,
) -> None:
    """Score a shard directory on GSM8K with lm-eval's own task, offline, from local data files.

    Uses the installed lm-eval gsm8k task (prompt, filters, metrics; version 3) with only the
    dataset pointed at the local files, whose sha256 must be the official one.  Results land where
    lm-eval puts them (DIR/<sanitized shards path>/results_<date>.json, samples_gsm8k_<date>.jsonl)
    plus a stable results.json.
    """
    from .eval.gsm8k_task import load_gsm8k_data
    from .eval.harness import EvalRequest, check_tasks, run_eval

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    check_tasks(task_list)
    data = load_gsm8k_data(gsm8k_dir, allow_unverified=allow_unverified_data)
    if not data.verified:
        err.print("[yellow]warning:[/] not the official GSM8K files; scores do not compare with published numbers")
    request = EvalRequest(
        shards=str(shards), data=data.to_dict(), tasks=task_list, num_fewshot=num_fewshot, limit=_parse_limit(limit),
        batch_size=batch_size, output_path=str(output_path) if output_path else None, device=device, backend=backend,
        max_gen_toks=max_gen_toks, max_length=max_length, trust_remote_code=trust_remote_code,
        bootstrap_iters=bootstrap_iters, log_samples=log_samples and output_path is not None,
    )  # fmt: skip
    outcome = run_eval(request, launch=launch)
    if as_json:
        print_json(outcome.summary())
        return
    out.print(outcome.header, highlight=False, markup=False, soft_wrap=True)
    out.print(outcome.table, highlight=False, markup=False)
    for name, path in outcome.files.items():
        out.print(f"{name}: {path}", highlight=False, markup=False, soft_wrap=True)
    mode = "torchrun ranks" if launch else "in-process ranks"
    out.print(f"done in {outcome.wall_seconds:.1f} s ({mode})", highlight=False)


# ---- lm-eval -----------------------------------------------------------------------------------
@app.command(
    "lm-eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
@handle_errors
def lm_eval_passthrough(ctx: typer.Context) -> None:
    """lm-eval's own CLI with the plamo2 model registered; every argument goes to lm-eval.

    Example: plamo2-tools lm-eval run --model plamo2 --model_args pretrained=SHARDS --tasks gsm8k
    --include_path DIR --output_path OUT --log_samples
    """
    from .eval.lm_eval_cli import main as lm_eval_main

    raise typer.Exit(lm_eval_main(ctx.args))


# ---- report ------------------------------------------------------------------------------------
@app.command()
@handle_errors
def report(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="Result files or directories (recursive).")],
    out_file: Annotated[Path, typer.Option("--out", help="Markdown to write (reports/NAME.md); plots: NAME-*.png.")],
    title: Annotated[str | None, typer.Option(help="Page title (default: Report: NAME).")] = None,
    timestamp: Annotated[bool, typer.Option("--timestamp/--no-timestamp", help="Write the 'generated' line.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a summary: sections, files, outputs.")] = False,
) -> None:
    """Turn result JSON into one Markdown report with PNG plots beside it: lm-eval results (across
    TP x PP layouts, next to the published vLLM reference), verify results, convert and kernel
    benchmarks, and convert / check / inspect --json output.

    Files are recognised by content; unknown JSON is skipped with a note.  Exit 2 when nothing
    usable is found.  The page is deterministic except its 'generated' line (--no-timestamp).
    """
    from rich.markup import escape

    from .report import build_report

    result = build_report(inputs, out_file, title=title, timestamp=timestamp)
    if as_json:
        print_json(result.summary())
        return
    table = Table(title=f"report: {out_file}")
    table.add_column("file")
    table.add_column("read as")
    for doc in result.docs:
        table.add_row(escape(doc.name), doc.kind)
    out.print(table)
    for warning in result.warnings:  # Markdown text: the code-span backticks mean nothing on a console
        err.print(f"[yellow]warning:[/] {escape(warning.replace('`', ''))}", highlight=False)
    skipped = f", skipped {len(result.skipped)} unrecognised or duplicate file(s)" if result.skipped else ""
    out.print(f"wrote {out_file} and {len(result.plots)} plot(s) from {len(result.docs)} file(s){skipped}",
              highlight=False, markup=False)  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    app()
