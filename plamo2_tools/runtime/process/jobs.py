"""One way to run a job on the runtime, in this process or on real ranks (docs/architecture.md,
"Running the model").

A job is a plain function `job(runtime, **args)`.  `run_job` runs it on a `Runtime` whose ranks
are threads of this process, or, with `launch=True`, on fresh torchrun ranks (one process per
rank, gloo on CPU, NCCL on GPU), where every rank runs the same job on its own rank of the
runtime and rank 0's return value comes back.  Verify and eval both go through here.

Worker side: `python -m plamo2_tools.runtime.process.jobs JOB.json` (started by `launch.launch`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ...errors import Plamo2Error
from ...shards import load_manifest
from ...shards.integrity import verify_shard_files
from ..batching.engine import Runtime
from .launch import launch as launch_ranks
from .launch import launch_service, resolve_job, save_result

T = TypeVar("T")


def run_job(
    job: Callable[..., T],
    runtime: dict[str, Any],
    args: dict[str, Any],
    launch: bool = False,
    extra_env: dict[str, str] | None = None,
) -> T:
    """`job(Runtime(**runtime), **args)`: in this process (its ranks as threads, or, when this
    process is itself one torchrun rank, that rank), or on fresh torchrun ranks with `launch`."""
    if launch:
        world, runtime = _checked_before_launch(runtime)
        return launch_ranks(job, {"runtime": runtime, **args}, world, extra_env)
    # "auto": ranks as threads, or this process's rank when the caller itself runs under torchrun.
    with Runtime(**runtime, mode="auto") as rt:
        return job(rt, **args)


def run_service(
    job: Callable[..., Any], runtime: dict[str, Any], args: dict[str, Any], extra_env: dict[str, str] | None = None
) -> int:
    """A long-lived job (a server) on fresh torchrun ranks (`launch.launch_service`): the shard
    files checked here first, once, as `run_job` does; the ranks' exit code."""
    world, runtime = _checked_before_launch(runtime)
    return launch_service(job, {"runtime": runtime, **args}, world, extra_env)


def _checked_before_launch(runtime: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Every rank's files checked here, once, so that a bad file is one line from this process
    before any rank starts (a rank's own error would reach us only as torchrun's log tail); the
    world size, and the runtime arguments with the ranks' own check turned off."""
    manifest = load_manifest(runtime["shards"])
    world = manifest.mapping.world_size
    verify_shard_files(manifest, range(world), digests=runtime.get("verify_files", True))
    return world, {**runtime, "verify_files": False}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    args = dict(spec["args"])
    runtime_args = args.pop("runtime")
    rank = 0
    try:
        with Runtime(mode="dist", **runtime_args) as rt:
            rank = rt.rank
            if rt.is_main and spec.get("pid_file"):  # launch_service signals rank 0 here
                Path(spec["pid_file"]).write_text(str(os.getpid()))
            result = resolve_job(spec["job"])(rt, **args)
            if rt.is_main:
                save_result(result, Path(spec["result"]))
        return 0
    except Plamo2Error as e:
        if rank == 0:
            Path(spec_path).with_name("error.txt").write_text(str(e))
        return e.exit_code
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
