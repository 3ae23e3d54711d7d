"""`python -m bench.session`: several benchmarks within a deadline, each given what is left, the model
made once and reused, the results, logs and report tarred under OUT; a benchmark that does not fit
is skipped, one that runs past is stopped with its whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench_helpers import ROOT, bench, env

from bench.session import stop

TINY = ("--preset", "tiny", "--dtype", "float32")


def no_wheels(tmp_path: Path) -> tuple[str, str]:
    """A session installs the checkout's `.whl/` first when there is one (a developer's, git-ignored,
    carried to GPU machines): the tests name an empty place instead, so the steps they expect do not
    depend on what this checkout holds (seen failing with `.whl/` present: a `wheels` step first)."""
    return ("--wheels", str(tmp_path / "no-wheels"))


def test_a_session_runs_its_benchmarks_and_tars_them(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    bench(
        "--deadline",
        600,
        "--out",
        out,
        "--work",
        work,
        *no_wheels(tmp_path),
        *TINY,
        "e2e --device cpu --steps help,check --repeat 1",
        "e2e --device cpu --steps inspect --repeat 1",
        module="bench.session",
    )
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "session.json", "session.tar.gz"]  # few files back
    with tarfile.open(out / "session.tar.gz") as tar:
        names = set(tar.getnames())
        first, second = (json.load(tar.extractfile(f"results/{n}.json")) for n in ("e2e", "e2e-2"))  # type: ignore[arg-type]
    assert first["complete"] and second["complete"]
    assert first["inputs"]["reused"] is False and second["inputs"]["reused"] is True  # one model for the session
    assert first["inputs"]["checkpoint"].startswith(str(work)) and first["args"]["preset"] == "tiny"
    assert first["args"]["max_seconds"] < 600  # given what was left
    log = json.loads((out / "session.json").read_text())
    assert [(s["name"], s["rc"]) for s in log["steps"]] == [("e2e", 0), ("e2e-2", 0), ("report", 0)]
    assert log["commit"] == first["commit"] == second["commit"]
    assert "## The README's commands from the shell" in (out / "report.md").read_text()
    assert {"results/e2e.json", "results/e2e-2.json", "logs/session.json", "logs/e2e.log", "report.md"} <= names


def test_a_benchmark_that_does_not_fit_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bench(
        "--deadline",
        60,
        "--min-seconds",
        1000,
        "--out",
        out,
        "--work",
        tmp_path / "w",
        *no_wheels(tmp_path),
        "e2e",
        "kernels --smoke",
        module="bench.session",
    )
    log = json.loads((out / "session.json").read_text())
    assert [(s["name"], "skipped" in s) for s in log["steps"]] == [("e2e", True), ("kernels", True)]
    assert not list((tmp_path / "w" / "session" / "results").iterdir()) and (out / "session.tar.gz").exists()


def test_an_unknown_benchmark_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = bench(
        "--out", tmp_path / "out", "--work", tmp_path / "w", "e2e", "nope --x", module="bench.session", expect=None
    )
    assert proc.returncode != 0 and "unknown benchmark 'nope'" in proc.stderr
    assert not (tmp_path / "out" / "session.json").exists()


def test_a_stopped_benchmark_leaves_its_file_saying_so(tmp_path: Path) -> None:
    """What the session's stop does to a benchmark: SIGTERM once it has saved a step; the file keeps
    that step, says it was stopped, and the exit is 143.  Shown to fail without the SIGTERM handler
    (the file then still reads as a run in progress, with no error)."""
    out = tmp_path / "e2e.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench",
            "e2e",
            *TINY,
            "--device",
            "cpu",
            "--steps",
            "help",
            "--repeat",
            "200",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1200):
            if out.exists() and json.loads(out.read_text())["results"].get("records"):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no step saved in 120 s")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    data = json.loads(out.read_text())
    assert data["error"] == "stopped (SIGTERM: past its deadline)" and data["complete"] is False
    assert data["results"]["records"]


def test_stop_ends_the_whole_group() -> None:
    """A benchmark's children (torchrun ranks, a server) go with it.  Shown to fail with os.kill of
    the leader only: the backgrounded sleep outlives it."""
    proc = subprocess.Popen(
        ["bash", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert stop(proc) == 124 and proc.returncode is not None
    for _ in range(100):  # reparented and reaped by init, or still a zombie for a moment
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        raise AssertionError("the backgrounded child outlived stop()")
