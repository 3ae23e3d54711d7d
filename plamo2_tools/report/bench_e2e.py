"""The README's commands from the shell (`python -m bench e2e`, kind plamo2-bench-e2e): per step, the
wall time of the fresh pass (empty caches) and the median of the warm ones, from each source tree
measured, with the ratio to the first tree and to a bare interpreter of the same run."""

from __future__ import annotations

import statistics
from typing import Any

from .bench import payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, nbytes, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## The README's commands from the shell", ""]
    for doc in docs:
        d = payload(doc)
        records = [r for r in d["records"] if isinstance(r, dict) and isinstance(r.get("step"), str)]
        trees = list(dict.fromkeys(str(r.get("tree")) for r in records))
        lines += [f"### {code(doc.name)}", "", *run_line(doc)]
        if len(trees) > 1 and isinstance(d.get("trees"), dict):
            lines += ["Source trees: " + ", ".join(f"{t} = {code(str(d['trees'].get(t, '?')))}" for t in trees), ""]
        lines += table(_headers(trees), _rows(records, trees), right=range(1, 1 + 2 * len(trees) + 2)) + [""]
        failed = [r for r in records if r.get("rc") != 0]
        for r in failed[:5]:
            ctx.warn(
                f"e2e {code(doc.name)}: `{r['step']}` ({r.get('tree')}, pass {r.get('pass')}) exited {r.get('rc')}"
            )
        commands = d.get("commands") if isinstance(d.get("commands"), dict) else {}
        if commands:
            lines += ["Commands (OUT: a fresh path per run):", ""]
            lines += [f"- `{step}`: {code(str(cmd))}" for step, cmd in commands.items()] + [""]
    return lines


def _headers(trees: list[str]) -> list[str]:
    heads = ["step"]
    for t in trees:
        suffix = f" ({t})" if len(trees) > 1 else ""
        heads += [f"fresh s{suffix}", f"warm s{suffix}"]
    heads += [f"warm {trees[-1]} / {trees[0]}" if len(trees) > 1 else "warm / python", "peak RSS"]
    return heads


def _rows(records: list[dict[str, Any]], trees: list[str]) -> list[list[Any]]:
    rows = []
    python = _warm([r for r in records if r["step"] == "python" and r.get("tree") == trees[0]])
    for step in dict.fromkeys(r["step"] for r in records):
        row: list[Any] = [step]
        warm: dict[str, float | None] = {}
        for t in trees:
            mine = [r for r in records if r["step"] == step and r.get("tree") == t]
            fresh = next((r["wall_s"] for r in mine if r.get("fresh") and is_number(r.get("wall_s"))), None)
            warm[t] = _warm(mine)
            bad = any(r.get("rc") != 0 for r in mine)
            row += [_s(fresh) + (" ✗" if bad else ""), _s(warm[t]) + (f" ({_n(mine)})" if _n(mine) > 1 else "")]
        a, b = warm[trees[-1]], warm[trees[0]] if len(trees) > 1 else python
        row.append(f"{a / b:.2f}×" if is_number(a) and is_number(b) and b else MISSING)
        peaks = [r["peak_rss_bytes"] for r in records if r["step"] == step and is_number(r.get("peak_rss_bytes"))]
        row.append(nbytes(max(peaks)) if peaks else MISSING)
        rows.append(row)
    return rows


def _warm(records: list[dict[str, Any]]) -> float | None:
    walls = [r["wall_s"] for r in records if not r.get("fresh") and is_number(r.get("wall_s"))]
    return statistics.median(walls) if walls else None


def _n(records: list[dict[str, Any]]) -> int:
    return sum(1 for r in records if not r.get("fresh"))


def _s(value: float | None) -> str:
    return f"{value:,.2f}" if is_number(value) else MISSING
