"""The README's "A tour" runs as written (issue 21, class 8): its bash block is read from
README.md and run by bash with `set -e` in an empty directory, `plamo2-tools` on PATH (a shim for
this checkout), every step checked for exit 0 and the words the README puts beside it."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tour_block() -> str:
    """The first ```bash block under the "## A tour" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found, "README.md: no bash block under ## A tour"
    return found.group(1)


def test_the_tour_block_is_what_the_readme_says() -> None:
    block = tour_block()
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands[0].startswith("plamo2-tools synth ckpt --preset tiny-gqa")
    assert commands[-1] == "plamo2-tools report runs/ --out reports/run.md"
    assert any("--output runs/" in c for c in commands), "something in the tour must write what `report` reads"


@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "plamo2-tools"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m plamo2_tools.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "tour"
    work.mkdir()
    env = dict(
        os.environ,
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        COLUMNS="200",
        NO_COLOR="1",
        TRITON_INTERPRET="1",
    )
    script = "set -e -o pipefail\n" + "".join(
        f"echo '>>> {line.split('#')[0].strip()}'\n{line}\n" for line in tour_block().splitlines() if line.strip()
    )
    start = time.monotonic()
    r = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=400)
    seconds = time.monotonic() - start
    assert r.returncode == 0, f"the tour stopped:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stdout + r.stderr
    out = r.stdout
    assert "ok: shards is complete and matches its manifest" in out
    assert "pass" in out.split(">>> plamo2-tools verify")[1].split(">>>")[0]
    generated = out.split(">>> plamo2-tools generate")[1].split(">>>")[0]
    assert "64 tokens" in generated + r.stderr  # the README: 64 random tokens
    assert (work / "ckpt-again" / "config.json").is_file() and (work / "shards-tp4" / "plamo2_shards.json").is_file()
    report = (work / "reports" / "run.md").read_text()
    assert "Verify" in report and "`runs/verify.json` | verify" in report
    assert seconds < 200, f"the tour took {seconds:.0f} s; the README says about 40 s"
