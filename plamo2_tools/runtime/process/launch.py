"""`launch()`: run a job on fresh torchrun ranks (`--launch` of verify and eval) and hand rank 0's
result back to the caller.

A job is a small JSON file naming a module-level function (`job_name`) and its arguments; rank 0
saves the function's return value (`save_result`) for the parent.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import Plamo2Error
from . import result_io


def job_name(job: Callable[..., Any]) -> str:
    """How a worker finds the job again: 'module:qualname' of a module-level function."""
    name = f"{job.__module__}:{job.__qualname__}"
    if "<" in job.__qualname__:
        raise ValueError(f"{name}: a job must be a module-level function (workers import it)")
    return name


def resolve_job(name: str) -> Callable[..., Any]:
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def save_result(result: Any, path: Path) -> None:
    """Rank 0's return value, written for the parent process: tensors and JSON, never a pickle
    (result_io.py says what a job may return)."""
    result_io.save_result(result, path)


def load_result(path: Path) -> Any:
    return result_io.load_result(path)


def launch(job: Callable[..., Any], args: dict[str, Any], nproc: int, extra_env: dict[str, str] | None = None) -> Any:
    """Run `job(runtime, **args)` on `nproc` torchrun ranks of this machine; return rank 0's result.
    `args["runtime"]` holds the Runtime's arguments (see jobs.run_job)."""
    with tempfile.TemporaryDirectory(prefix="plamo2-launch-") as tmp:
        spec = Path(tmp) / "job.json"
        result = Path(tmp) / "result"
        spec.write_text(json.dumps({"job": job_name(job), "args": args, "result": str(result)}))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "plamo2_tools.runtime.process.jobs", str(spec),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        error = Path(tmp) / "error.txt"
        if error.exists():
            raise Plamo2Error(error.read_text().strip())
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise Plamo2Error(f"torchrun with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
        return load_result(result)
