"""Jobs that `launch()` runs on torchrun ranks: `python -m plamo2_tools.runtime.jobs JOB.json`.

Every rank runs the same job on its own `Runtime` (dist mode); rank 0 saves the return value.
Register a job by adding a function to JOBS; it receives the loaded runtime plus the job's args.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import Plamo2Error
from .engine import Runtime


def runtime_outputs(rt: Runtime, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """What verify compares: logits of every prompt position and a greedy continuation with its
    per-step logits."""
    logits = rt.prompt_logits(prompts)
    gen = rt.generate(prompts, max_new_tokens, return_logits=True)
    return {"prompt_logits": logits, "tokens": gen.tokens, "step_logits": gen.logits}


JOBS: dict[str, Callable[..., Any]] = {"runtime_outputs": runtime_outputs}


def _resolve(name: str) -> Callable[..., Any]:
    """A registered job, or 'module:function' for jobs that live elsewhere (e.g. eval)."""
    if name in JOBS:
        return JOBS[name]
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    args = dict(spec["args"])
    runtime_args = args.pop("runtime")
    rank = 0
    try:
        with Runtime(mode="dist", **runtime_args) as rt:
            rank = rt.rank
            result = _resolve(spec["job"])(rt, **args)
            if rt.is_main:
                torch.save(result, spec["result"])
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
