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
from rich.markup import escape
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
        return (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )

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
        return (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )


@contextmanager
def step_progress(description: str, total: int, enabled: bool = True) -> Iterator[StepProgress]:
    progress = StepProgress(description, enabled)
    progress.start(total)
    try:
        yield progress
    finally:
        progress.stop()


class RequestProgress:
    """The bar of a batch file: requests finished of those to run, generated tokens per second
    (on stderr, rank 0's only).  A context manager; `warn` prints a line above the bar."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Progress | None = None
        self.task: Any = None
        self.tokens = 0
        self.t0 = 0.0

    def __enter__(self) -> RequestProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, todo: int, done: int) -> None:
        import time

        if done:
            err.print(f"resuming: {done} requests already done", highlight=False)
        if not self.enabled or not todo:
            return
        self.t0 = time.perf_counter()
        self.bar = Progress(
            TextColumn("generate"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err,
        )
        self.bar.start()
        self.task = self.bar.add_task("generate", total=todo, rate="")

    def result(self, record: dict[str, Any]) -> None:
        import time

        self.tokens += int(record.get("usage", {}).get("completion_tokens", 0))
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, advance=1, rate=f"{rate:,.1f} tokens/s")

    def warn(self, line: str) -> None:
        (self.bar.console if self.bar is not None else err).print(
            f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True
        )
