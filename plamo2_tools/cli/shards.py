"""Commands that write or check shard directories: `convert` (also reshards shards), `merge`, `check`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import CheckFailed
from .console import byte_progress, out, print_json
from .options import Force, Json, MaxPartSize
from .validators import int_list


def convert(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a shard directory made by this tool.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size.")] = 1,
    dtype: Annotated[str, typer.Option(help="auto (keep), bfloat16, float16 or float32.")] = "auto",
    pp_layers: Annotated[
        str | None, typer.Option(help="Layers per stage, e.g. 5,6,5 (like VLLM_PP_LAYER_PARTITION).")
    ] = None,
    max_part_size: MaxPartSize = "5GiB",
    force: Force = False,
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
    sync: Annotated[
        str,
        typer.Option(
            help="When the data is made durable: end (every file fsync'd in parallel before the manifest), file "
            "(each file before its journal record) or none (never: a power cut can lose a checkpoint that has a "
            "manifest; for measuring)."
        ),
    ] = "end",  # convert.engine.DEFAULT_SYNC (not imported here: --help stays light; a test keeps them equal)
    as_json: Json = False,
) -> None:
    """Reshard a PLaMo checkpoint into TP x PP shard files laid out as vLLM's model class holds
    them per rank (files model-rank-{r}-part-{n}.safetensors, r = pp_rank * tp + tp_rank).

    Copies in the kernel where bytes are verbatim, on all cores, with bounded memory; records an
    XXH3-128 digest of every file and tensor; writes the manifest plamo2_shards.json last, and
    resumes an interrupted run.
    """
    from ..convert.engine import convert as run
    from ..convert.plan import parse_size

    with byte_progress(f"convert tp={tp} pp={pp}", enabled=not as_json) as progress:
        result = run(
            src,
            out_dir,
            tp=tp,
            pp=pp,
            pp_layers=int_list(pp_layers, "--pp-layers"),
            dtype=dtype,
            max_part_size=parse_size(max_part_size),
            force=force,
            progress=progress,
            on_plan=lambda plan: progress.start(plan.payload_bytes),
            copy=copy,
            workers=workers,
            verify_blobs=verify_blobs,
            sync=sync,
        )
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


def merge(
    shards: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert`.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Where to write the HF checkpoint.")],
    max_part_size: MaxPartSize = "5GiB",
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Rebuild the Hugging Face checkpoint from shards (the inverse of convert).

    Resharded tensors come back byte-identical; A and the offset norms within the rounding of their
    transform; a dtype cast made by convert is kept (precision cannot come back).
    """
    from ..convert.merge import merge as run
    from ..convert.merge import merged_bytes
    from ..convert.plan import parse_size

    limit = parse_size(max_part_size)
    start = time.perf_counter()
    with byte_progress(f"merge {shards}", merged_bytes(shards), enabled=not as_json) as progress:
        names = run(shards, out_dir, max_part_size=limit, force=force, progress=progress)
    result = {
        "out": str(out_dir),
        "files": names,
        "bytes": sum((out_dir / n).stat().st_size for n in names),
        "seconds": time.perf_counter() - start,
    }
    if as_json:
        print_json(result)
    else:
        out.print(
            f"merged {shards} into {out_dir}: {len(names)} file(s), {result['bytes'] / 1e9:.3f} GB "
            f"in {result['seconds']:.2f} s",
            highlight=False,
        )


def check(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="A shard directory made by `plamo2-tools convert`, a GGUF file made by `export gguf`, "
            "or an `export mlx` / `export fp8` directory.",
        ),
    ],
    source: Annotated[
        Path | None,
        typer.Option(
            help="Also re-derive every tensor of every rank from this HF checkpoint (the one converted) and "
            "compare the bytes: catches a writer bug that the recorded digests cannot."
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """Verify a shard directory without running the model: files, sizes and digests, headers and
    metadata, tensor digests, replicas, vocab padding and source coverage; with --source, also every
    tensor against the source checkpoint.  A .gguf file or an `export mlx` / `export fp8` directory (with
    --source): every tensor re-derived from the checkpoint, quantized ones by quantizing again, and every
    key or the config.  Exit 1 on a problem."""
    from ..export.side import export_format

    if path.suffix.lower() == ".gguf":
        return _check_gguf(path, source, as_json)
    if export_format(path) is not None:
        return _check_export(path, source, as_json)
    if source is not None:
        from ..shards.source_check import source_files

        source_files(source)  # a wrong --source is refused before the long structural pass
    structure = _check_structure(path, as_json)
    against = _check_source(path, source, as_json) if source is not None else None
    if as_json:
        if against is None:
            print_json(structure.to_dict())
        else:
            print_json({**against.to_dict(), "ok": structure.ok and against.ok, "structure": structure.to_dict()})
    failures = []
    if not structure.ok:
        failed = [name for name, found in structure.checks.items() if found]
        failures.append(f"{sum(len(v) for v in structure.checks.values())} problem(s) in: {', '.join(failed)}")
    if against is not None and not against.ok:
        failures.append(f"{len(against.problems)} problem(s) against {source}; first: {against.problems[0]}")
    if failures:
        raise CheckFailed(f"{path}: {'; '.join(failures)}")
    if not as_json:
        out.print(f"[green]ok[/]: {path} is complete and matches its manifest", highlight=False)
        if against is not None:
            out.print(f"[green]ok[/]: all {against.tensors} tensors match {source}", highlight=False)


def _check_gguf(path: Path, source: Path | None, as_json: bool) -> None:
    from ..errors import UserError
    from ..export.gguf_check import check_gguf

    if source is None:
        raise UserError(f"{path}: checking a GGUF file needs --source (the checkpoint it was exported from)")
    report = check_gguf(path, source)
    if as_json:
        print_json(report.to_dict())
    if not report.ok:
        raise CheckFailed(f"{path}: {len(report.problems)} problem(s) against {source}; first: {report.problems[0]}")
    if not as_json:
        skipped = (
            f" ({len(report.not_rederived)} quantized by llama-quantize not re-derived)" if report.not_rederived else ""
        )
        what = f"all {report.tensors} tensors and {report.keys} keys of {path}"
        out.print(f"[green]ok[/]: {what} match {source}{skipped}", highlight=False)


def _check_structure(path: Path, as_json: bool) -> Any:
    from ..shards.manifest import load_manifest

    total = sum(f.size for f in load_manifest(path).files.values())  # a directory with none: refused here
    from ..shards.check import check_shards  # numpy, the model's tables: after that refusal

    with byte_progress(f"check {path}", total, enabled=not as_json) as progress:
        report = check_shards(path, progress=progress)
    if not as_json:
        table = Table(title=f"check: {path}")
        table.add_column("check")
        table.add_column("result")
        for name, found in report.checks.items():
            table.add_row(name, "[green]ok[/]" if not found else f"[red]{len(found)} problem(s)[/]")
        out.print(table)
        for name, found in report.checks.items():
            for line in found:
                out.print(f"  [red]{name}[/]: {line}", highlight=False)
    return report


def _check_source(path: Path, source: Path, as_json: bool) -> Any:
    from ..shards.manifest import load_manifest
    from ..shards.source_check import check_against_source

    m = load_manifest(path)
    total = sum(e.tensor.nbytes for entries in m.entries.values() for e in entries.values())
    with byte_progress(f"check {path} against {source}", total, enabled=not as_json) as progress:
        report = check_against_source(path, source, progress=progress)
    if not as_json:
        for line in report.problems[:20]:
            out.print(f"  [red]source[/]: {line}", highlight=False)
        if len(report.problems) > 20:
            out.print(f"  ... and {len(report.problems) - 20} more", highlight=False)
    return report


def _check_export(path: Path, source: Path | None, as_json: bool) -> None:
    from ..errors import UserError
    from ..export.check import check_export

    if source is None:
        raise UserError(f"{path}: checking an export needs --source (the checkpoint it was exported from)")
    report = check_export(path, source)
    if as_json:
        print_json(report.to_dict())
    if not report.ok:
        raise CheckFailed(f"{path}: {len(report.problems)} problem(s) against {source}; first: {report.problems[0]}")
    if not as_json:
        out.print(
            f"[green]ok[/]: all {report.tensors} tensors and the config of {path} match {source}", highlight=False
        )
        out.print(f"  independently: {report.independent}", highlight=False)
