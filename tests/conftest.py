"""Shared pytest setup: Triton's CPU interpreter and skipping ``gpu`` tests without a GPU.

(The ``gpu`` marker itself is registered in pyproject.toml.)
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


Cli = Callable[..., Result]


@pytest.fixture(scope="session")
def cli() -> Cli:
    """Run `plamo2-tools ARGS` in-process; stdout and stderr are kept apart, and an uncaught
    exception (a traceback a user would see) fails the test whatever the exit code."""
    from plamo2_tools.cli import app

    runner = CliRunner()

    def run(*args: str | Path, expect: int | None = 0) -> Result:
        result = runner.invoke(app, [str(a) for a in args])
        crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
        if crashed or (expect is not None and result.exit_code != expect):
            raise AssertionError(
                f"plamo2-tools {' '.join(map(str, args))}: exit {result.exit_code}, expected {expect}"
                f"{' (uncaught exception)' if crashed else ''}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}\nexception: {result.exception!r}"
            )
        return result

    return run


OneLineError = Callable[..., str]


@pytest.fixture(scope="session")
def one_line_error() -> OneLineError:
    """The contract of every refusal (issue 14): the expected exit code, exactly one non-empty line
    on stderr starting with `error:` (or `prefix`), no traceback anywhere.  Returns the line.
    Takes a CliRunner result or a subprocess.CompletedProcess (text mode)."""

    def check(r: Any, code: int, prefix: str = "error:") -> str:
        exit_code = getattr(r, "exit_code", getattr(r, "returncode", None))
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert exit_code == code, f"exit {exit_code}, expected {code}\nstderr: {r.stderr}\nstdout: {r.stdout}"
        assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.stderr}"
        assert lines[0].startswith(prefix), lines[0]
        assert "Traceback" not in r.stderr + r.stdout
        return lines[0]

    return check
