"""The benchmark suite: named benchmarks with one command-line shape and one result file
(docs/benchmarks.md).

    python -m bench NAME [options]                  one benchmark -> runs/bench/NAME.json (--out)
    python -m bench --list                          what each measures
    python -m bench.session NAME... --deadline S    a GPU session: several, within S seconds, tarred under $OUT

`plamo2-tools report` renders every result (their kinds are in plamo2_tools/kinds.py).  Adding a
benchmark: a module following bench/common.py's pattern, one line below, its kind in kinds.py and
a Schema entry in plamo2_tools/report/inputs.py (with its renderer).

The other files here are checks and tools with their own command lines: vllm_compat.sh/.py and
plamo3_vllm_forward.py (vLLM itself on our shards), mutants.py (mutation testing), fuzz.py (the long
fuzz campaign), kill_resume.py (convert killed and resumed), tokenizer.py (the native tokenizer
against PLaMo's own), sample_stacks.py (where a Python program's threads spend their time).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module, in the order `--list` shows them.  The modules import nothing heavy at load time.
BENCHMARKS: dict[str, str] = {
    "throughput": "bench.throughput",  # runtime decode (tokens/s, ms/step) and prefill against the weight-read floor
    "serving": "bench.serving",  # `plamo2-tools serve` under N streaming clients against in-process generate
    "convert": "bench.convert",  # `plamo2-tools convert` against `cp -r`
    "kernels": "bench.kernels",  # the Triton kernels against the PyTorch path and mamba_ssm, with correctness checks
    "accuracy": "bench.accuracy",  # the offline GSM8K run (lm-eval) phase by phase, with its scores
    "e2e": "bench.e2e",  # the README's commands from the shell, fresh and warm
}


def load(name: str) -> ModuleType:
    return importlib.import_module(BENCHMARKS[name])
