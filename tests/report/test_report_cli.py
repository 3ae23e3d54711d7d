"""`plamo2-tools report` end to end: mixed directories, unknown files, nothing usable, --json,
deterministic bytes and valid PNGs."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from report_helpers import Cli, assert_png, assert_tables_well_formed, image_links

from plamo2_tools.report import build_report

SECTION_ORDER = [
    "## lm-eval results",
    "## Verify",
    "## Convert benchmark",
    "## Kernel benchmark",
    "## Runtime throughput",
    "## Tool output",
    "## Inputs",
]


def test_mixed_directory_every_section_in_order(cli: Cli, fixtures: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "all.md"
    res = cli("report", fixtures, "--out", out, "--title", "All results", "--no-timestamp")
    md = out.read_text()
    assert md.startswith("# All results\n\n| Section | Files |")
    positions = [md.index(h) for h in SECTION_ORDER]
    assert positions == sorted(positions)
    assert_tables_well_formed(md)
    links = image_links(md)
    assert links == sorted(set(links), key=links.index)  # each plot once
    assert all("/" not in link for link in links)  # relative, beside the report
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["all.md", *links])
    for link in links:
        assert_png(out.parent / link)
    assert "wrote" in res.stdout and "5 plot(s) from 13 file(s)" in res.stdout


def test_unknown_json_is_skipped_with_a_note(fixtures: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Logged at INFO since issue 21 (not a warning per file: the README promises one line).
    with caplog.at_level(logging.INFO, logger="plamo2_tools.report"):
        result = build_report([fixtures / "other", fixtures / "tools" / "check.json"], tmp_path / "r.md")
    skipped = {Path(s.name).name: s.reason for s in result.skipped}
    assert skipped == {
        "broken.json": "not readable as JSON (JSONDecodeError)",
        "config.json": "not a recognised results file (keys: architectures, hidden_size, num_hidden_layers, "
        "model_type)",
        "samples_gsm8k.jsonl": "not a recognised results file (a JSON list)",
    }
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3 and all(n.startswith("skipped ") for n in notes)
    md = result.out.read_text()
    assert "Skipped:" in md and "config.json" in md and [d.kind for d in result.docs] == ["check"]


def test_nothing_usable_exits_2_with_one_line(cli: Cli, fixtures: Path, tmp_path: Path) -> None:
    res = cli("report", fixtures / "other", "--out", tmp_path / "r.md", expect=2)
    assert res.stderr.count("\n") <= 2 and "nothing usable" in res.stderr  # one error line (rich may wrap)
    assert "Traceback" not in res.stderr and not (tmp_path / "r.md").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "0 JSON file(s) found" in cli("report", empty, "--out", tmp_path / "r.md", expect=2).stderr
    assert "no such file" in cli("report", tmp_path / "missing", "--out", tmp_path / "r.md", expect=2).stderr
    assert "is a directory" in cli("report", fixtures / "tools", "--out", empty, expect=2).stderr


def test_json_summary(cli: Cli, fixtures: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    res = cli("report", fixtures / "verify", fixtures / "lm-eval", fixtures / "other", "--out", out, "--json")
    summary = json.loads(res.stdout)
    assert summary["sections"] == {"lm-eval": 3, "verify": 2}
    assert [f["kind"] for f in summary["files"]] == ["lm-eval"] * 3 + ["verify"] * 2
    assert len(summary["skipped"]) == 3
    assert summary["outputs"] == [str(out), str(tmp_path / "r-logit-error.png"), str(tmp_path / "r-logit-error-2.png")]
    assert all(Path(p).exists() for p in summary["outputs"])
    assert any("not comparable to the reference" in w for w in summary["warnings"])


def test_deterministic_bytes(cli: Cli, fixtures: Path, tmp_path: Path) -> None:
    """Two runs give identical Markdown and PNGs; the only time in the page is the 'generated' line."""
    out = tmp_path / "r.md"
    outputs = []
    for _ in range(2):
        cli("report", fixtures, "--out", out, "--no-timestamp")
        outputs.append({p.name: p.read_bytes() for p in sorted(tmp_path.iterdir())})
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
    assert outputs[0] == outputs[1]
    assert "Generated" not in outputs[0]["r.md"].decode()
    cli("report", fixtures / "tools", "--out", out, "--no-timestamp")  # small input: no plots to draw again
    md = out.read_text()
    cli("report", fixtures / "tools", "--out", out)
    stamped = out.read_text()
    generated = [line for line in stamped.splitlines() if line.startswith("_Generated ")]
    assert len(generated) == 1 and re.fullmatch(
        r"_Generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC by plamo2-tools .+\._", generated[0]
    )
    assert stamped.replace(generated[0] + "\n\n", "") == md


def test_input_order_does_not_matter(fixtures: Path, tmp_path: Path) -> None:
    inputs = [fixtures / "tools", fixtures / "other", fixtures / "lm-eval"]  # no plots: fast
    a = build_report(inputs, tmp_path / "a" / "r.md", timestamp=False).out.read_bytes()
    b = build_report(inputs[::-1], tmp_path / "b" / "r.md", timestamp=False).out.read_bytes()
    assert a == b
