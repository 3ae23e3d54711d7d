"""`python -m bench tune` (a card's tuned-kernel table, made on the card): on the CPU, where no card
table can be made, it runs warmup, fails with warmup's refusal kept in its file; a result holding a
table (written by `kernels.tuned.write_table` for a fake card, the way the GPU run writes it) is
rendered by the report.  Seen failing: with tune not keeping warmup's output when it fails, the
first test cannot find the refusal."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import bench, rendered

from plamo2_tools.kernels import tuned
from plamo2_tools.kinds import BENCH_SCHEMA_VERSION, BENCH_TUNE_KIND


def test_tune_on_the_cpu_keeps_warmups_refusal(shards, tmp_path: Path) -> None:
    out = tmp_path / "tune.json"
    bench(
        "tune",
        "--shards",
        shards("tiny", 1, 1, seed=11),
        "--device",
        "cpu",
        "--work",
        tmp_path / "w",
        "--out",
        out,
        expect=1,
    )
    data = json.loads(out.read_text())
    assert (data["kind"], data["schema_version"], data["complete"]) == (BENCH_TUNE_KIND, BENCH_SCHEMA_VERSION, False)
    assert data["error"] == "RuntimeError: warmup exited 2"
    assert "--tuned-out: a card's table is measured on that card" in data["results"]["output_tail"]


def test_a_tune_result_is_rendered(cli, tmp_path: Path) -> None:
    card = tuned.Card("Fake Card 9000", "9.9")
    table = tuned.write_table(tmp_path / "t.json", card, {"ssd_chunk_scan": {"1|2|3": ["parallel", 128]}}, {})
    envelope = {
        "kind": BENCH_TUNE_KIND,
        "schema_version": BENCH_SCHEMA_VERSION,
        "benchmark": "tune",
        "machine": {"card": card.name},
        "command": "python -m bench tune",
        "started_at": "2026-12-07T00:00:00Z",
        "complete": True,
        "results": {
            "table": json.loads(table.read_text()),
            "wall_s": 12.5,
            "warmup": {"triton_kernels_before": 3, "triton_kernels_after": 40},
        },
    }
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(envelope))
    text = rendered(cli, path)
    assert "Tuned-kernel tables made on a card" in text
    assert "Fake Card 9000 (sm 9.9): ssd_chunk_scan 1; warmup 12.5 s, 37 Triton kernels compiled" in text
