"""The Triton kernels against the PyTorch path and mamba_ssm: correctness on float64 oracles, then speed.

    python -m bench kernels [--smoke] [--explore] [--max-seconds 330]

Sections in order of importance (environment and ceilings, correctness, SSD chunked scan, state
update, SSD breakdown, conv, norms, attention), each skipped once --max-seconds is near.  Every
check compares against a float64 oracle with ||y - ref|| / ||ref||, outputs poisoned with NaN
first.  Baselines, measured in the same run: the device-to-device copy rate and a bf16 8192^3
matmul (every "% copy" / "% matmul" is against them), the repo's own PyTorch path and mamba_ssm's
Triton kernels where importable.  Timing: `triton.testing.do_bench` medians with L2 flushed
("eager"), `do_bench_cudagraph` ("graph").  `--smoke` runs tiny shapes on the CPU under Triton's
interpreter to check the benchmark itself (its timings mean nothing); `--explore` adds tile and
config sweeps.  The cases are in bench/kernel_cases.py.
"""

from __future__ import annotations

import argparse
import os

from bench.common import Result
from plamo2_tools.kinds import BENCH_KERNELS_KIND

KIND = BENCH_KERNELS_KIND
MODEL = False  # the kernels on synthetic tensors of PLaMo 2's shapes, no checkpoint


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    ap.add_argument("--explore", action="store_true", help="also sweep extra tiles and configs")


def run(args: argparse.Namespace, result: Result) -> None:
    # Read by bench/kernel_cases.py at import: the interpreter must be chosen before Triton loads.
    os.environ["PLAMO2_BENCH_KERNELS_SMOKE"] = "1" if args.smoke else "0"
    os.environ["PLAMO2_BENCH_KERNELS_EXPLORE"] = "1" if args.explore else "0"
    from bench import kernel_cases

    kernel_cases.run_sections(kernel_cases.Run(result))
