"""Real ranks: process-group set-up under torchrun, and `launch()`, which runs a job on fresh
torchrun ranks (`--launch` of verify and eval) and hands rank 0's result back to the caller.

A job is a small JSON file naming a module-level function (`jobs.job_name`) and its arguments;
rank 0 saves the function's return value (`save_result`) for the parent.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import Plamo2Error, UserError
from . import result_io


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the torchrun world: NCCL on GPUs (one per local rank), gloo on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda but no CUDA device is visible")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise UserError(
                f"{local_world} ranks on this node but {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank "
                "(run without --launch to put all ranks on one GPU as threads)"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=30)}
        if backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return rank, world, dev


def shutdown_distributed() -> None:
    """Leave the world cleanly: without it gloo's threads abort the process at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def save_result(result: Any, path: Path) -> None:
    """Rank 0's return value, written for the parent process: tensors and JSON, never a pickle
    (result_io.py says what a job may return)."""
    result_io.save_result(result, path)


def load_result(path: Path) -> Any:
    return result_io.load_result(path)


def launch(job: Callable[..., Any], args: dict[str, Any], nproc: int, extra_env: dict[str, str] | None = None) -> Any:
    """Run `job(runtime, **args)` on `nproc` torchrun ranks of this machine; return rank 0's result.
    `args["runtime"]` holds the Runtime's arguments (see jobs.run_job)."""
    from .jobs import job_name

    with tempfile.TemporaryDirectory(prefix="plamo2-launch-") as tmp:
        spec = Path(tmp) / "job.json"
        result = Path(tmp) / "result"
        spec.write_text(json.dumps({"job": job_name(job), "args": args, "result": str(result)}))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "plamo2_tools.runtime.jobs", str(spec),
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
