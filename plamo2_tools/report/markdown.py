"""Plain GitHub-flavoured Markdown building blocks and number formatting shared by the sections."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MISSING = "—"  # shown where an input has no value; an empty cell reads like a rendering bug


def cell(value: Any) -> str:
    """One table cell: pipes escaped (GFM honours `\\|` even inside code spans) and line breaks
    flattened, so a value cannot break the table; None shows as MISSING, "" stays empty."""
    text = MISSING if value is None else str(value)
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> list[str]:
    """A GFM table; columns whose index is in `right` are right-aligned (numbers)."""
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def code(text: Any) -> str:
    """Inline code; a backtick inside would end the span early, so it is swapped for a quote."""
    return "`" + str(text).replace("`", "'") + "`"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def num(value: Any, spec: str = ".4f") -> str:
    """A float with `spec`; integers as they are; strings (lm-eval's "N/A") pass through."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        return format(value, spec) if math.isfinite(value) else str(value)
    return str(value)


def sci(value: Any) -> str:
    """Small errors (1e-7 .. 1e-2) read best in scientific notation; exact zero stays 0."""
    if is_number(value) and value == 0:
        return "0"
    return num(value, ".2e")


def nbytes(value: Any) -> str:
    """Decimal units like the rest of the CLI (GB = 1e9 bytes)."""
    if not is_number(value):
        return num(value)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3f} {unit}" if unit == "GB" else f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def seconds(value: Any) -> str:
    if not is_number(value):
        return num(value)
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def ratio(value: Any) -> str:
    return num(value, ".2f") + "×" if is_number(value) else num(value)


def yes_no(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return num(value)


def pretty(key: str, value: Any) -> str:
    """Format a value from a loosely known schema by what its key name says it is."""
    k = key.lower()
    if isinstance(value, bool):
        return yes_no(value)
    if is_number(value):
        if k.endswith("bytes") or k.endswith("_bytes"):
            return f"{nbytes(value)} ({int(value):,} B)"
        if k.endswith(("_s", "seconds", "_sec")):
            return seconds(value)
        if isinstance(value, float):
            return f"{value:.4g}"
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(pretty(key, v) for v in value)
    return num(value)


def flatten(data: Any, prefix: str = "", limit: int = 200) -> list[tuple[str, Any]]:
    """Scalar leaves of nested JSON as (dotted.key, value), in document order, at most `limit`."""
    found: list[tuple[str, Any]] = []

    def walk(value: Any, key: str) -> None:
        if len(found) >= limit:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        else:
            found.append((key, value))

    walk(data, prefix)
    return found
