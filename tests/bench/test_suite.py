"""The benchmark suite's shape (bench/, docs/benchmarks.md): every benchmark one module of the
registry with the common options, loading nothing heavy until it runs; one result file per run,
the envelope (machine, commit, command, start, completeness) around the benchmark's own results,
which `plamo2-tools report` renders; a run cut by its deadline or stopped by an error says so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import ROOT, bench, env

from bench import BENCHMARKS, load
from bench.__main__ import parser
from bench.common import COMMIT_ENV, commit
from plamo2_tools.kinds import BENCH_E2E_KIND, BENCH_SCHEMA_VERSION, BENCH_THROUGHPUT_KIND
from plamo2_tools.report.inputs import classify

ENVELOPE = {
    "kind",
    "schema_version",
    "benchmark",
    "label",
    "note",
    "machine",
    "commit",
    "dirty",
    "command",
    "started_at",
    "finished_at",
    "wall_s",
    "complete",
    "skipped",
    "error",
    "args",
    "inputs",
    "results",
}
TINY = ("--preset", "tiny", "--dtype", "float32", "--device", "cpu")


def test_the_suite_loads_without_torch() -> None:
    """`python -m bench --list` and the session driver import every module of the registry; none may
    load PyTorch, Triton or the runtime at import (the convert benchmark times a torch-free process,
    and a session should not pay seconds of imports per listing).  Shown to fail with `import torch`
    at the top of bench/throughput.py."""
    probe = (
        "import sys, bench, bench.session, bench.__main__\n"
        "[bench.load(n) for n in bench.BENCHMARKS]\n"
        "print(sorted(m for m in ('torch', 'triton', 'plamo2_tools.runtime') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_has_the_common_options(name: str) -> None:
    module = load(name)
    sub = next(a for a in parser()._subparsers._group_actions if a.dest == "benchmark").choices[name]  # type: ignore[union-attr]
    options = {o for a in sub._actions for o in a.option_strings}
    assert {"--out", "--label", "--note", "--max-seconds", "--work"} <= options
    model = {"--shards", "--preset", "--dtype", "--layout", "--device"}
    assert (model <= options) == module.MODEL, (name, sorted(options))
    assert callable(module.add_arguments) and callable(module.run) and (module.__doc__ or "").strip()


def git_head() -> str | None:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def test_e2e_writes_the_envelope_and_the_report_renders_it(cli, tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    bench(
        "e2e",
        *TINY,
        "--steps",
        "help,inspect,check",
        "--repeat",
        "2",
        "--work",
        tmp_path / "w",
        "--label",
        "tiny e2e",
        "--out",
        out,
    )
    data = json.loads(out.read_text())
    assert set(data) == ENVELOPE
    assert (data["kind"], data["schema_version"], data["benchmark"]) == (BENCH_E2E_KIND, BENCH_SCHEMA_VERSION, "e2e")
    assert data["complete"] is True and data["skipped"] == [] and data["error"] is None
    assert data["commit"] == git_head() and data["command"].startswith("python -m bench e2e --preset tiny")
    assert data["machine"]["cpus"] >= 1 and data["machine"]["card"] and data["inputs"]["reused"] is False
    records = data["results"]["records"]
    assert [(r["pass"], r["step"]) for r in records] == [
        (p, s) for p in (1, 2) for s in ("python", "help", "inspect", "check")
    ]
    assert all(r["rc"] == 0 and r["wall_s"] > 0 for r in records)
    assert [r["fresh"] for r in records] == [True] * 4 + [False] * 4
    assert classify(data) == ("bench-e2e", "")
    report = tmp_path / "report.md"
    cli("report", out, "--out", report)
    text = report.read_text()
    assert "## The README's commands from the shell" in text and "**tiny e2e**" in text
    assert "| inspect |" in text and "`plamo2-tools inspect " in text


def test_the_commit_is_this_trees_or_the_one_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the tree inside another checkout (how a device machine holds it) has no commit of its
    own: git would name the outer repository's.  Shown to fail with commit() asking git alone."""
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    for args in (
        ["init", "-q"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
    ):
        subprocess.run(["git", "-C", str(outer), *args], check=True)
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert commit(outer / "copy") == (None, None)
    assert commit(ROOT)[0] == git_head()
    monkeypatch.setenv(COMMIT_ENV, "abc123+dirty")
    assert commit(outer / "copy") == commit(ROOT) == ("abc123", True)
    monkeypatch.setenv(COMMIT_ENV, "abc123")
    assert commit(outer / "copy") == ("abc123", None)


def test_a_run_cut_by_its_deadline_says_what_it_left_out(cli, tmp_path: Path) -> None:
    """--max-seconds 1: making the model takes longer, so no step starts; the file says so, and the
    report marks it incomplete.  Shown to fail with Result.save ignoring `skipped`."""
    out = tmp_path / "e2e.json"
    bench("e2e", *TINY, "--steps", "help", "--repeat", "1", "--max-seconds", "1", "--out", out)
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["error"] is None
    assert data["skipped"] == ["pass 1 python (this)", "pass 1 help (this)"] and data["results"]["records"] == []
    report = tmp_path / "report.md"
    cli("report", out, "--out", report)
    assert "**incomplete** (skipped: pass 1 python (this), pass 1 help (this))" in report.read_text()


def test_a_crash_keeps_the_file_with_its_error(cli, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    (tmp_path / "empty").mkdir()
    proc = bench("throughput", "--shards", tmp_path / "empty", "--device", "cpu", "--out", out, expect=1)
    assert f"throughput failed: what ran is in {out}" in proc.stderr
    data = json.loads(out.read_text())
    assert (data["kind"], data["complete"]) == (BENCH_THROUGHPUT_KIND, False)
    assert data["error"] and str(tmp_path / "empty") in data["error"]
    report = tmp_path / "report.md"
    cli("report", out, "--out", report)
    assert "**stopped by an error**" in report.read_text()


def test_each_tree_runs_its_own_code(tmp_path: Path) -> None:
    """--tree NAME=PATH runs the commands from PATH, not from this tree: a copy whose CLI exits 7 must
    show 7 in its records and only there.  Shown to fail when the steps ran with this tree as their
    working directory (`python -m` puts it ahead of PYTHONPATH)."""
    planted = tmp_path / "planted"
    shutil.copytree(ROOT / "plamo2_tools", planted / "plamo2_tools", ignore=shutil.ignore_patterns("__pycache__"))
    (planted / "plamo2_tools" / "cli" / "__main__.py").write_text("raise SystemExit(7)\n")
    out = tmp_path / "e2e.json"
    bench("e2e", *TINY, "--steps", "help", "--repeat", "1", "--tree", f"planted={planted}", "--out", out)
    records = json.loads(out.read_text())["results"]["records"]
    assert {(r["step"], r["tree"], r["rc"]) for r in records} == {
        ("python", "this", 0),
        ("python", "planted", 0),
        ("help", "this", 0),
        ("help", "planted", 7),
    }


def test_a_bad_tree_is_refused(tmp_path: Path) -> None:
    proc = bench("e2e", *TINY, "--tree", f"old={tmp_path}", "--out", tmp_path / "e.json", expect=None)
    assert proc.returncode != 0 and "give NAME=PATH of a source tree holding plamo2_tools/" in proc.stderr
