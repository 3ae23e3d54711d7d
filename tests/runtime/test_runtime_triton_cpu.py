"""The runtime end to end with the Triton kernels, on the CPU under Triton's interpreter: prompt
logits and a greedy continuation of fp32 TP1xPP1 shards against the reference forward.

Every other runtime test runs the PyTorch kernels; the kernel tests check each Triton op alone.
This one checks that the runtime drives the Triton ops correctly (shapes, strides, packed batches,
states across decode steps).  It runs in a fresh process: the interpreter is chosen when Triton is
imported (TRITON_INTERPRET=1), and TP ranks, which are threads of one process, crash when they run
the interpreter concurrently, hence TP1xPP1 (one rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plamo2_tools.model.synth import preset_config
from plamo2_tools.runtime.process.launch import load_result
from plamo2_tools.verify import THRESHOLDS, compare, judge, random_prompts, reference_outputs

STEPS = 4  # greedy decode steps: enough to pass through the state-update kernels, cheap when interpreted

CHILD = """
import json, sys
from pathlib import Path
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.verify import runtime_outputs
from plamo2_tools.runtime.process.launch import save_result

shards, prompts, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
options = json.loads(sys.argv[5])
with Runtime(shards, device="cpu", backend="triton", mode="local", forward_options=options) as rt:
    save_result({"kernels": rt.kernels, **runtime_outputs(rt, prompts, steps)}, out)
"""


# PLaMo 2 (Mamba + attention, window 12) and PLaMo 3 with YaRN (window 4, per-layer RoPE tables,
# shared q/k norms in the fused kernel) in the vLLM window convention.
CASES = {"tiny": ({}, 12), "tiny3-yarn": ({"window_convention": "vllm"}, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(CASES))
def test_triton_runtime_on_cpu_matches_the_reference(tmp_path: Path, shards, checkpoint, preset: str) -> None:
    options, window = CASES[preset]
    # one prompt longer than the attention window, one short: the window, ragged packing
    prompts = random_prompts(2, preset_config(preset).vocab_size, seed=7, lengths=(3, 20))
    assert max(map(len, prompts)) > window
    out = tmp_path / "outputs"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(shards(preset, 1, 1, seed=11)),
            json.dumps(prompts),
            str(STEPS),
            str(out),
            json.dumps(options),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_result(out)
    assert got.pop("kernels") == "triton"
    ref = reference_outputs(checkpoint(preset, seed=11), prompts, STEPS, torch.float64, forward_options=options)
    metrics = compare(ref, got)
    assert judge(metrics, THRESHOLDS["float32"]) == [], metrics
    assert metrics["max_rel_err"] < 1e-4 and metrics["greedy_match_tokens"] == [STEPS] * len(prompts)
