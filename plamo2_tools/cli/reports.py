"""`report`: Markdown and plots from result JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from .console import err, out, print_json
from .options import Json


def report(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="Result files or directories (recursive).")],
    out_file: Annotated[Path, typer.Option("--out", help="Markdown to write (reports/NAME.md); plots: NAME-*.png.")],
    title: Annotated[str | None, typer.Option(help="Page title (default: Report: NAME).")] = None,
    timestamp: Annotated[bool, typer.Option("--timestamp/--no-timestamp", help="Write the 'generated' line.")] = True,
    as_json: Json = False,
) -> None:
    """Turn result JSON into one Markdown report with PNG plots beside it: lm-eval results (across
    TP x PP layouts, next to the published vLLM reference), verify results, convert and kernel
    benchmarks, and convert / check / inspect --json output.

    Our files are recognised by their "kind" and "schema_version", lm-eval's results by their
    structure; anything else (or a version this plamo2-tools does not read) is skipped with a
    note.  Exit 2 when nothing usable is found.  The page is deterministic except its 'generated' line (--no-timestamp).
    """
    from ..report import build_report

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
    out.print(
        f"wrote {out_file} and {len(result.plots)} plot(s) from {len(result.docs)} file(s){skipped}",
        highlight=False,
        markup=False,
    )
