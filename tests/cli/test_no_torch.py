"""Commands that do not run the model never import PyTorch (issue 22): importing it costs seconds,
about as long as copying a 1B model.  Each command runs in a fresh interpreter that reports, as it
exits, whether `torch` is in `sys.modules`; a later import chain that brings torch back fails here.

The same runs see only the packages of `pip install plamo2-tools` alone: pyproject's base
dependencies and what they depend on (issue 29 item 8), linked into one directory that a `python -S`
interpreter reads instead of site-packages.  Seen failing with xxhash taken out of the base
dependencies (convert then finds no xxhash and stops).  tests/test_extras.py installs the base
for real, once, in a fresh venv."""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import atexit, os, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nTORCH-LOADED=%d\\n" % ("torch" in sys.modules)))
if os.environ.get("PLAMO_TEST_SITE"):  # run with -S: only the base install's packages, then ours
    sys.path[:0] = [os.environ["PLAMO_TEST_SITE"], os.environ["PLAMO_TEST_ROOT"]]
sys.argv = ["plamo2-tools", *sys.argv[1:]]
runpy.run_module("plamo2_tools.cli", run_name="__main__")
"""


def run(
    *args: object, stdin: str | None = None, base_only: bool = False, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """One command in a fresh interpreter; `base_only`: one that sees only what `pip install
    plamo2-tools` installs (`python -S`, the base install's packages linked into one directory),
    plus the distributions named in `extra` (e.g. `gguf`, what `[gguf]` adds for writing)."""
    site = str(base_site(extra)) if base_only else ""
    env = {**os.environ, "PLAMO_TEST_SITE": site, "PLAMO_TEST_ROOT": str(ROOT)}
    cmd = [sys.executable, *(["-S"] if base_only else []), "-c", PROBE, *map(str, args)]
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env)
    assert "TORCH-LOADED=" in r.stderr, r.stderr[-2000:]
    return r


def torch_free(
    *args: object, stdin: str | None = None, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Runs as in `pip install plamo2-tools` alone (torch is not there to load: a command that
    imports it fails with the one line that names the extra)."""
    r = run(*args, stdin=stdin, base_only=True, extra=extra)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TORCH-LOADED=0" in r.stderr, f"plamo2-tools {' '.join(map(str, args))} imported torch"
    return r


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


def base_closure(base: list[str]) -> set[str]:
    """The distributions `pip install plamo2-tools` brings: the base dependencies and, read from
    the installed metadata, theirs (markers evaluated here, no extras)."""
    seen: set[str] = set()
    todo = list(base)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _name(req.name) in seen:
            continue
        seen.add(_name(req.name))
        todo += importlib.metadata.requires(req.name) or []
    return seen


def base_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@functools.cache
def base_site(extra: tuple[str, ...] = ()) -> Path:
    """A directory holding links to exactly the installed files of the base install's distributions
    (their packages, modules, bundled libraries and metadata), as a fresh `pip install
    plamo2-tools` would lay them out; removed when the tests end."""
    site = Path(tempfile.mkdtemp(prefix="plamo2-base-site-"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    for name in base_closure([*base_dependencies(), *extra]):
        dist = importlib.metadata.distribution(name)
        root = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if not (site / top).exists() and (root / top).exists():
                (site / top).symlink_to(root / top)
    return site


def test_the_base_install_lacks_the_extras() -> None:
    """What torch_free sees: numpy, xxhash and transformers, not torch, matplotlib or lm_eval."""
    present = {p.name.partition(".")[0] for p in base_site().iterdir()}
    assert {"numpy", "xxhash", "transformers", "safetensors", "typer"} <= present
    assert not {"torch", "matplotlib", "lm_eval", "fastapi", "triton", "plamo2_tools"} & present


def test_a_command_that_needs_an_extra_says_so_in_one_line(checkpoint, tmp_path: Path) -> None:
    """Under the base install's modules, `logits` (torch) is refused in one line naming [run]."""
    r = run("logits", checkpoint("tiny"), "--input-ids", "1,2,3", "--out", tmp_path / "l.npy", base_only=True)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("TORCH-LOADED=")]
    assert r.returncode == 3 and len(lines) == 1, r.stderr
    assert lines[0] == "error: plamo2-tools logits needs torch, which is not installed: pip install 'plamo2-tools[run]'"
    assert not (tmp_path / "l.npy").exists()


def test_the_probe_sees_torch_when_a_command_loads_it(checkpoint, tmp_path: Path) -> None:
    """The probe itself can fail: `logits` runs the reference forward, so torch must show up."""
    r = run("logits", checkpoint("tiny"), "--input-ids", "1,2,3", "--out", tmp_path / "l.npy")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TORCH-LOADED=1" in r.stderr


@pytest.mark.parametrize("preset", ["tiny", "tiny3-mqa"])
def test_byte_moving_commands_never_import_torch(preset: str, checkpoint, tmp_path: Path) -> None:
    src = checkpoint(preset)
    torch_free("--help")
    torch_free("--version")
    for command in ("convert", "merge", "check", "inspect", "tokenize", "synth"):
        torch_free(command, "--help")
    torch_free("export", "mlx", "--help")
    torch_free("inspect", src)
    converted = torch_free("convert", src, tmp_path / "s", "--tp", 2, "--dtype", "bfloat16", "--json")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "convert.json").write_text(converted.stdout)
    torch_free("report", tmp_path / "runs", "--out", tmp_path / "report.md")  # reads kinds.py, not the writers
    torch_free("check", tmp_path / "s", "--json")
    torch_free("inspect", tmp_path / "s")
    torch_free("convert", tmp_path / "s", tmp_path / "s2", "--pp", 2, "--json")  # a reshard
    torch_free("merge", tmp_path / "s2", tmp_path / "m")
    torch_free("export", "mlx", src, tmp_path / "mlx", "--bits", 4, "--group-size", 32, "--no-verify", "--json")
    torch_free("check", tmp_path / "s2")
    torch_free("check", tmp_path / "mlx", "--source", src)  # an export re-derived: numpy (and MLX), no torch
    ids = torch_free("tokenize", src, stdin=json.dumps("hello world") + "\n").stdout
    torch_free("export", "fp8", "--help")
    torch_free("export", "fp8", src, tmp_path / "fp8", "--no-verify", "--json")  # verifying runs the model
    assert json.loads(ids.splitlines()[0])
    # export gguf moves bytes too (its verification runs the model: --no-verify here)
    # (with the `gguf` package of the [gguf] extra: the writer; llama.cpp is only for verifying)
    torch_free("export", "gguf", src, tmp_path / "m.gguf", "--type", "q8_0", "--no-verify", "--json", extra=("gguf",))
