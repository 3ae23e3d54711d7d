"""`launch()`: run a job on fresh torchrun ranks (`--launch` of verify and eval) and hand rank 0's
result back to the caller; `launch_service()`: a long-lived job (`serve --launch`) whose output
goes straight to ours and whose end rank 0 decides.

A job is a small JSON file naming a module-level function (`job_name`) and its arguments; rank 0
saves the function's return value (`save_result`) for the parent.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
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
        cmd = _torchrun(nproc, spec)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        error = Path(tmp) / "error.txt"
        if error.exists():
            raise Plamo2Error(error.read_text().strip())
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise Plamo2Error(f"torchrun with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
        return load_result(result)


def launch_service(
    job: Callable[..., Any], args: dict[str, Any], nproc: int, extra_env: dict[str, str] | None = None
) -> int:
    """Run `job(runtime, **args)` on `nproc` torchrun ranks until it ends by itself; its exit code.

    For a server: the ranks print straight to our stdout/stderr; torchrun runs in a session of
    its own, so a terminal's Ctrl-C reaches only this process, and SIGINT / SIGTERM sent here are
    passed to rank 0 alone (its pid is in the job's `pid_file` once it has loaded), which ends the
    job for every rank (a graceful stop ends with exit 0, where torchrun itself, signalled, would
    kill its workers and fail).  Before rank 0 is up, a signal stops the whole group.
    """
    with tempfile.TemporaryDirectory(prefix="plamo2-launch-") as tmp:
        spec, pid_file = Path(tmp) / "job.json", Path(tmp) / "rank0.pid"
        spec.write_text(
            json.dumps(
                {"job": job_name(job), "args": args, "result": str(Path(tmp) / "result"), "pid_file": str(pid_file)}
            )
        )
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
        proc = subprocess.Popen(_torchrun(nproc, spec), env=env, start_new_session=True)

        def forward(signum: int, frame: object) -> None:
            try:
                pid = int(pid_file.read_text()) if pid_file.exists() else None
            except ValueError:
                pid = None
            try:
                if pid is not None:
                    os.kill(pid, signum)
                else:
                    os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            rc = proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        error = Path(tmp) / "error.txt"
        if error.exists():  # rank 0's one-line refusal, with its exit code
            failure = Plamo2Error(error.read_text().strip())
            failure.exit_code = rc or failure.exit_code
            raise failure
        return rc


def _torchrun(nproc: int, spec: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "plamo2_tools.runtime.process.jobs",
        str(spec),
    ]
