"""Commands that do not run the model never import PyTorch (issue 22): importing it costs seconds,
about as long as copying a 1B model.  Each command runs in a fresh interpreter that reports, as it
exits, whether `torch` is in `sys.modules`; a later import chain that brings torch back fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nTORCH-LOADED=%d\\n" % ("torch" in sys.modules)))
sys.argv = ["plamo2-tools", *sys.argv[1:]]
runpy.run_module("plamo2_tools.cli", run_name="__main__")
"""


def run(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], input=stdin, capture_output=True, text=True)
    assert "TORCH-LOADED=" in r.stderr, r.stderr[-2000:]
    return r


def torch_free(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    r = run(*args, stdin=stdin)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TORCH-LOADED=0" in r.stderr, f"plamo2-tools {' '.join(map(str, args))} imported torch"
    return r


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
    torch_free("export", "gguf", src, tmp_path / "m.gguf", "--type", "q8_0", "--no-verify", "--json")
