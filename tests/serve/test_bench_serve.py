"""bench/serve.py end to end on the CPU with the tiny model (the GPU run has one chance: the
script must not crash on an API drift), and the report renders what it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serve_on_cpu(cli, shards, tmp_path: Path) -> None:
    out = tmp_path / "bench_serve.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve.py"), str(shards("tiny", 1, 1, seed=3)), "--device", "cpu",
           "--clients", "1,3", "--per-client", "2", "--prompt-tokens", "8", "--max-tokens", "6", "--client-procs", "2",
           "--max-seconds", "240", "--label", "tiny", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    data = json.loads(out.read_text())
    assert (data["kind"], data["schema_version"]) == ("plamo2-bench-serve", 1)
    assert data["server"]["slots"] == 3 and data["server"]["exit_code"] == 0
    for run, n in zip(data["runs"], (1, 3), strict=True):
        assert run["clients"] == n and run["complete"] and not run["errors"]
        assert run["requests"] == 2 * n and run["output_tokens"] == 2 * n * 6  # ignore_eos: every answer is full
        assert run["in_process"]["output_tokens"] == run["output_tokens"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] and run["tokens_per_s"] > 0 and run["ratio"] > 0
    report = tmp_path / "report.md"
    cli("report", out, "--out", report)
    text = report.read_text()
    assert "## Server under load" in text and "| 3 |" in text
