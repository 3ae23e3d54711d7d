"""Deterministic PNG plots with matplotlib's object API on the Agg canvas.

No pyplot: it keeps global figure state and picks a GUI backend from the environment.  The style
is reset to matplotlib's defaults for every figure, so a user's matplotlibrc cannot change the
bytes, and the PNG carries no "Software" metadata, so the same data gives the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DPI = 100
PASS_COLOR = "#2e7d32"
FAIL_COLOR = "#c62828"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


@contextmanager
def figure(path: Path, width: float = 8.0, height: float = 3.6, rows: int = 1) -> Iterator[list[Any]]:
    """Yield `rows` stacked axes; on exit lay them out and save the PNG at `path`."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with (
        matplotlib.style.context("default"),
        matplotlib.rc_context({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.axisbelow": True}),
    ):
        fig = Figure(figsize=(width, height * rows), dpi=DPI)
        FigureCanvasAgg(fig)
        axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})


def log_floor(values: list[float]) -> float:
    """Where to draw exact zeros on a log axis: a decade below the smallest positive value."""
    positive = [v for v in values if v > 0]
    return min(positive) / 10 if positive else 1e-12
