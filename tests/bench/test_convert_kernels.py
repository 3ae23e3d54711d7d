"""`python -m bench convert` and `python -m bench kernels --smoke` end to end on the CPU: the two
benchmarks that do not run a model checkpoint through the runtime (convert makes its own, kernels
times synthetic tensors), writing what the report reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import rendered, run_json

from plamo2_tools.kinds import BENCH_CONVERT_KIND, BENCH_KERNELS_KIND


def test_convert_on_cpu(cli, tmp_path: Path) -> None:
    out = tmp_path / "convert.json"
    options = ["--preset", "tiny", "--repeat", "1", "--splits", "2x1", "--cache", "warm"]
    data = run_json("convert", *options, "--variant", "file=--sync file", "--work", tmp_path / "w", out=out)
    assert (data["kind"], data["complete"], data["error"]) == (BENCH_CONVERT_KIND, True, None)
    res = data["results"]
    assert res["baseline"]["cp_s"] > 0 and res["startup"]["help_imports_torch"] is False
    assert [(r["split"], r["options"]) for r in res["results"]] == [("tp2_pp1", ""), ("file", "--sync file")]
    assert all(r["peak_rss_bytes"] > 0 and r["output_bytes"] > 0 for r in res["results"])
    text = rendered(cli, out)
    assert "## Convert benchmark" in text and "| TP2×PP1 `--sync file` |" in text


@pytest.mark.slow
def test_kernels_smoke_on_cpu(cli, tmp_path: Path) -> None:
    """Every section on tiny shapes under Triton's interpreter: the checks must pass (their oracle is
    float64), the timings mean nothing."""
    out = tmp_path / "kernels.json"
    data = run_json("kernels", "--smoke", out=out)
    assert (data["kind"], data["complete"]) == (BENCH_KERNELS_KIND, True)
    records = data["results"]["records"]
    checks = [r for r in records if r.get("section") == "check"]
    assert checks and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert not [r for r in records if r.get("section") == "error"]
    assert data["results"]["env"]["smoke"] is True
    assert "## Kernel benchmark" in rendered(cli, out)
