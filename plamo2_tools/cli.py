"""The `plamo2-tools` command line: a thin Typer layer over the library API.

Every command prints one readable line (no traceback) for user errors and exits with the codes
listed in `plamo2_tools.errors`; `--json` prints machine-readable results on stdout only.
"""

from __future__ import annotations

import errno
import functools
import importlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from typer.core import TyperGroup

from . import __version__
from .errors import BUG_EXIT_CODE, REPORT_BUGS_TO, EnvironmentLimitError, Plamo2Error, UserError

# Typer's own click (a vendored copy in recent Typer, the click package in older ones): its
# exception classes are the ones raised.
clicks = importlib.import_module(typer.BadParameter.__module__)
NoArgsIsHelpError = getattr(clicks, "NoArgsIsHelpError", ())  # click < 8.2 prints help without raising


class OneLineErrors(TyperGroup):
    """Click's usage errors (unknown option, bad value, missing argument) as one `error:` line with
    exit 2, like every other bad input, instead of a usage box; help and --version unchanged."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:  # fmt: skip
        def run() -> Any:
            return super(OneLineErrors, self).main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
            )

        if not standalone_mode:
            return run()
        try:
            code = run()
        except NoArgsIsHelpError as e:  # the help text is printed already
            sys.exit(e.exit_code)
        except clicks.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            hint = f" (see {ctx.command_path} --help)" if ctx is not None and isinstance(e, clicks.UsageError) else ""
            error_line(f"{where}{e.format_message()}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:  # Ctrl-C outside a command (while parsing, importing, ...)
            error_line("interrupted", label="interrupted")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="plamo2-tools",
    help="Split, check and run PLaMo 2 checkpoints (hybrid Mamba2 + attention).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)
# Piped output (CI logs, files) gets wide tables instead of Rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
F = TypeVar("F", bound=Callable[..., Any])

# What an interrupted command leaves behind, per command (the function's name); `{out}` is its
# output directory.  Commands not listed write nothing before they finish.
INTERRUPTED = {
    "convert": "{out} keeps the finished shard files and has no manifest yet; run the same convert again to resume",
    "merge": "{out} is incomplete (no config.json yet); run the same merge again to redo it",
    "synth": "{out} is incomplete; run the same synth again to redo it",
    "demo": "{out} may hold unfinished layouts; run demo again to redo them",
    "report": "the report may be incomplete; run report again",
    "lm_eval_passthrough": "lm-eval's outputs may be incomplete",
}
# OS errors that are the machine's refusal rather than a bug of ours, wherever they surface.
ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EMFILE,
                      errno.ENFILE, errno.ENOMEM}  # fmt: skip


def error_line(message: str, label: str = "error") -> None:
    """One line on stderr, never wrapped, never read as Rich markup (messages hold [brackets])."""
    err.print(f"[bold red]{label}:[/] {escape(message)}", highlight=False, soft_wrap=True)


def handle_errors(fn: F) -> F:
    """The one error path of every command: user and environment errors are one `error:` line with
    their exit code (2 or 3); Ctrl-C or SIGTERM says what is left behind (130); anything else is a
    bug: its traceback, then one line saying so and where to report it (exit 70)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return fn(*args, **kwargs)
        except Plamo2Error as e:
            error_line(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            left = INTERRUPTED.get(fn.__name__, "nothing was written")
            target = kwargs.get("out_dir") or kwargs.get("workdir") or "the output"
            error_line(left.format(out=target), label="interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, clicks.ClickException):
            raise
        except OSError as e:
            if e.errno not in ENVIRONMENT_ERRNOS:
                _bug(fn.__name__)
            where = f"{e.filename}: " if e.filename else ""
            error_line(f"{where}{e.strerror or e}")
            raise typer.Exit(3) from None
        except MemoryError:
            error_line("out of memory")
            raise typer.Exit(3) from None
        except Exception as e:
            if type(e).__name__ == "OutOfMemoryError":  # torch's, for CUDA and the CPU allocator
                error_line(f"out of memory: {str(e).splitlines()[0] if str(e) else ''}")
                raise typer.Exit(3) from None
            _bug(fn.__name__)

    return wrapper  # type: ignore[return-value]


def _bug(command: str) -> NoReturn:
    traceback.print_exc()
    name = command.removesuffix("_shards").removesuffix("_passthrough").replace("_", "-")
    error_line(
        f"plamo2-tools {__version__} `{name}` failed with the traceback above: this is a bug in plamo2-tools, "
        f"not in your input; please report it to {REPORT_BUGS_TO}",
        label="bug",
    )
    raise typer.Exit(BUG_EXIT_CODE) from None


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _print_version(value: bool) -> None:
    if value:
        out.print(__version__, highlight=False)
        raise typer.Exit(0)


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens step by step.")] = False,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


class ByteProgress:
    """A Rich bytes-and-rate progress bar on stderr; callable with a byte count.  The total may
    come later (convert knows it once its plan exists): call `start(total)` then.  The bar appears
    with the first bytes, so that a refusal during the checks before any work stays the only line
    on stderr."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.description, self.enabled = description, enabled
        self.bar: Progress | None = None
        self.task: Any = None
        self.total: int | None = None
        self._lock = threading.Lock()  # convert reports from several threads

    def columns(self) -> tuple[Any, ...]:
        return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn())  # fmt: skip

    def start(self, total: int) -> None:
        self.total = total

    def __call__(self, n: int) -> None:
        if not self.enabled or self.total is None:
            return
        if self.bar is None:
            with self._lock:
                if self.bar is None:
                    bar = Progress(*self.columns(), console=err)
                    bar.start()
                    self.task = bar.add_task(self.description, total=self.total)
                    self.bar = bar
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


class StepProgress(ByteProgress):
    """The same bar counting steps (tokens, forwards) instead of bytes."""

    def columns(self) -> tuple[Any, ...]:
        return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn())  # fmt: skip


@contextmanager
def step_progress(description: str, total: int, enabled: bool = True) -> Iterator[StepProgress]:
    progress = StepProgress(description, enabled)
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


def check_output_file(path: Path, option: str) -> None:
    """A file written when the work is done: refused now, not after it, when it cannot be written."""
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise EnvironmentLimitError(f"{option} {path}: cannot write in {parent} (permission denied or read-only)")


def check_output_dir(path: Path, option: str) -> None:
    """A directory created (if needed) when results are written: the nearest existing ancestor must
    be a writable directory."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"{option} {path}: {p} is not a directory")
            if not os.access(p, os.W_OK):
                raise EnvironmentLimitError(f"{option} {path}: cannot write in {p} (permission denied or read-only)")
            return


def check_tokens(ids: list[int], cfg: Any, new_tokens: int, what: str) -> None:
    """Token ids inside the vocabulary, and the sequence (with the tokens to generate) inside the
    model's positions."""
    bad = sorted({t for t in ids if not 0 <= t < cfg.vocab_size})
    if bad:
        raise UserError(f"{what}: token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    limit = cfg.max_position_embeddings
    if len(ids) + new_tokens > limit:
        extra = f" + {new_tokens} new tokens" if new_tokens else ""
        raise UserError(f"{what}: {len(ids)} tokens{extra} exceed the model's limit of {limit} positions")


def check_runtime_options(device: str, backend: str) -> None:
    from .runtime.devices import check_backend, check_device

    check_device(device)
    check_backend(backend, device)


def is_shard_dir(path: Path) -> bool:
    """A shard directory, finished or not (an unfinished one is then refused with its own words)."""
    from .shards.manifest import JOURNAL_NAME, MANIFEST_NAME

    return (path / MANIFEST_NAME).exists() or (path / JOURNAL_NAME).exists()


NoVerify = Annotated[
    bool,
    typer.Option(
        "--no-verify",
        help="Skip the digests of the shard files at load (headers, keys, shapes and dtypes are still "
        "checked); for directories `check` has just passed.",
    ),
]


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
    from .model.synth import DTYPES, checkpoint_bytes, preset_config
    from .model.synth import synth as run

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
    out.print(f"[bold]{info['path']}[/] ({'HF checkpoint' if info['format'] == 'hf' else 'plamo2-tools shards'})")
    out.print(
        f"D={c['hidden_size']} L={c['num_hidden_layers']} Hq={c['num_attention_heads']} Hkv={c['num_key_value_heads']} "
        f"d={c['hidden_size_per_head']} Hm={c['mamba_num_heads']} N={c['mamba_d_state']} K={c['mamba_d_conv']} "
        f"F={c['intermediate_size']} V={c['vocab_size']} (padded {c['padded_vocab']}) I={c['mamba_inner']} "
        f"R={c['dt_rank']} tied={c['tie_word_embeddings']} rope_theta={c['rope_theta']:g} "
        f"window={c['attention_window_size']} variant={c['variant']}",
        highlight=False,
    )
    out.print(
        "layers: "
        + " ".join("M" if x["kind"] == "mamba" else "A" for x in info["layers"])
        + "  (M = Mamba, A = attention)"
    )
    for x in info["layers"]:
        if x["kind"] == "attention":
            window = "full causal" if x["window"] is None else f"window {x['window']}"
            out.print(f"  layer {x['index']}: attention, {window}, RoPE base {x['rope_base']:g}", highlight=False)
    if info["format"] == "hf":
        out.print(f"parameters: {info['parameters']:,} in {info['tensors']} tensors")
    else:
        m = info["mapping"]
        out.print(f"shards: tp={m['tp_size']} pp={m['pp_size']} stages={m['stages']} dtype={info['options']['dtype']}")
        for line in info.get("vllm", []):
            out.print(f"vLLM: {line}", highlight=False)
    out.print("bytes: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in info["bytes_by_dtype"].items()))
    problems = info.get("inventory_problems") or []
    if problems:
        out.print(f"[red]inventory problems ({len(problems)}):[/]")
        for p in problems:
            out.print(f"  {p}", highlight=False)
    elif info["format"] == "hf":
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
    no_verify: NoVerify = False,
) -> None:
    """Logits of one token sequence, written as a float32 .npy array of shape (tokens, vocab)."""
    import numpy as np
    import torch

    ids = _int_list(input_ids, "--input-ids")
    if not ids:
        raise UserError("--input-ids needs at least one token id")
    check_output_file(out_file, "--out")
    if is_shard_dir(path):
        from .runtime.engine import load_engine
        from .shards.manifest import load_manifest

        check_runtime_options(device, backend)
        check_tokens(ids, load_manifest(path).config, 0, "--input-ids")
        with load_engine(path, device=device, backend=backend, verify_files=not no_verify) as engine:
            result = engine.prompt_logits([ids])[0]
            if not engine.is_main:  # under torchrun only rank 0 writes
                return
    else:
        from .model.checkpoint import HFCheckpoint
        from .model.reference import reference_logits
        from .shards.owned import ensure_readable_checkpoint

        dtypes = {"float64": torch.float64, "float32": torch.float32}
        if precision not in dtypes:
            raise UserError("--precision must be float64 or float32")
        ensure_readable_checkpoint(path)
        with HFCheckpoint(path) as ckpt:
            ckpt.check_inventory()
            check_tokens(ids, ckpt.config, 0, "--input-ids")
            result = reference_logits(ckpt, [ids], dtypes[precision])[0]
    with open(out_file, "wb") as f:  # a file object: np.save would append .npy to a bare name
        np.save(f, result.numpy())
    err.print(f"wrote logits {tuple(result.shape)} to {out_file}", highlight=False, markup=False)


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
    copy: Annotated[
        str,
        typer.Option(
            help="How verbatim bytes are copied: auto (in the kernel: copy_file_range, else sendfile, else user "
            "space), or force copy_file_range, sendfile or user (pread/pwrite)."
        ),
    ] = "auto",
    workers: Annotated[
        int | None, typer.Option(help="Threads copying and hashing (default: one per core, 4 to 16).")
    ] = None,
    verify_blobs: Annotated[
        bool,
        typer.Option(
            help="Check each Hugging Face cache blob's sha256 against its name (one extra sha256 pass over the "
            "input, ~1.4 GB/s per file; docs/shard-format.md)."
        ),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Reshard a PLaMo 2 checkpoint into TP x PP shard files laid out as vLLM's Plamo2ForCausalLM
    holds them per rank (files model-rank-{r}-part-{n}.safetensors, r = pp_rank * tp + tp_rank).

    Copies in the kernel where bytes are verbatim, on all cores, with bounded memory; records an
    XXH3-128 digest of every file and tensor; writes the manifest plamo2_shards.json last, and
    resumes an interrupted run.
    """
    from .convert.engine import convert as run
    from .convert.plan import parse_size

    with byte_progress(f"convert tp={tp} pp={pp}", enabled=not as_json) as progress:
        result = run(
            src, out_dir, tp=tp, pp=pp, pp_layers=_int_list(pp_layers, "--pp-layers"), dtype=dtype,
            max_part_size=parse_size(max_part_size), force=force, progress=progress,
            on_plan=lambda plan: progress.start(plan.payload_bytes), copy=copy, workers=workers,
            verify_blobs=verify_blobs,
        )  # fmt: skip
    summary = result.summary()
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


# ---- merge -------------------------------------------------------------------------------------
@app.command()
@handle_errors
def merge(
    shards: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert`.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Where to write the HF checkpoint.")],
    max_part_size: Annotated[str, typer.Option(help="Largest output file, e.g. 5GiB, 500MB.")] = "5GiB",
    force: Annotated[
        bool, typer.Option(help="Write into a non-empty OUT, replacing what an earlier merge wrote (nothing else).")
    ] = False,
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
    from .errors import CheckFailed
    from .shards.check import check_shards
    from .shards.manifest import load_manifest

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
    no_verify: NoVerify = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Check converted shards by running them: runtime logits and greedy tokens against the reference
    forward of the original checkpoint, per layout.  Exit 1 when a layout fails its thresholds
    (fp32: max relative error < 1e-4 and identical greedy tokens; bf16/fp16: see the table)."""
    from .errors import CheckFailed
    from .model.config import Plamo2Config
    from .runtime.devices import check_device
    from .runtime.verify import prompts_from_file, random_prompts, verify_work
    from .runtime.verify import verify as run
    from .shards.owned import ensure_readable_checkpoint

    check_runtime_options(device, backend)
    check_device(reference_device, "--reference-device")
    if max_new_tokens < 1 or random < 1:
        raise UserError("--max-new-tokens and --random must be >= 1")
    if output is not None:
        check_output_file(output, "--output")
    ensure_readable_checkpoint(reference)
    cfg = Plamo2Config.from_file(reference)
    if prompts is not None:
        prompt_ids, source = prompts_from_file(prompts, reference), str(prompts)
    else:
        prompt_ids, source = (
            random_prompts(random, cfg.vocab_size, seed, cfg.bos_token_id),
            f"random(n={random}, seed={seed})",
        )
    for i, ids in enumerate(prompt_ids):
        check_tokens(ids, cfg, max_new_tokens, f"prompt {i + 1}")
    with step_progress("verify", verify_work(len(shards), max_new_tokens), enabled=not as_json) as progress:
        result = run(
            shards, reference, prompt_ids, source, max_new_tokens, launch, device, backend, precision, prefill_chunk,
            reference_device, verify_files=not no_verify, progress=progress,
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
    no_verify: NoVerify = False,
    cuda_graph: Annotated[
        bool, typer.Option("--cuda-graph/--no-cuda-graph", help="CUDA: replay decode steps from CUDA graphs.")
    ] = True,
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
    from .shards.manifest import load_manifest

    if temperature < 0:
        raise UserError(f"--temperature {temperature:g}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p:g}: must be in (0, 1]")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    check_runtime_options(device, backend)
    cfg = load_manifest(shards).config
    tok = load_tokenizer(shards, trust_remote_code=trust_remote_code)
    ids = list(tok(prompt)["input_ids"])
    if not ids:
        raise UserError("--prompt: the prompt has no tokens")
    check_tokens(ids, cfg, max_new_tokens, "--prompt")
    # Streamed text is its own progress on a terminal; a bar when nothing streams there (rank 0's only).
    show = (as_json or not sys.stdout.isatty()) and os.environ.get("RANK", "0") == "0"
    bar = step_progress("generate", max_new_tokens, enabled=show)
    with (
        Runtime(shards, device=device, backend=backend, verify_files=not no_verify, cuda_graph=cuda_graph) as rt,
        bar as progress,
    ):
        eos = set(rt.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        printed = ""
        new: list[int] = []

        def stream(i: int, token: int) -> None:
            nonlocal printed
            new.append(token)
            progress(1)
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


def _check_eval_numbers(
    batch_size: int, max_gen_toks: int, max_length: int | None, num_fewshot: int | None, bootstrap_iters: int
) -> None:
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be >= 1")
    if max_gen_toks < 1:
        raise UserError(f"--max-gen-toks {max_gen_toks}: must be >= 1")
    if max_length is not None and max_length <= max_gen_toks:
        raise UserError(f"--max-length {max_length}: must exceed --max-gen-toks ({max_gen_toks})")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot {num_fewshot}: must be >= 0")
    if bootstrap_iters < 0:
        raise UserError(f"--bootstrap-iters {bootstrap_iters}: must be >= 0")


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
    no_verify: NoVerify = False,
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
    from .shards.integrity import verify_rank_files
    from .shards.manifest import load_manifest

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    check_tasks(task_list)
    check_runtime_options(device, backend)
    _check_eval_numbers(batch_size, max_gen_toks, max_length, num_fewshot, bootstrap_iters)
    parsed_limit = _parse_limit(limit)
    if output_path is not None:
        check_output_dir(output_path, "--output-path")
    manifest = load_manifest(shards)  # refuses a directory being written or unfinished
    positions = manifest.config.max_position_embeddings
    if max_length is not None and max_length > positions:
        raise UserError(f"--max-length {max_length}: the model has {positions} positions")
    # The shard files against their manifest, here and once (the runtime then skips the digests).
    verify_rank_files(manifest, range(manifest.mapping.world_size), digests=not no_verify)
    data = load_gsm8k_data(gsm8k_dir, allow_unverified=allow_unverified_data)
    if not data.verified:
        err.print("[yellow]warning:[/] not the official GSM8K files; scores do not compare with published numbers")
    request = EvalRequest(
        shards=str(shards), data=data.to_dict(), tasks=task_list, num_fewshot=num_fewshot, limit=parsed_limit,
        batch_size=batch_size, output_path=str(output_path) if output_path else None, device=device, backend=backend,
        max_gen_toks=max_gen_toks, max_length=max_length, trust_remote_code=trust_remote_code,
        bootstrap_iters=bootstrap_iters, log_samples=log_samples and output_path is not None,
        verify_files=False,
    )  # fmt: skip
    outcome = run_eval(request, launch=launch)
    if outcome is None:  # a torchrun rank other than the first: rank 0 prints and writes
        return
    if as_json:
        print_json(outcome.summary())
        return
    out.print(outcome.header, highlight=False, markup=False, soft_wrap=True)
    out.print(outcome.table, highlight=False, markup=False)
    for name, path in outcome.files.items():
        out.print(f"{name}: {path}", highlight=False, markup=False, soft_wrap=True)
    mode = "torchrun ranks" if launch else "in-process ranks"
    out.print(f"done in {outcome.wall_seconds:.1f} s ({mode})", highlight=False)


@app.command("gsm8k-task")
@handle_errors
def gsm8k_task(
    out_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write gsm8k.yaml (created if missing).")],
    gsm8k_dir: Annotated[Path | None, typer.Option(help="Holds train/test.jsonl (default: $PLAMO2_GSM8K_DIR).")] = None,
    allow_unverified_data: Annotated[bool, typer.Option(help="Accept non-official GSM8K files.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Write DIR/gsm8k.yaml for lm-eval's own CLI: lm-eval's gsm8k task (v3) with the dataset pointed
    at local GSM8K files, the same task `plamo2-tools eval` runs.  Then:
    plamo2-tools lm-eval run --model plamo2 --model_args pretrained=SHARDS --tasks gsm8k --include_path DIR
    """
    from .eval.gsm8k_task import load_gsm8k_data, write_task_yaml

    check_output_dir(out_dir, "DIR")
    data = load_gsm8k_data(gsm8k_dir, allow_unverified=allow_unverified_data)
    path = write_task_yaml(data, out_dir)
    if as_json:
        print_json({"path": str(path), "data": data.to_dict()})
    else:
        out.print(f"wrote {path}; use it with --tasks gsm8k --include_path {out_dir}", highlight=False, markup=False)


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

    Our files are recognised by their "kind" and "schema_version", lm-eval's results by their
    structure; anything else (or a version this plamo2-tools does not read) is skipped with a
    note.  Exit 2 when nothing usable is found.  The page is deterministic except its 'generated' line (--no-timestamp).
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


# ---- tokenize ----------------------------------------------------------------------------------
@app.command()
@handle_errors
def tokenize(
    path: Annotated[Path, typer.Argument(help="A checkpoint or shard directory.")],
    input_file: Annotated[
        Path | None, typer.Option("--input", help="Read this file instead of stdin: one JSON string per line.")
    ] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write this file instead of stdout.")] = None,
    decode: Annotated[bool, typer.Option("--decode", help="The reverse: JSON id arrays in, JSON strings out.")] = False,
    skip_special_tokens: Annotated[bool, typer.Option(help="With --decode: leave BOS/EOS/pad/unk out.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Run the checkpoint's own tokenizer code instead of the native PLaMo tokenizer.")
    ] = False,
) -> None:
    """Token ids of texts with the directory's tokenizer: one JSON string per input line, one JSON
    array of ids per output line (tokenizer(text)["input_ids"], so BOS as add_bos_token says).

    A directory with PLaMo's tokenizer.jsonl is read natively (no remote code, no numba); remote
    code runs only with --trust-remote-code.  Blank lines are skipped.  Exit 2 on bad input.
    """
    from .tokenizer.cli_io import run_tokenize

    run_tokenize(path, input_file, out_file, decode, skip_special_tokens, trust_remote_code)


if __name__ == "__main__":  # pragma: no cover
    app()
