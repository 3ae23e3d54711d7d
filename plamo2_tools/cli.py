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
from .errors import Plamo2Error

app = typer.Typer(
    name="plamo2-tools",
    help="Split, check and run PLaMo 2 checkpoints (hybrid Mamba2 + attention).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
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


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from None


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
        out.print(f"wrote {preset} ({cfg.num_parameters():,} parameters, {total / 1e9:.3f} GB {cfg.torch_dtype}) to {out_dir}")


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
        f"R={c['dt_rank']} tied={c['tie_word_embeddings']} rope_theta={c['rope_theta']:g} window={c['attention_window_size']}",
        highlight=False,
    )
    out.print("layers: " + " ".join("M" if x["kind"] == "mamba" else "A" for x in info["layers"]) + "  (M = Mamba, A = attention)")
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
        raise typer.BadParameter("--input-ids needs at least one token id")
    if (path / MANIFEST_NAME).exists():
        from .runtime.engine import load_engine

        with load_engine(path, device=device, backend=backend) as engine:
            result = engine.prompt_logits([ids])[0]
    else:
        from .checkpoint import HFCheckpoint
        from .reference import reference_logits

        dtypes = {"float64": torch.float64, "float32": torch.float32}
        if precision not in dtypes:
            raise typer.BadParameter("--precision must be float64 or float32")
        with HFCheckpoint(path) as ckpt:
            ckpt.check_inventory()
            try:
                result = reference_logits(ckpt, [ids], dtypes[precision])[0]
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
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
    pp_layers: Annotated[str | None, typer.Option(help="Layers per stage, e.g. 5,6,5 (like VLLM_PP_LAYER_PARTITION).")] = None,
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

    with _lazy_byte_progress(f"convert tp={tp} pp={pp}", enabled=not as_json) as progress:
        result = run(
            src, out_dir, tp=tp, pp=pp, pp_layers=_int_list(pp_layers, "--pp-layers"), dtype=dtype,
            max_part_size=parse_size(max_part_size), force=force, progress=progress, on_plan=progress.start,
        )  # fmt: skip
    summary = _convert_summary(result)
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"{result.status}: {out_dir}")
    for col in ("rank", "tp", "pp", "layers", "files", "tensors", "bytes"):
        table.add_column(col, justify="right" if col != "layers" else "left")
    for r in summary["ranks"]:
        table.add_row(str(r["rank"]), str(r["tp_rank"]), str(r["pp_rank"]), r["layers"], str(r["files"]), str(r["tensors"]), f"{r['bytes']:,}")
    out.print(table)
    out.print(
        f"{summary['status']} in {summary['seconds']:.2f} s: {summary['bytes_written'] / 1e9:.3f} GB written"
        + (f", {len(summary['files_reused'])} file(s) reused" if summary["files_reused"] else ""),
        highlight=False,
    )


class _LazyProgress:
    """A byte progress bar whose total is known only once the plan exists."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.description, self.enabled = description, enabled
        self.bar: Progress | None = None
        self.task: Any = None

    def start(self, plan: Any) -> None:
        if not self.enabled:
            return
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
        self.bar = Progress(*columns, console=err)
        self.bar.start()
        self.task = self.bar.add_task(self.description, total=plan.payload_bytes)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def _lazy_byte_progress(description: str, enabled: bool) -> Iterator[_LazyProgress]:
    progress = _LazyProgress(description, enabled)
    try:
        yield progress
    finally:
        progress.stop()


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
            "files": len(files), "tensors": sum(len(f.tensors) for f in files), "bytes": sum(f.layout.size for f in files),
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


if __name__ == "__main__":  # pragma: no cover
    app()
