"""`python -m bench serving` end to end on the CPU with the tiny model (a GPU session has one chance:
the benchmark must not crash on an API drift), and the report renders what it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import rendered, run_json

from plamo2_tools.kinds import BENCH_SERVING_KIND

SERVING = (
    "--device cpu --clients 1,3 --per-client 2 --prompt-tokens 8 --max-tokens 6 --client-procs 2 --max-seconds 240"
)


@pytest.mark.slow
def test_serving_on_cpu(cli, shards, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    data = run_json("serving", "--shards", shards("tiny", 1, 1, seed=3), *SERVING.split(), "--label", "tiny", out=out)
    assert (data["kind"], data["label"], data["complete"]) == (BENCH_SERVING_KIND, "tiny", True)
    res = data["results"]
    assert res["server"]["slots"] == 3 and res["server"]["exit_code"] == 0
    for run, n in zip(res["runs"], (1, 3), strict=True):
        assert run["clients"] == n and run["complete"] and not run["errors"]
        assert run["requests"] == 2 * n and run["output_tokens"] == 2 * n * 6  # ignore_eos: every answer is full
        assert run["in_process"]["output_tokens"] == run["output_tokens"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] and run["tokens_per_s"] > 0 and run["ratio"] > 0
    text = rendered(cli, out)
    assert "## Server under load" in text and "| 3 |" in text and "**tiny**" in text
