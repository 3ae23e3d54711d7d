"""Issue 28 §2: batch files (`generate --input FILE --output FILE`) as safe as `convert`.  The
output is ours (its first line is our results header) or absent or empty, never someone else's
file; temporaries are created fresh (a planted link is removed, never written through); a dangling
link, a FIFO or a directory as --output is refused at once; a resume whose model or settings differ
is refused; a line beyond memory is exit 3 with one line, beyond --max-context an error record;
a second writer of one output exits 3 naming the first.

Through the real CLI in a subprocess: exit code, exactly one stderr line, no traceback, the
`outside` directory unchanged byte for byte.  Each test was seen failing on the code before this
change (`PLAMO2_CLI_ROOT=<checkout of 6fb717f>`, docs/security.md "Tests"); its docstring says how.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_env import ROOT, cli_env

REQUESTS = ['"Hello"', '{"prompt": [1, 5, 9], "max_tokens": 3}']


def _requests(work: Path, lines: list[str] = REQUESTS) -> Path:
    path = work / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _batch(run, shards: Path, src: Path, out: Path, *extra: str | int, **kw) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    return run("generate", shards, "--input", src, "--output", out, "--max-new-tokens", 2, "--json", *extra, **kw)


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_file_we_did_not_write_is_never_overwritten(run, one_line_error, tiny_shards, work, outside) -> None:
    """main: exit 0, and the user's notes were gone (replaced by results).  Also a results file of
    an older plamo2-tools (no header) is not taken for ours.  An empty file is: nothing to lose."""
    src = _requests(work)
    for content in (b"my notes, not results\n", b'{"index": 0, "input_sha256": "x", "choices": []}\n'):
        notes = work / "notes.jsonl"
        notes.write_bytes(content)
        line = one_line_error(_batch(run, tiny_shards, src, notes), 2)
        assert "did not write it" in line and "nothing was changed" in line, line
        assert notes.read_bytes() == content
    assert sorted(p.name for p in work.iterdir()) == ["in.jsonl", "notes.jsonl"]  # no temporary, no lock left
    empty = work / "empty.jsonl"
    empty.touch()
    _ok(_batch(run, tiny_shards, src, empty))
    assert len(empty.read_text().splitlines()) == 1 + len(REQUESTS)  # the header, then a record per line


def test_a_planted_temporary_link_is_not_written_through(run, tiny_shards, work, outside) -> None:
    """main wrote the results into outside/secret.txt through `.res.jsonl.tmp` and then renamed the
    link over the output: the output became a symbolic link to the overwritten secret."""
    src = _requests(work)
    out = work / "res.jsonl"
    (work / ".res.jsonl.tmp").symlink_to(outside.secret)
    _ok(_batch(run, tiny_shards, src, out))
    assert not out.is_symlink() and out.is_file()
    assert json.loads(out.read_text().splitlines()[0])["format"] == "plamo2-batch-results"
    assert sorted(p.name for p in work.iterdir()) == ["in.jsonl", "res.jsonl"]


def test_a_dangling_output_link_is_refused(run, one_line_error, tiny_shards, work, outside) -> None:
    """main created outside/new.jsonl, where the link pointed."""
    src = _requests(work)
    out = work / "res.jsonl"
    out.symlink_to(outside.path / "new.jsonl")
    line = one_line_error(_batch(run, tiny_shards, src, out), 2)
    assert "a symbolic link to" in line and "which does not exist" in line, line
    assert not (outside.path / "new.jsonl").exists() and out.is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_an_output_that_is_not_a_file_is_refused_at_once(
    run, one_line_error, tiny_shards, work, outside, kind: str
) -> None:
    """main: a FIFO as --output hung (reading it to resume); here the run has 60 s."""
    src = _requests(work)
    out = work / "res.jsonl"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "directory":
        out.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(out))
    line = one_line_error(_batch(run, tiny_shards, src, out, timeout=60), 2)
    assert "not a file" in line or "not a regular file" in line, line


def test_a_resume_with_another_model_or_settings_is_refused(run, one_line_error, tiny_shards, work, outside) -> None:
    """main matched records on the input line's hash alone: re-run with another model or another
    --max-new-tokens, it kept the old answers and exited 0.  Here: refused, naming what differs,
    the file byte for byte as it was; the same run resumes (nothing to do, the file unchanged)."""
    src = _requests(work)
    out = work / "res.jsonl"
    _ok(_batch(run, tiny_shards, src, out))
    before = out.read_bytes()
    line = one_line_error(_batch(run, tiny_shards, src, out, "--temperature", 0.5), 2)
    assert "holds the results of another run" in line and "--temperature 0.0 there, 0.5 now" in line, line
    line = one_line_error(run("generate", tiny_shards, "--input", src, "--output", out, "--json"), 2)
    assert "--max-new-tokens 2 there, 64 now" in line, line
    tp1 = work / "tp1"
    _ok(run("convert", tiny_shards, tp1, "--tp", 1, "--json"))
    line = one_line_error(_batch(run, tp1, src, out), 2)
    assert "another model" in line, line
    assert out.read_bytes() == before
    r = _batch(run, tiny_shards, src, out)
    _ok(r)
    assert json.loads(r.stdout)["skipped"] == len(REQUESTS) and out.read_bytes() == before


def test_a_line_beyond_memory_is_exit_3(run, one_line_error, checkpoint, work) -> None:
    """A model declaring 2**31 - 1 positions and a line asking for 2**30 tokens: main sized the KV
    cache by the longest line and ended in exit 70 (the loop's failure wrapped in an EngineError).
    Here the cap (`--max-context`, 4096 by default) refuses the line with an error record naming
    it, and where the user raises the cap past memory, the allocation failure is exit 3 with one
    line (address space capped at 6 GB, so the run fails the same way on any machine)."""
    ckpt = work / "ckpt"
    import shutil

    shutil.copytree(checkpoint("tiny"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = 2**31 - 1  # the most a config may declare (model/limits.py)
    (ckpt / "config.json").write_text(json.dumps(config))
    shards = work / "shards"
    _ok(run("convert", ckpt, shards, "--json"))
    src = _requests(work, [json.dumps({"prompt": [1, 2], "max_tokens": 2**30})])
    out = work / "res.jsonl"
    line = one_line_error(
        _batch(run, shards, src, out, "--strict", memory=6 << 30), 2
    )  # capped: a mutant lifts the cap
    assert "maximum context length is 4096" in line and "--max-context 4096" in line, line
    r = _batch(run, shards, src, out, "--max-context", 2**30 + 2, memory=6 << 30, timeout=300)
    line = one_line_error(r, 3)
    assert line.startswith("error: out of memory (CPU)"), line
    assert not out.exists() or len(out.read_text().splitlines()) <= 1  # nothing that looks like a result


def test_a_second_writer_is_refused_naming_the_first(run, one_line_error, tiny_shards, work) -> None:
    """main: both runs did the whole file, each appending its own answers to the one output."""
    src = _requests(work, [json.dumps({"prompt": [1, 5 + i], "max_tokens": 200, "ignore_eos": True}) for i in range(8)])
    out = work / "res.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "plamo2_tools.cli",
        "generate",
        str(tiny_shards),
        "--input",
        str(src),
        "--output",
        str(out),
        "--max-batch",
        "1",
        "--json",
    ]
    # SIGINT at its default, as a terminal's Ctrl-C finds a foreground process: a test run started in
    # the background (CI's second pass runs under `trap '' INT`) would hand the child an ignored SIGINT.
    first = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        lock = work / ".res.jsonl.plamo2.lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "the first writer ended before the second"
            time.sleep(0.05)
        line = one_line_error(_batch(run, tiny_shards, src, out), 3)
        assert "is being written by `plamo2-tools generate`" in line and f"pid {first.pid}" in line, line
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert not (work / ".res.jsonl.plamo2.lock").exists()


def test_lines_and_records_nested_too_deeply(run, one_line_error, tiny_shards, work) -> None:
    """Found by the batch-file fuzz target: a results record of ours nested past Python's recursion
    limit (RecursionError while resuming: exit 70) is dropped like a cut line and redone; an input
    line nested so deep is a refused line.  On 6fb717f both were exit 70, seen by hand (this test
    fails there earlier: its results files have no header)."""
    deep = "[" * 100_000 + "]" * 100_000
    src = _requests(work)
    out = work / "res.jsonl"
    _ok(_batch(run, tiny_shards, src, out))
    clean = out.read_bytes()
    header, first, second = clean.decode().splitlines()
    out.write_text(f"{header}\n{deep}\n{second}\n")
    r = _batch(run, tiny_shards, src, out)
    _ok(r)
    assert json.loads(r.stdout)["ran"] == 1 and out.read_bytes() == clean
    line = one_line_error(
        _batch(run, tiny_shards, _requests(work, [REQUESTS[0], deep]), work / "b.jsonl", "--strict"), 2
    )
    assert "line 2: not valid JSON: nested too deeply" in line, line
