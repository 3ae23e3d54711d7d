"""`--help` and the refusals that come before any model work import none of the heavy packages
(issue 33: each costs seconds; bench/startup.py measures the times, reports/startup/ has them).

Each case runs in a fresh interpreter that reports, as it exits, which of HEAVY it had imported;
the assertion is about *which modules*, never about time.  Seen failing: with `generate` importing
the runtime before it looks at the directory (as it did), the first refusal case lists torch; with
the device check importing torch again, the `--device cuda` case does; with the reference forward
importing torch before it checks its directory (as it did), the `verify` cases do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plamo2_tools.kernels.devices import torch_build

BUILD = torch_build()
# numpy is not among them everywhere: the commands that move bytes (check, inspect, convert) and
# verify use it; the run commands' refusals do not (RUN_COMMANDS, below), at ~0.1-0.2 s.
HEAVY = ("torch", "transformers", "lm_eval", "triton", "datasets", "fastapi")
PROBE = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nHEAVY=" + ",".join(m for m in {modules!r} if m in sys.modules) + "\\n"))
sys.argv = ["plamo2-tools", *sys.argv[1:]]
runpy.run_module("plamo2_tools.cli", run_name="__main__")
"""
COMMANDS = (
    "synth",
    "inspect",
    "logits",
    "convert",
    "merge",
    "check",
    "demo",
    "verify",
    "generate",
    "serve",
    "eval",
    "gsm8k-task",
    "report",
    "tokenize",
    "warmup",
)


def loaded(
    *args: object, env: dict[str, str] | None = None, modules: tuple[str, ...] = HEAVY
) -> tuple[int, set[str], str]:
    probe = PROBE.format(modules=modules)
    r = subprocess.run([sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True, env=env)
    marker = [line for line in r.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker, r.stderr[-2000:]
    found = {m for m in marker[-1].removeprefix("HEAVY=").split(",") if m}
    return r.returncode, found, r.stderr.split("\nHEAVY=")[0].strip()


def test_the_probe_sees_a_heavy_import(shards) -> None:
    """The probe can fail: a command that runs the model lists torch."""
    code, found, _ = loaded("generate", shards("tiny", 1, 1, seed=11), "--prompt", "hi", "--max-new-tokens", "1")
    assert code == 0 and "torch" in found


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_nothing_heavy(command: str) -> None:
    code, found, _ = loaded(*command.split(), "--help")
    assert code == 0 and not found, (command, found)


def refusals(tmp_path: Path, shards: Path) -> list[tuple[tuple[object, ...], str]]:
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir(exist_ok=True)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    return [
        (("generate", empty, "--prompt", "hi"), "no plamo2_shards.json"),
        (("generate", missing, "--prompt", "hi"), ""),
        (("generate", shards, "--prompt", "hi", "--temperature", "-1"), "--temperature -1"),
        (("generate", shards, "--prompt", "hi", "--backend", "nope"), "is not a kernel backend"),
        (("generate", shards, "--prompt", "hi", "--device", "tpu"), "is not a device"),
        (("eval", empty, "--gsm8k-dir", data), "no plamo2_shards.json"),
        (("eval", shards, "--tasks", "mmlu", "--gsm8k-dir", data), "unsupported task"),
        (("eval", shards, "--gsm8k-dir", tmp_path / "nodata"), "does not exist"),
        (("serve", empty), "no plamo2_shards.json"),
        (("warmup", empty), "no plamo2_shards.json"),
        (("warmup", shards, "--modes", "beam"), "--modes"),
        (("logits", empty, "--input-ids", "1,2", "--out", tmp_path / "x.npy"), "config.json"),
        (("check", empty), ""),
        (("inspect", missing), ""),
        (("tokenize", missing), "is not a directory"),
        (("verify", shards, "--reference", missing), "not a directory"),
        (("verify", shards, "--reference", empty), "config.json"),
    ]


def test_refusals_before_model_work_import_nothing_heavy(shards, tmp_path: Path) -> None:
    layout = shards("tiny", 1, 1, seed=11)
    for args, words in refusals(tmp_path, layout):
        code, found, stderr = loaded(*args)
        assert code == 2, (args, code, stderr)
        assert words in stderr, (args, stderr)
        assert not found, (args, found)


@pytest.mark.skipif(BUILD is None or BUILD["cuda"] is not None, reason="needs a CPU-only build of torch")
def test_cuda_on_a_cpu_build_is_refused_without_torch(shards) -> None:
    code, found, stderr = loaded("generate", shards("tiny", 1, 1, seed=11), "--prompt", "hi", "--device", "cuda")
    assert code == 3 and "CPU-only build" in stderr, stderr
    assert not found, found


def test_hidden_gpus_are_refused_without_torch(shards) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    code, found, stderr = loaded(
        "generate", shards("tiny", 1, 1, seed=11), "--prompt", "hi", "--device", "cuda", env=env
    )
    assert code == 3 and "no CUDA device is usable" in stderr, stderr
    assert not found, found


RUN_COMMANDS = ("generate", "eval", "serve", "warmup", "tokenize")


def test_the_run_commands_refuse_without_numpy(shards, tmp_path: Path) -> None:
    """The manifest, dtype and layout modules import numpy on first use only.  Seen failing with
    `import numpy as np` back at the top of model/layout.py: every case lists numpy."""
    layout = shards("tiny", 1, 1, seed=11)
    cases = [args for args, _ in refusals(tmp_path, layout) if args[0] in RUN_COMMANDS]
    assert len(cases) >= 10
    for args in cases:
        code, found, stderr = loaded(*args, modules=("numpy",))
        assert code == 2 and not found, (args, found, stderr)


def test_a_directory_without_a_manifest_is_refused_without_the_model_package(tmp_path: Path) -> None:
    """The manifest reader imports the model package (families, tensor tables, layout: ~40 ms) when it
    reads a manifest, not when it finds none; `check` recognises an export by its record alone and
    imports the checkers (numpy) after the manifest is read.  Seen failing with shards/manifest.py
    importing `..model` at its top (as it did): every case lists plamo2_tools.model; with `check`
    importing export/check.py or shards/check.py first (as it did), its case lists numpy."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (("generate", empty, "--prompt", "hi"), ("serve", empty), ("warmup", empty), ("check", empty)):
        code, found, stderr = loaded(*command, modules=("plamo2_tools.model", "numpy"))
        assert code == 2 and "no plamo2_shards.json" in stderr and not found, (command, found, stderr)
