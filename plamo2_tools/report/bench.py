"""What every benchmark file says about its run, whatever the benchmark: the suite's envelope
(`python -m bench NAME`, bench/common.py, schema version 2) or, for the files made before the suite
(version 1), what each script wrote at its top level.

Renderers read a benchmark's own numbers through `payload` (the envelope's `results`, or a version-1
file itself) and head each file with `run_line`: card, commit, start, wall, completeness, command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..kinds import BENCH_SCHEMA_VERSION
from .inputs import Doc
from .markdown import code, is_number


@dataclass(frozen=True)
class BenchRun:
    """The envelope of one benchmark file (missing facts of a version-1 file are None)."""

    machine: dict[str, Any]
    commit: str | None = None
    dirty: bool | None = None
    command: str | None = None
    started_at: str | None = None
    wall_s: float | None = None
    complete: bool = True
    skipped: list[str] = field(default_factory=list)
    error: str | None = None
    label: str = ""
    note: str = ""


def is_suite(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema_version") == BENCH_SCHEMA_VERSION and "results" in data


def payload(doc: Doc) -> Any:
    """The benchmark's own numbers: the envelope's `results`, or a version-1 file as it is."""
    return doc.data["results"] if is_suite(doc.data) else doc.data


def bench_run(doc: Doc) -> BenchRun:
    d = doc.data
    if is_suite(d):
        return BenchRun(
            machine=d["machine"] if isinstance(d.get("machine"), dict) else {},
            commit=_text(d.get("commit")),
            dirty=d.get("dirty") if isinstance(d.get("dirty"), bool) else None,
            command=_text(d.get("command")),
            started_at=_text(d.get("started_at")),
            wall_s=d.get("wall_s") if is_number(d.get("wall_s")) else None,
            complete=d.get("complete") is True,
            skipped=[str(s) for s in d.get("skipped") or [] if isinstance(s, str)],
            error=_text(d.get("error")),
            label=_text(d.get("label")) or "",
            note=_text(d.get("note")) or "",
        )
    if not isinstance(d, dict):  # a version-1 kernels stream: records only
        return BenchRun(machine={})
    machine = dict(d["machine"]) if isinstance(d.get("machine"), dict) else {}
    card = d.get("gpu") or d.get("device")
    if isinstance(card, str):
        machine.setdefault("card", card)
    return BenchRun(
        machine=machine,
        command=_text(d.get("command")),
        complete=d.get("complete", True) is not False,
        label=_text(d.get("label")) or "",
        note=_text(d.get("note")) or "",
    )


def run_line(doc: Doc) -> list[str]:
    """One line under a benchmark file's heading: where and when it ran, and whether it finished."""
    run = bench_run(doc)
    parts = [f"**{run.label}**"] if run.label else []
    card, cpus = run.machine.get("card"), run.machine.get("cpus")
    if card:
        n = run.machine.get("cards")
        parts.append(f"{n}× {card}" if isinstance(n, int) and n > 1 else str(card))
    if is_number(cpus):
        parts.append(f"{cpus} CPUs")
    if run.commit:
        parts.append(f"commit {code(run.commit[:10])}" + (" + local changes" if run.dirty else ""))
    if run.started_at:
        parts.append(f"started {run.started_at}")
    if run.wall_s is not None:
        parts.append(f"{run.wall_s:,.0f} s")
    if run.error:
        parts.append(f"**stopped by an error**: {run.error[:200]}")
    elif not run.complete:
        parts.append("**incomplete**" + (f" (skipped: {', '.join(run.skipped[:6])})" if run.skipped else ""))
    lines = [" · ".join(parts), ""] if parts else []
    if run.command:
        lines += [f"Command: {code(run.command)}", ""]
    if run.note:
        lines += [f"_{run.note}_", ""]
    return lines


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
