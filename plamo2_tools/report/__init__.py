"""`plamo2-tools report`: one Markdown page (with PNG plots beside it) from the JSON that the
other steps leave behind: lm-eval results, verify results, the benchmarks of `python -m bench`
(bench/, docs/benchmarks.md), the checks kept beside them, and the --json output of convert /
check / inspect.

Our inputs are recognised by their "kind" and "schema_version", lm-eval's by its own structure
(see inputs.py); the output is deterministic (sorted inputs, fixed figure sizes, no timestamps but
the optional "generated" line), so a report can be committed and diffed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import EnvironmentLimitError, UserError
from ..safe_files import create_fresh, write_all
from ..version import __version__
from . import (
    bench_accuracy,
    bench_convert,
    bench_e2e,
    bench_kernels,
    bench_serving,
    bench_startup,
    bench_throughput,
    checks,
    exports,
    lmeval,
    tools,
    verify,
)
from .context import Context
from .inputs import (
    BENCH_ACCURACY,
    BENCH_CONVERT,
    BENCH_E2E,
    BENCH_EXPORT_FP8,
    BENCH_EXPORT_GGUF,
    BENCH_EXPORT_MLX,
    BENCH_FUZZ,
    BENCH_KERNELS,
    BENCH_SERVING,
    BENCH_STARTUP,
    BENCH_THROUGHPUT,
    BENCH_TOKENIZER,
    CHECK,
    CONVERT,
    EXPORT_FP8,
    EXPORT_GGUF,
    EXPORT_MLX,
    INSPECT,
    KILL_RESUME,
    KINDS,
    LMEVAL,
    MUTANTS,
    VERIFY,
    VLLM_COMPAT,
    VLLM_FORWARD,
    Doc,
    Skipped,
    collect,
)
from .markdown import code, table

__all__ = ["KINDS", "ReportResult", "build_report"]

Renderer = Callable[[list[Doc], Context], list[str]]
# (kinds it shows, title in the overview, renderer), in page order.
SECTIONS: list[tuple[tuple[str, ...], str, Renderer]] = [
    ((LMEVAL,), "lm-eval results", lmeval.render),
    ((VERIFY,), "Verify", verify.render),
    ((BENCH_CONVERT,), "Convert benchmark", bench_convert.render),
    ((BENCH_KERNELS,), "Kernel benchmark", bench_kernels.render),
    ((BENCH_THROUGHPUT,), "Runtime throughput", bench_throughput.render),
    ((BENCH_SERVING,), "Server under load", bench_serving.render),
    ((BENCH_ACCURACY,), "GSM8K offline", bench_accuracy.render),
    ((BENCH_E2E,), "The README's commands from the shell", bench_e2e.render),
    ((BENCH_STARTUP,), "Start-up and one-time costs", bench_startup.render),
    (
        (VLLM_COMPAT, VLLM_FORWARD, BENCH_TOKENIZER, KILL_RESUME, BENCH_FUZZ, MUTANTS),
        "Compatibility and robustness",
        checks.render,
    ),
    (
        (EXPORT_MLX, EXPORT_FP8, EXPORT_GGUF, BENCH_EXPORT_MLX, BENCH_EXPORT_FP8, BENCH_EXPORT_GGUF),
        "Exports",
        exports.render,
    ),
    ((CONVERT, CHECK, INSPECT), "Tool output", tools.render),
]


@dataclass(frozen=True)
class ReportResult:
    out: Path
    plots: list[Path]
    docs: list[Doc]
    skipped: list[Skipped]
    warnings: list[str]

    def summary(self) -> dict[str, Any]:
        """What --json prints: sections found, files read, outputs written."""
        return {
            "out": str(self.out),
            "sections": {kind: n for kind in KINDS if (n := sum(d.kind == kind for d in self.docs))},
            "files": [{"path": d.name, "kind": d.kind} for d in self.docs],
            "skipped": [{"path": s.name, "reason": s.reason} for s in self.skipped],
            "outputs": [str(self.out)] + [str(p) for p in self.plots],
            "warnings": self.warnings,
        }


def build_report(
    inputs: Iterable[Path], out: Path, title: str | None = None, timestamp: bool = True, now: datetime | None = None
) -> ReportResult:
    inputs = list(inputs)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the Markdown file, e.g. {out / 'report.md'}")
    docs, skipped = collect(inputs)
    if not docs:
        where = ", ".join(str(p) for p in inputs)
        first = f" ({skipped[0].name}: {skipped[0].reason})" if skipped else ""
        raise UserError(
            f"nothing usable in {where}: {len(skipped)} JSON file(s) found, none is lm-eval results, verify, "
            f"benchmark or convert/check/inspect output{first}"
        )
    docs, malformed = _renderable(docs)
    skipped = skipped + malformed
    if not docs:
        where = ", ".join(map(str, inputs))
        raise UserError(f"nothing usable in {where}: every result file is malformed ({malformed[0].reason})")
    ctx = Context(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        body = _sections(docs, ctx)
        head = _head(title or f"Report: {out.stem}", docs, ctx, timestamp, now)
        _write_text(out, "\n".join(head + body + _inputs(docs, skipped)).rstrip("\n") + "\n")
    except OSError as e:
        raise EnvironmentLimitError(f"cannot write the report to {out}: {e.strerror or e}") from None
    return ReportResult(out, list(ctx.plots), docs, skipped, list(ctx.warnings))


# What a renderer raises on a file whose kind and version are right but whose fields are not
# (a string where a number goes, a list where an object goes): the file is skipped, not a crash.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError)


def _renderable(docs: list[Doc]) -> tuple[list[Doc], list[Skipped]]:
    """Render each file alone first (plots into a scratch directory): one that a renderer cannot
    read is skipped with its reason, so one wrong-typed field costs that file, not the report."""
    good, bad = [], []
    with tempfile.TemporaryDirectory(prefix="plamo2-report-") as scratch:
        for doc in docs:
            try:
                _sections([doc], Context(Path(scratch) / "trial.md"))
            except MALFORMED as e:
                bad.append(Skipped(doc.name, f"malformed {doc.kind} file ({type(e).__name__}: {e})"))
            else:
                good.append(doc)
    return good, bad


def _sections(docs: list[Doc], ctx: Context) -> list[str]:
    lines: list[str] = []
    for kinds, _, render in SECTIONS:
        chosen = [d for d in docs if d.kind in kinds]
        if chosen:
            lines += render(chosen, ctx)
    return lines


def _head(title: str, docs: list[Doc], ctx: Context, timestamp: bool, now: datetime | None) -> list[str]:
    lines = [f"# {title}", ""]
    if timestamp:
        when = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M:%S UTC")
        lines += [f"_Generated {when} by plamo2-tools {__version__}._", ""]
    rows = [
        [name, str(sum(d.kind in kinds for d in docs))]
        for kinds, name, _ in SECTIONS
        if any(d.kind in kinds for d in docs)
    ]
    lines += table(["Section", "Files"], rows, right=(1,)) + [""]
    if ctx.warnings:
        lines += ["**Warnings**", ""] + [f"- {w}" for w in ctx.warnings] + [""]
    return lines


def _inputs(docs: Sequence[Doc], skipped: Sequence[Skipped]) -> list[str]:
    lines = ["## Inputs", ""] + table(["File", "Read as"], [[code(d.name), d.kind] for d in docs])
    if skipped:
        lines += ["", "Skipped:", ""] + table(["File", "Reason"], [[code(s.name), s.reason] for s in skipped])
    return lines + [""]


def _write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a failed run never leaves half a report."""
    tmp = path.with_name(f".{path.name}.partial")
    fd = create_fresh(tmp, os.O_WRONLY)  # never written through a link planted at that name
    try:
        write_all(fd, text.encode("utf-8"), tmp)
    finally:
        os.close(fd)
    os.replace(tmp, path)
