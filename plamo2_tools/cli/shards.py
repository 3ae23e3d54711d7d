"""Commands that write or check shard directories: `convert` (also reshards shards), `merge`, `check`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

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
            src, out_dir, tp=tp, pp=pp, pp_layers=int_list(pp_layers, "--pp-layers"), dtype=dtype,
            max_part_size=parse_size(max_part_size), force=force, progress=progress,
            on_plan=lambda plan: progress.start(plan.payload_bytes), copy=copy, workers=workers,
            verify_blobs=verify_blobs, sync=sync,
        )  # fmt: skip
    summary = result.summary()
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"{result.status}: {out_dir}")
    for col in ("rank", "tp", "pp", "layers", "files", "tensors", "bytes"):
        table.add_column(col, justify="right" if col != "layers" else "left")
    for r in summary["ranks"]:
        table.add_row(str(r["rank"]), str(r["tp_rank"]), str(r["pp_rank"]), r["layers"], str(r["files"]),
                      str(r["tensors"]), f"{r['bytes']:,}")  # fmt: skip
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


def check(
    path: Annotated[Path, typer.Argument(help="A shard directory made by `plamo2-tools convert`.")],
    as_json: Json = False,
) -> None:
    """Verify a shard directory without running the model: files, sizes and digests, headers and
    metadata, tensor digests, replicas, vocab padding and source coverage.  Exit 1 on a problem."""
    from ..shards.check import check_shards
    from ..shards.manifest import load_manifest

    total = sum(f.size for f in load_manifest(path).files.values())
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
