"""lm-eval results: lm-eval's own table per run, the comparison across layouts with the published
vLLM reference beside it, and the --limit warning; on committed results files and on a live run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_helpers import assert_tables_well_formed, table_rows

from plamo2_tools.eval.harness import EvalOutcome, write_stable_results
from plamo2_tools.report import build_report
from plamo2_tools.report.lmeval import find_layout


def render(tmp_path: Path, *inputs: Path) -> str:
    out = tmp_path / "reports" / "r.md"
    build_report(list(inputs), out, timestamp=False)
    return out.read_text()


def test_per_run_tables_like_lm_eval(fixtures: Path, tmp_path: Path) -> None:
    md = render(tmp_path, fixtures / "lm-eval")
    assert_tables_well_formed(md)
    rows = table_rows(md)
    assert ["Tasks", "Version", "Filter", "n-shot", "Metric", "Value", "± Stderr"] in rows
    # TP1xPP1 full run (bootstrap stderr) and TP2xPP2 (bootstrap_iters=0: stderr "N/A"), sorted like make_table.
    assert ["gsm8k", "3", "flexible-extract", "5", "exact_match ↑", "0.3333", "0.3333"] in rows
    assert ["", "", "strict-match", "5", "exact_match ↑", "1.0000", "0.0000"] in rows
    assert ["gsm8k", "3", "flexible-extract", "5", "exact_match ↑", "0.6667", "N/A"] in rows
    assert md.index("### Run 1: TP1×PP1") < md.index("### Run 2: TP1×PP1") < md.index("### Run 3: TP2×PP2")


def test_comparison_with_reference_and_limit_warning(fixtures: Path, tmp_path: Path) -> None:
    md = render(tmp_path, fixtures / "lm-eval")
    rows = table_rows(md)
    header = next(r for r in rows if r[:4] == ["Task", "n-shot", "Filter", "Metric"])
    # Each published layout's reference sits right after the last run of that layout.
    assert header[4:] == [
        "TP1×PP1 (run 1, --limit 2)",
        "TP1×PP1 (run 2)",
        "vLLM reference TP1×PP1 (published)",
        "TP2×PP2 (run 3)",
        "vLLM reference TP2×PP2 (published)",
    ]
    assert ["gsm8k", "5", "flexible-extract", "exact_match", "1.0000", "0.3333", "0.202", "0.6667", "0.205"] in rows
    assert ["gsm8k", "5", "strict-match", "exact_match", "1.0000", "1.0000", "0.520", "1.0000", "0.517"] in rows
    samples = next(r for r in rows if r[3:4] == ["samples (effective / original)"])
    assert samples[4:] == ["2 / 3", "3 / 3", "1319 / 1319", "3 / 3", "1319 / 1319"]
    comparable = next(r for r in rows if r[3:4] == ["comparable to the reference"])
    assert comparable[4].startswith("no: --limit 2") and "not GSM8K's 1,319" in comparable[5]
    assert "not comparable to the reference" in md
    assert md.count("> **Warning:**") == 1  # only the --limit run
    assert "**Reference** columns are the published vLLM results for pfnet/plamo-2-1b" in md


def test_layout_from_config_and_model_args() -> None:
    assert find_layout({"tp": 2, "pp": 2, "model_args": None}) == (2, 2)
    assert find_layout({"model_args": "pretrained=pfnet/plamo-2-1b,tensor_parallel_size=2"}) == (2, 1)
    assert find_layout({"model_args": {"pretrained": "x", "pp": 4}}) == (1, 4)
    assert find_layout({"model_args": "pretrained=x"}) == (None, None)


def test_other_layouts_still_see_the_reference(fixtures: Path, tmp_path: Path) -> None:
    """A run in an unpublished layout gets both reference columns at the end, and says why it is not comparable."""
    src = next((fixtures / "lm-eval" / "tp2pp2").rglob("results_*.json")).read_text()
    (tmp_path / "tp4").mkdir()
    (tmp_path / "tp4" / "results.json").write_text(src.replace('"tp": 2', '"tp": 4'))
    md = render(tmp_path, tmp_path / "tp4")
    header = next(r for r in table_rows(md) if r[:2] == ["Task", "n-shot"])
    assert header[4:] == ["TP4×PP2 (run 1)", "vLLM reference TP1×PP1 (published)", "vLLM reference TP2×PP2 (published)"]
    assert "no published reference for this layout" in md


@pytest.mark.filterwarnings("ignore")
def test_live_lm_eval_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval 0.4.13 itself, through the CLI's tracker, on a 3-problem self-written gsm8k; our eval's
    stable results.json copy of the same run is recognised as a duplicate."""
    import report_oracle

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local JSON only; never the Hub

    out_dir = tmp_path / "lm-eval"
    report_oracle.evaluate(tmp_path / "data", tp=2, pp=2, limit=2, run_on_docs=frozenset({1}), output_path=out_dir)
    written = next(out_dir.rglob("results_*.json"))
    write_stable_results(written, written.with_name("results.json"))  # what `plamo2-tools eval` adds
    # What `plamo2-tools eval --json` prints for the same run: a subset of the keys, no "configs".
    outcome = EvalOutcome(json.loads(written.read_text()), {}, {"results": str(written)}, "", "", wall_seconds=1.0)
    (out_dir / "eval-summary.json").write_text(json.dumps(outcome.summary()))
    result = build_report([out_dir], tmp_path / "r.md", timestamp=False)
    md = result.out.read_text()
    assert [Path(d.name).name for d in result.docs] == ["results.json"]  # the full file wins over the digest
    assert [s.reason for s in result.skipped] == [f"same results as {result.docs[0].name}"] * 2
    rows = table_rows(md)
    assert ["gsm8k", "3", "flexible-extract", "5", "exact_match ↑", "0.5000", "N/A"] in rows
    assert ["", "", "strict-match", "5", "exact_match ↑", "1.0000", "N/A"] in rows
    assert "TP2×PP2 (run 1, --limit 2)" in md and "vLLM reference TP2×PP2 (published)" in md
    assert "gsm8k was scored on 2 of 3 problems; not comparable to the reference" in md
