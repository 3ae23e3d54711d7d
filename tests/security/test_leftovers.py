"""Issue 21, class 5: our own leftovers are ours.  A re-run after `kill -9` of a merge or a
convert recognises the partial files it left and continues without --force (before: merge's own
`.partial` counted as someone else's file); an interrupted or refused `tokenize --out` leaves
nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_env import ROOT, cli_env

MANIFEST = "plamo2_shards.json"
JOURNAL = ".plamo2_convert.journal.jsonl"


def _start(*args: str | Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "plamo2_tools.cli", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(), cwd=ROOT)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled every 2 ms); fail if it never does."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"finished before it could be killed: {proc.stderr.read().decode()[-400:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("never reached the point to kill it at")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


@pytest.fixture(scope="module")
def medium_shards(cli, medium_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("medium-shards") / "shards"
    cli("convert", medium_checkpoint, out, "--tp", 2, "--json")
    return out


def test_killed_merge_reruns_without_force(cli, run, medium_shards: Path, work: Path) -> None:
    reference = work / "reference"
    cli("merge", medium_shards, reference, "--max-part-size", "20MB", "--json")
    out = work / "merged"
    proc = _start("merge", medium_shards, out, "--max-part-size", "20MB")
    _kill_when(proc, lambda: any(p.name.endswith(".partial") for p in out.glob("*")) if out.exists() else False)
    assert not (out / "config.json").exists()  # never looks complete
    left = sorted(p.name for p in out.iterdir())
    assert any(n.endswith(".partial") for n in left), left
    r = run("inspect", out)  # every reader says what to do, and that is what works
    assert r.returncode == 2 and "run the same merge again" in r.stderr
    r = run("merge", medium_shards, out, "--max-part-size", "20MB")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for p in reference.iterdir():
        if p.name != ".plamo2_written.json":  # names the source path, same in both
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_killed_convert_resumes_without_force(cli, run, medium_checkpoint: Path, work: Path) -> None:
    out = work / "out"
    split = ("--tp", 2, "--pp", 2, "--max-part-size", "1MB")
    proc = _start("convert", medium_checkpoint, out, *split)

    def some_finished() -> bool:
        try:
            return len((out / JOURNAL).read_text().splitlines()) >= 4
        except OSError:
            return False

    _kill_when(proc, some_finished)
    assert not (out / MANIFEST).exists()
    r = run("convert", medium_checkpoint, out, *split, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "resumed"
    assert not list(out.glob("*.partial")) and not (out / JOURNAL).exists()
    assert run("check", out).returncode == 0


def test_refused_tokenize_input_leaves_nothing(run, one_line_error, checkpoint, work: Path) -> None:
    out = work / "ids.jsonl"
    line = one_line_error(run("tokenize", checkpoint("tiny"), "--out", out, input='"fine"\n42\n'), 2)
    assert "stdin:2: expected a string" in line
    assert list(work.iterdir()) == []


def test_interrupted_tokenize_leaves_nothing(checkpoint, work: Path) -> None:
    """Ctrl-C while tokenize waits for more input: exit 130, no FILE and no FILE.partial."""
    out = work / "ids.jsonl"
    cmd = [sys.executable, "-m", "plamo2_tools.cli", "tokenize", checkpoint("tiny"), "--out", out]
    # Ctrl-C reaches a foreground process with SIGINT at its default; a test run started in the
    # background (CI, `nohup`, `&` in a script) ignores SIGINT and its children inherit that.
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    proc.stdin.write('"hello"\n')
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not (work / "ids.jsonl.partial").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # reading the next line now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert list(work.iterdir()) == []


def test_tokenize_after_a_killed_one(run, checkpoint, work: Path) -> None:
    """A FILE.partial left by a kill -9 is ours: the next run replaces it."""
    (work / "ids.jsonl.partial").write_text("[1, 2")
    r = run("tokenize", checkpoint("tiny"), "--out", work / "ids.jsonl", input='"a"\n"b"\n')
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["ids.jsonl"]
    assert len((work / "ids.jsonl").read_text().splitlines()) == 2


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_interrupted_words_match_what_works() -> None:
    """What the CLI says after an interrupted merge is what the test above shows to work."""
    from plamo2_tools.cli.errors import INTERRUPTED

    assert "run the same merge again" in INTERRUPTED["merge"]
    assert "run the same convert again" in INTERRUPTED["convert"]
