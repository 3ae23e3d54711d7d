"""What every section renderer gets: where the report goes, how to name and link its plots, and
where to put warnings that belong at the top of the report."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Context:
    out: Path  # the Markdown file; plots go beside it as <stem>-<what>.png
    warnings: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    def plot_path(self, what: str) -> Path:
        """A fresh PNG path: NAME-what.png, then NAME-what-2.png, ... for repeated sections."""
        base = f"{self.out.stem}-{what}"
        taken = {p.name for p in self.plots}
        n = 1
        name = f"{base}.png"
        while name in taken:
            n += 1
            name = f"{base}-{n}.png"
        path = self.out.parent / name
        self.plots.append(path)
        return path

    def image(self, path: Path, alt: str) -> str:
        """A relative image link, so the report directory can be moved or published as a whole."""
        rel = Path(os.path.relpath(path, self.out.parent)).as_posix()
        return f"![{alt}]({rel})"

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)
