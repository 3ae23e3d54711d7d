"""Where commands print: results on stdout (`out`, or JSON with `print_json`), everything else
on stderr (`err`), and the progress bars of long work (bytes or steps, on stderr)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

# Piped output (CI logs, files) gets wide tables instead of Rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


class ByteProgress:
    """A Rich bytes-and-rate progress bar on stderr; callable with a byte count.  The total may
    come later (convert knows it once its plan exists): call `start(total)` then.  The bar appears
    with the first bytes, so that a refusal during the checks before any work stays the only line
    on stderr."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.description, self.enabled = description, enabled
        self.bar: Progress | None = None
        self.task: Any = None
        self.total: int | None = None
        self._lock = threading.Lock()  # convert reports from several threads

    def columns(self) -> tuple[Any, ...]:
        return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn())  # fmt: skip

    def start(self, total: int) -> None:
        self.total = total

    def __call__(self, n: int) -> None:
        if not self.enabled or self.total is None:
            return
        if self.bar is None:
            with self._lock:
                if self.bar is None:
                    bar = Progress(*self.columns(), console=err)
                    bar.start()
                    self.task = bar.add_task(self.description, total=self.total)
                    self.bar = bar
        self.bar.advance(self.task, n)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def byte_progress(description: str, total: int | None = None, enabled: bool = True) -> Iterator[ByteProgress]:
    progress = ByteProgress(description, enabled)
    if total is not None:
        progress.start(total)
    try:
        yield progress
    finally:
        progress.stop()


class StepProgress(ByteProgress):
    """The same bar counting steps (tokens, forwards) instead of bytes."""

    def columns(self) -> tuple[Any, ...]:
        return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn())  # fmt: skip


@contextmanager
def step_progress(description: str, total: int, enabled: bool = True) -> Iterator[StepProgress]:
    progress = StepProgress(description, enabled)
    progress.start(total)
    try:
        yield progress
    finally:
        progress.stop()
