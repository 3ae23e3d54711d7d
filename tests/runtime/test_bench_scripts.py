"""bench/runtime.py and bench/gsm8k.py run end to end on the CPU with a tiny model (the GPU run has
one chance: the scripts must not crash on an API drift), and write what the report reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_runtime_on_cpu(shards, tmp_path: Path) -> None:
    out = tmp_path / "runtime.json"
    run(ROOT / "bench" / "runtime.py", shards("tiny", 1, 1, seed=11), "--device", "cpu", "--modes", "torch-eager",
        "--decode", "1,4", "--steps", "4", "--context", "16", "--prefill", "64", "--packed", "16",
        "--schedule", "24", "--prompt-tokens", "20", "--batch", "6", "--out", out)  # fmt: skip
    data = json.loads(out.read_text())
    assert (data["kind"], data["schema_version"]) == ("plamo2-bench-runtime", 1)
    assert data["bytes"]["weights"] > 0 and data["bytes"]["kv_per_token"] > 0  # what the floor is made of
    phases = [r["phase"] for r in data["runs"]]
    assert phases == ["decode", "decode", "prefill", "prefill-packed", "schedule"]
    packed = data["runs"][3]
    assert (packed["sequences"], packed["tokens"], packed["forwards"]) == (4, 64, 1)
    sched = data["runs"][4]
    assert sched["batch"] == 6 and sched["requests"] == 24 and sched["loop"]["groups"] >= 2
    assert all(isinstance(r["tokens_per_s"], float) for r in data["runs"])


def test_bench_gsm8k_on_cpu(shards, tmp_path: Path) -> None:
    out = tmp_path / "gsm8k.json"
    run(ROOT / "bench" / "gsm8k.py", shards("tiny", 1, 1, seed=11), "--synthetic-data", "12", "--limit", "5",
        "--batch-size", "auto", "--device", "cpu", "--max-gen-toks", "8", "--capacity", "2048",
        "--out", out)  # fmt: skip
    data = json.loads(out.read_text())
    assert (data["kind"], data["runs"][0]["phase"], data["documents"]) == ("plamo2-bench-runtime", "gsm8k", 5)
    split = data["split_seconds"]
    assert set(split) == {"load", "warm_up", "generate", "prefill_device", "decode_device", "generate_host",
                          "lm_eval_other"}  # fmt: skip
    assert data["auto_batch"]["slots"] >= data["batch_size"] == 5
    assert data["prefill"]["tokens"] > 5 * 500 and data["generated_tokens"] == 5 * 8
