"""The output lock's corner cases (issue 24): a writer that locked a file its predecessor had just
unlinked, readers next to a dead writer's leftover lock file, readers next to each other, and a
file system without locks.

The interleavings are made with the real calls: the predecessor's `release()` runs at the exact
moment between the newcomer's open and its flock, and a dead writer is a real process that took
the lock and died without releasing it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plamo2_tools.errors import OutputBusyError
from plamo2_tools.shards import lock
from plamo2_tools.shards.lock import LOCK_NAME, OutputLock, ensure_not_being_written


def test_a_lock_on_a_just_unlinked_file_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B opens the lock file; A finishes (unlinks it, lets go); B's flock then succeeds on an orphan.
    B must notice and lock the file that is really there, so that C is refused."""
    a = OutputLock(tmp_path, "convert")
    real_open, opened = os.open, []

    def open_then_a_finishes(path: object, flags: int, *args: object) -> int:
        fd = real_open(path, flags, *args)  # type: ignore[arg-type]
        if Path(str(path)).name == LOCK_NAME and not opened:
            opened.append(fd)
            a.release()
        return fd

    monkeypatch.setattr(os, "open", open_then_a_finishes)
    b = OutputLock(tmp_path, "merge")
    monkeypatch.setattr(os, "open", real_open)
    assert opened and os.fstat(b.fd).st_ino == os.stat(tmp_path / LOCK_NAME).st_ino
    with pytest.raises(OutputBusyError, match="being written by `plamo2-tools merge`"):
        OutputLock(tmp_path, "convert")
    b.release()


def _dead_writer(directory: Path) -> int:
    """A real process that takes the lock and dies without releasing it (kill -9 leaves the same)."""
    code = (
        "import os, sys\n"
        "from plamo2_tools.shards.lock import OutputLock\n"
        "OutputLock(sys.argv[1], 'convert')\n"
        "print(os.getpid(), flush=True)\n"
        "os._exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(lock.__file__).parents[2])},
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip())


def test_readers_pass_a_dead_writers_lock_and_each_other(tmp_path: Path) -> None:
    pid = _dead_writer(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == pid  # left behind
    ensure_not_being_written(tmp_path)
    # Another reader is in the middle of its own check (holding the shared lock) right now.
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        ensure_not_being_written(tmp_path)
    finally:
        os.close(fd)
    taken = OutputLock(tmp_path, "merge")
    assert taken.taken_over is not None and taken.taken_over.pid == pid
    taken.release()
    assert not (tmp_path / LOCK_NAME).exists()  # a finished writer leaves nothing that looks dead
    again = OutputLock(tmp_path, "merge")
    assert again.taken_over is None
    again.release()


def test_a_live_writer_refuses_readers_with_exit_3(cli, one_line_error, shards, private_copy) -> None:  # type: ignore[no-untyped-def]
    out = private_copy(shards("tiny", 2, 1))
    with OutputLock(out, "convert"):
        line = one_line_error(cli("check", out, expect=3), 3)
        assert "still being written by `plamo2-tools convert`" in line
    cli("check", out, "--json")


def test_check_passes_with_a_dead_writers_lock_left(cli, shards, private_copy) -> None:  # type: ignore[no-untyped-def]
    out = private_copy(shards("tiny", 2, 1))
    _dead_writer(out)
    cli("check", out, "--json")


def test_readers_on_a_file_system_without_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock failing with ENOLCK (an NFS mount without a lock daemon): a reader has nothing to go on
    and reads; only writers need the lock."""
    (tmp_path / LOCK_NAME).write_text("")

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ensure_not_being_written(tmp_path)
