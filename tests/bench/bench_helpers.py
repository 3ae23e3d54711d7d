"""Running the benchmark suite the way a user does: `python -m bench ...` from the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def bench(
    *args: object, expect: int | None = 0, module: str = "bench", timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect is not None:
        assert proc.returncode == expect, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc


def run_json(name: str, *args: object, out: Path) -> dict:
    """`python -m bench NAME ARGS --out OUT`, and the file it wrote."""
    bench(name, *args, "--out", out)
    return json.loads(out.read_text())


def rendered(cli, path: Path) -> str:  # type: ignore[no-untyped-def]
    """The Markdown `plamo2-tools report PATH` writes (through the real command)."""
    report = path.with_suffix(".md")
    cli("report", path, "--out", report)
    return report.read_text()
