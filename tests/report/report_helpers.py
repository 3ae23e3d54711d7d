"""Assertions shared by the report tests."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from typer.testing import Result

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Cli = Callable[..., Result]


def image_links(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of every table row (header and separator rows included), pipes escaped as \\| kept."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def assert_tables_well_formed(markdown: str) -> None:
    """Every row of a table has as many cells as its header (a stray | would break the layout)."""
    width = None
    for line in markdown.splitlines() + [""]:
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.split(r"(?<!\\)\|", line)) - 2
        width = cells if width is None else width
        assert cells == width, f"table row with {cells} cells, header has {width}: {line}"


def assert_png(path: Path, size: tuple[int, int] | None = None) -> None:
    """A real PNG that matplotlib can decode, optionally of exactly (width, height) pixels."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    pixels = matplotlib.image.imread(path)
    if size is not None:
        assert (pixels.shape[1], pixels.shape[0]) == size, f"{path}: {pixels.shape[1]}x{pixels.shape[0]} px"
