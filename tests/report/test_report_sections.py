"""Verify results, the convert and kernel benchmarks, and convert / check / inspect --json output:
each renders its table(s) and, where it has one, a valid PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from report_helpers import assert_png, assert_tables_well_formed, image_links, table_rows

from plamo2_tools.report import ReportResult, build_report
from plamo2_tools.report.inputs import BENCH_CONVERT_KIND, BENCH_KERNELS_KIND
from plamo2_tools.verify import VERIFY_KIND, VERIFY_SCHEMA_VERSION


def render(tmp_path: Path, *inputs: Path) -> tuple[str, ReportResult]:
    result = build_report(list(inputs), tmp_path / "out" / "r.md", timestamp=False)
    md = result.out.read_text()
    assert_tables_well_formed(md)
    for link in image_links(md):
        assert_png(result.out.parent / link)
    return md, result


def row(rows: list[list[str]], first: str, column: int = 0) -> list[str]:
    return next(r for r in rows if len(r) > column and r[column] == first)


# ---- verify ----------------------------------------------------------------------------------
def test_verify_table_per_layout_and_plot(fixtures: Path, tmp_path: Path) -> None:
    md, result = render(tmp_path, fixtures / "verify")
    rows = table_rows(md)
    assert (
        rows.count(
            [
                "Layout",
                "Shards",
                "dtype",
                "Ranks",
                "Launch",
                "Backend",
                "max \\|Δlogit\\|",
                "max rel err",
                "mean KL",
                "top-1",
                "greedy match",
                "logprobs close",
                "Thresholds",
                "Result",
            ]
        )
        == 2
    )
    assert row(rows, "TP2×PP2")[1:] == [
        "`shards/tp2pp2-bf16`",
        "bfloat16",
        "4",
        "torchrun",
        "triton/cuda",
        "4.10e-01",
        "8.70e-02",
        "1.20e-02",
        "0.8500",
        "0.250 (8/32)",
        "no",
        "max_rel_err < 0.1, mean_kl < 0.01, top1_agreement ≥ 0.9",
        "**FAIL**",
    ]
    tp4 = row(rows, "TP4×PP1")
    assert tp4[6:9] == ["0", "0", "0"] and tp4[-1] == "pass" and tp4[10] == "1.000 (128/128)"
    assert "verify-bf16.json`: **FAILED**" in md and "verify-cpu.json`: passed" in md
    assert "- TP2×PP2 top1_agreement = 0.85 (needs >= 0.9)" in md
    assert [p.name for p in result.plots] == ["r-logit-error.png", "r-logit-error-2.png"]
    assert_png(result.plots[0], size=(800, 360))
    assert any("2 failure(s) in 1 layout(s)" in w for w in result.warnings)


def test_cell_text_cannot_break_a_table(tmp_path: Path) -> None:
    layout = {
        "shards": "odd|name",
        "tp": 1,
        "pp": 1,
        "dtype": "float32",
        "metrics": {"max_rel_err": 1e-7},
        "passed": False,
        "failures": ["a | b\nc"],
    }
    data = {"kind": VERIFY_KIND, "schema_version": VERIFY_SCHEMA_VERSION, "layouts": [layout], "passed": False}
    (tmp_path / "v.json").write_text(json.dumps(data))
    md, _ = render(tmp_path, tmp_path / "v.json")  # render() checks every table row's cell count
    assert "`odd\\|name`" in md and "(no run details in the file)" in md


# ---- convert benchmark -------------------------------------------------------------------------
def test_convert_bench_table_and_plot(fixtures: Path, tmp_path: Path) -> None:
    """A real bench/convert.py result (this repo's own run, trimmed)."""
    md, result = render(tmp_path, fixtures / "bench" / "bench-convert.json")
    rows = table_rows(md)
    assert row(rows, "TP2×PP1")[2:5] == ["2.83×", "2.17×", "505.6 MB"]
    assert row(rows, "TP4×PP2")[5].startswith("no: ratio_vs_cp<=1.5")
    assert "`cp -r` 6.777 s" in md and "largest tensor 819.2 MB" in md
    assert [p.name for p in result.plots] == ["r-convert-time.png"]


# ---- kernel benchmark --------------------------------------------------------------------------
def test_kernel_bench_ours_vs_peers(fixtures: Path, tmp_path: Path) -> None:
    md, result = render(tmp_path, fixtures / "bench" / "kernels.json", fixtures / "bench" / "kernels.jsonl")
    rows = table_rows(md)
    ssd = [r for r in rows if r[:1] == ["1b-T2048"]]
    assert [r[1] for r in ssd] == ["**ours**", "mamba_ssm", "torch"]  # ours first, peers by name
    assert [r[-1] for r in ssd] == ["", "0.65×", "0.38×"]  # ours / peer median time
    assert row(rows, "8b-T8192")[-1] == "" and [r[-1] for r in rows if r[:2] == ["8b-T8192", "mamba_ssm"]] == ["1.15×"]
    assert row(rows, "liger", 1)[-1] == "error: not installed"
    graph = [r for r in rows if r[:2] == ["model=1b batch=1", "graph"]]
    assert [r[2] for r in graph] == ["**ours**", "mamba_ssm"] and graph[1][-1] == "0.58×"
    assert row(rows, "device") == ["device", "NVIDIA H200"]
    assert [p.name for p in result.plots] == ["r-kernels.png", "r-kernels-2.png"]
    assert_png(result.plots[0], size=(1000, 2 * 260))  # one panel per kernel with a peer: ssd, rmsnorm


def bench_kernels_py_records() -> list[dict]:
    """Records shaped like bench/kernels.py writes them (sections, flat shape fields, ms_p50, graph timings)."""
    return [
        {"section": "env", "torch": "2.11.0", "device": "NVIDIA H200", "copy_GBps": 4270.0, "t": 0.5},
        {
            "section": "check",
            "kernel": "ssd_chunk_scan",
            "impl": "triton",
            "dtype": "torch.bfloat16",
            "rel_err": 3.4e-3,
            "ok": True,
            "model": "1b",
            "Q": 256,
            "T": 2048,
            "config": "BLOCK_M: 64, num_warps: 4",
        },
        {
            "section": "check",
            "kernel": "ssd_chunk_scan",
            "impl": "triton",
            "dtype": "torch.bfloat16",
            "rel_err": 2.0e-2,
            "ok": False,
            "model": "1b",
            "Q": 128,
            "T": 2048,
        },
        {
            "section": "perf",
            "kernel": "ssd_chunk_scan",
            "impl": "triton_Q256",
            "model": "1b",
            "layout": "B1",
            "T": 2048,
            "S": 1,
            "first_call_s": 2.5,
            "ms_p20": 0.60,
            "ms_p50": 0.62,
            "ms_p80": 0.65,
            "GBps": 900.0,
            "frac_copy": 0.21,
            "TFLOPs": 35.0,
            "frac_matmul": 0.05,
            "graph_ms_p20": 0.50,
            "graph_ms_p50": 0.51,
            "graph_ms_p80": 0.52,
            "graph_GBps": 1100.0,
            "t": 10.0,
        },
        {
            "section": "perf",
            "kernel": "ssd_chunk_scan",
            "impl": "triton_Q128",
            "model": "1b",
            "layout": "B1",
            "T": 2048,
            "S": 1,
            "ms_p20": 0.70,
            "ms_p50": 0.71,
            "ms_p80": 0.75,
            "t": 11.0,
        },
        {
            "section": "perf",
            "kernel": "ssd_chunk_scan",
            "impl": "mamba_ssm_Q256",
            "model": "1b",
            "layout": "B1",
            "T": 2048,
            "S": 1,
            "ms_p20": 1.05,
            "ms_p50": 1.09,
            "ms_p80": 1.12,
            "graph_ms_p50": 1.02,
            "t": 12.0,
        },
        {
            "section": "ratio",
            "kernel": "ssd_chunk_scan",
            "model": "1b",
            "layout": "B1",
            "T": 2048,
            "S": 1,
            "peer": "mamba_ssm",
            "ours_over_peer_time": 0.569,
            "t": 12.1,
        },
        {
            "section": "perf",
            "kernel": "ssd_chunk_scan",
            "impl": "torch",
            "model": "1b",
            "layout": "B1",
            "T": 2048,
            "S": 1,
            "error": "RuntimeError('out of memory')",
            "t": 13.0,
        },
        {"section": "skip", "kernel": "ssd_chunk_scan", "impl": "torch", "reason": "budget", "model": "8b", "t": 14.0},
        {"section": "done", "what": "ssd", "seconds": 14.2, "t": 14.2},
        {"section": "error", "what": "norms", "error": "ImportError('x')", "t": 15.0},
        {"section": "final", "checks": 2, "failed_checks": 1, "seconds": 15.5, "t": 15.5},
    ]


def test_kernel_bench_py_output(tmp_path: Path) -> None:
    """kernels.json ({"kind", "schema_version", "env", "records"}) and the streamed kernels.jsonl
    (a kind line, then the records) of the same run render once; a cut last line of the stream is
    tolerated."""
    records = bench_kernels_py_records()
    run = tmp_path / "bench-out"
    run.mkdir()
    kind = {"kind": BENCH_KERNELS_KIND, "schema_version": 1}
    (run / "kernels.json").write_text(json.dumps({**kind, "env": records[0], "records": records[:-1]}, indent=1))
    lines = [kind, *records]
    (run / "kernels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"section": "perf", "ker')
    md, result = render(tmp_path, run)
    assert [d.name for d in result.docs] == [f"{run.as_posix()}/kernels.jsonl"]
    assert "all its measurements are also in" in result.skipped[0].reason
    rows = table_rows(md)
    shape = "model=1b layout=B1 T=2048 S=1"
    eager = [r for r in rows if r[:2] == [shape, "eager"]]
    assert [r[2] for r in eager] == ["**triton_Q128**", "**triton_Q256**", "mamba_ssm_Q256", "torch"]
    assert eager[2][3:] == ["1.09", "1.05–1.12", "—", "—", "—", "—", "0.57×", ""]  # best ours 0.62 / 1.09
    assert eager[1][3:9] == ["0.62", "0.6–0.65", "900", "21", "35", "2.5"]
    assert eager[3][-1] == "error: RuntimeError('out of memory')"
    graph = [r for r in rows if r[:2] == [shape, "graph"]]
    assert [r[2] for r in graph] == ["**triton_Q256**", "mamba_ssm_Q256"] and graph[1][-2] == "0.50×"
    failing = row(rows, "ssd_chunk_scan")
    assert failing[1:] == ["triton", "bfloat16", "2", "2.00e-02", "model=1b Q=128 T=2048", "**FAIL** (1)"]
    assert row(rows, "section seconds.ssd")[1] == "14.2" and row(rows, "final.failed_checks")[1] == "1"
    assert "1 measurement(s) were skipped for lack of time budget." in md
    assert any("1 correctness check(s) failed" in w for w in result.warnings)
    assert any("section norms failed" in w for w in result.warnings)
    assert len(result.plots) == 1


# ---- convert / check / inspect -------------------------------------------------------------------
def test_tool_json_tables(fixtures: Path, tmp_path: Path) -> None:
    md, result = render(tmp_path, fixtures / "tools")
    rows = table_rows(md)
    convert = row(rows, f"`{(fixtures / 'tools' / 'convert.json').as_posix()}`")
    assert convert[1:5] == ["`shards`", "TP2×PP2", "converted", "0.168 s"] and convert[-2:] == ["4", "0"]
    failed = next(r for r in rows if r[2:3] == ["**FAILED**"])
    assert failed[3:] == ["7", "headers: 4"]
    assert any(r[2:] == ["ok", "7", "none"] for r in rows)
    inspect = next(r for r in rows if r[2:3] == ["TP2×PP2"] and r[3].startswith("D="))
    assert inspect[3] == "D=64 L=4 V=1000" and inspect[5] == "114"
    assert result.plots == []
    assert result.warnings == ["check `shards` found problems in: headers"]


def test_runtime_bench_table_with_ratio_to_torch(fixtures: Path, tmp_path: Path) -> None:
    md, _ = render(tmp_path, fixtures / "bench" / "bench-runtime.json")
    rows = table_rows(md)
    assert "## Runtime throughput" in md
    assert ["prefill", "T = 2048", "triton", "80,000.0", "2.00×"] in rows
    assert ["decode", "batch 32", "triton", "1,500.0", "1.50×"] in rows
    assert ["decode", "batch 32", "torch", "1,000.0", ""] in rows


def test_convert_bench_in_bench_convert_py_schema(tmp_path: Path) -> None:
    """The file bench/convert.py writes: a baseline block and one result per split."""
    data = {
        "kind": BENCH_CONVERT_KIND,
        "schema_version": 1,
        "command": "python bench/convert.py --work W",
        "machine": {"cpus": 2, "sha256_single_thread_GBps": 1.45},
        "options": {"cache": "cold"},
        "checkpoint": {"preset": "plamo-2-1b", "bytes": 5_167_473_028, "largest_tensor": {"bytes": 819_200_000}},
        "baseline": {"cp_s": 6.0, "cp_sync_s": 8.0},
        "targets": {"ratio": 1.5, "peak_rss_bytes": 1_356_070_912},
        "results": [
            {
                "tp": 2,
                "pp": 1,
                "wall_s": 12.0,
                "ratio_vs_cp": 2.0,
                "ratio_vs_cp_sync": 1.5,
                "peak_rss_bytes": 500_000_000,
                "targets": {"ratio_vs_cp<=1.5": False, "peak_rss<=largest+512MiB": True},
            },
        ],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    md, result = render(tmp_path, path)
    assert ["TP2×PP1", "12.0 s", "2.00×", "1.50×", "500.0 MB", "no: ratio_vs_cp<=1.5"] in table_rows(md)
    assert "`cp -r` 6.000 s" in md and [p.name for p in result.plots] == ["r-convert-time.png"]


def test_convert_bench_where_the_time_goes(tmp_path: Path) -> None:
    """bench/convert.py's per-run details (issue 13): start-up vs inside, copy paths, variants, blob check."""
    data = {
        "kind": BENCH_CONVERT_KIND,
        "schema_version": 1,
        "machine": {"cpus": 16, "sha256_single_thread_GBps": 1.3, "xxh3_128_single_thread_GBps": 6.8},
        "checkpoint": {"preset": "plamo-2-1b", "bytes": 5_000_000_000},
        "baseline": {"cp_s": 4.0, "cp_sync_s": 6.0},
        "targets": {"ratio": 1.1},
        "results": [
            {
                "tp": 2,
                "pp": 1,
                "options": "",
                "wall_s": 8.5,
                "convert_seconds": 5.0,
                "user_s": 7.0,
                "sys_s": 5.5,
                "ratio_vs_cp": 2.125,
                "ratio_vs_cp_sync": 1.4167,
                "peak_rss_bytes": 800_000_000,
                "targets": {},
                "copy": {
                    "bytes": {"copy_file_range": 3_600_000_000, "user": 0, "gather": 1_500_000_000, "compute": 1_000}
                },
            },
            {
                "tp": 2,
                "pp": 1,
                "options": "--copy user",
                "wall_s": 9.0,
                "convert_seconds": 5.5,
                "user_s": 7.0,
                "sys_s": 5.0,
                "ratio_vs_cp": 2.25,
                "ratio_vs_cp_sync": 1.5,
                "peak_rss_bytes": 800_000_000,
                "targets": {},
                "copy": {
                    "bytes": {"copy_file_range": 0, "user": 3_600_000_000, "gather": 1_500_000_000, "compute": 1_000}
                },
            },
        ],
        "blob_check": {"split": "tp2_pp1", "verify_blobs_s": 9.5, "no_verify_blobs_s": 8.5},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    md, result = render(tmp_path, path)
    rows = table_rows(md)
    assert ["TP2×PP1 `--copy user`", "9.000 s", "2.25×", "1.50×", "800.0 MB", "yes"] in rows
    assert ["TP2×PP1", "", "5.000 s", "3.500 s", "7.000 s + 5.500 s", "3.600 GB", "0 B", "1.500 GB", "1.0 kB"] in rows
    assert [
        "TP2×PP1",
        "`--copy user`",
        "5.500 s",
        "3.500 s",
        "7.000 s + 5.000 s",
        "0 B",
        "3.600 GB",
        "1.500 GB",
        "1.0 kB",
    ] in rows
    assert "xxh3-128 6.8 GB/s" in md and "9.500 s with `--verify-blobs`" in md and "8.500 s without" in md
    assert len(result.plots) == 1
