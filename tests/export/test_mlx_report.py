"""`report` reads what `export mlx` records (its --json, OUT/plamo2_export.json) and the export
benchmark, by kind and version.  Shown to fail: with the EXPORT_MLX_KIND string changed in
report/inputs.py, both tests went red (the kind no longer matched the writer's)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from plamo2_tools.export.mlx import EXPORT_KIND, EXPORT_SCHEMA_VERSION
from plamo2_tools.export.side import SIDE_JSON
from plamo2_tools.kinds import BENCH_EXPORT_MLX_KIND, EXPORT_MLX_KIND
from plamo2_tools.report import build_report
from plamo2_tools.report.inputs import SCHEMAS

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_reads_the_kinds_the_writers_write() -> None:
    assert EXPORT_MLX_KIND == EXPORT_KIND and EXPORT_SCHEMA_VERSION in SCHEMAS[EXPORT_KIND].versions
    body = ast.parse((ROOT / "bench" / "export_mlx.py").read_text()).body
    bench = {
        n.targets[0].id: n.value.value
        for n in body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)
    }
    assert bench["KIND"] == BENCH_EXPORT_MLX_KIND and bench["SCHEMA_VERSION"] in SCHEMAS[BENCH_EXPORT_MLX_KIND].versions


@pytest.mark.mlx
def test_an_export_shows_in_the_report_with_its_verdict(cli, checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    results = tmp_path / "results"
    results.mkdir()
    out = tmp_path / "mlx"
    # tiny3: mlx-lm decodes PLaMo 3 with another window than it scores with (test_mlx_export): exit 1, kept
    (results / "export.json").write_text(cli("export", "mlx", checkpoint("tiny3"), out, "--json", expect=1).stdout)
    (results / "figures.json").write_text((out / SIDE_JSON).read_text())
    result = build_report([results], tmp_path / "r.md", timestamp=False)
    assert result.skipped == [] and [d.kind for d in result.docs] == ["export-mlx", "export-mlx"]
    text = (tmp_path / "r.md").read_text()
    assert "## Exports" in text and "DIVERGED" in text and "prompt 0 pos " in text
    assert not json.loads((results / "export.json").read_text())["verification"]["passed"]
