"""Who is writing a directory, or a single output file.

`convert` and `merge` hold an exclusive `flock` on `OUT/.plamo2.lock` for their whole run; the file
names the holder (pid, host, command, start time) so that a refused second writer, or a reader of
the half-written directory, can say who it is.  The kernel drops a flock when its process ends,
however it ends, so a lock left behind by `kill -9` (or a power cut) is free: the next writer
takes it over and says whose it was.  On NFS, Linux maps flock to POSIX locks, which the server
arbitrates across hosts.

Readers (`load_manifest`, the HF sources of convert and verify, inspect) call
`ensure_not_being_written`: it tries a shared lock without waiting, so it refuses exactly while a
writer is running, and ignores a leftover lock file.  It needs no write access to the directory.

A command whose output is one file (`generate --input --output FILE`, `file_output.py`) locks
`.FILE.plamo2.lock` beside it instead (`OutputLock(directory, command, name=...)`), so two such
outputs in one directory do not exclude each other.  (The lock lived in `shards/lock.py` until the
single-file writers needed it: it is a file rule of the foundation, not a fact of the shard format.)
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, EnvironmentLimitError, OutputBusyError, Plamo2Error, UserError
from .jsonio import parse_json
from .safe_files import kind_of, open_regular

LOCK_NAME = ".plamo2.lock"
log = logging.getLogger("plamo2_tools.lock")


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the process that holds (or held) it."""

    pid: int | None
    host: str | None
    command: str | None
    started: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "another process (it has not recorded itself yet)"
        since = f", since {self.started}" if self.started else ""
        return f"`plamo2-tools {self.command}` (pid {self.pid} on {self.host}{since})"


def _read_holder(fd: int) -> Holder | None:
    """The holder recorded in an open lock file; None when the file is empty."""
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        data = parse_json(raw, "lock")
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("command")), str(data.get("started")))
    except (CheckpointError, ValueError, KeyError, TypeError, OverflowError):
        return Holder(None, None, None, None)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class OutputLock:
    """An exclusive lock on a directory for one writer.  Use as a context manager, or `release()`."""

    def __init__(self, directory: str | Path, command: str, name: str = LOCK_NAME, what: str | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / name
        self.what = what or str(self.directory)  # what a refused second writer is told is busy
        self.command = command
        self.taken_over: Holder | None = None  # the dead writer whose lock this one replaced
        self.fd = self._acquire()

    def _acquire(self) -> int:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd) or Holder(None, None, None, None)
                os.close(fd)
                raise OutputBusyError(
                    f"{self.what} is being written by {holder.describe()}; wait for it to finish or stop it"
                ) from None
            except OSError as e:
                os.close(fd)
                raise EnvironmentLimitError(
                    f"{self.path}: cannot take the output lock ({e.strerror or e}): this file system has no file locks"
                ) from None
            # A writer that has just finished unlinks the file it locked; having locked that orphan,
            # we would not exclude a third writer that creates a new one.  Try again on the new file.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        self.taken_over = _read_holder(fd)
        if self.taken_over is not None:
            who = self.taken_over.describe() if self.taken_over.pid is not None else "an unknown writer"
            log.warning("%s: taking over the lock left by %s, which is no longer running", self.what, who)
        self._record(fd)
        return fd

    def _open(self) -> int:
        """The lock file, never through a symlink and never a FIFO, device or directory (a planted
        link made us truncate the file it pointed to; a FIFO made readers hang)."""
        try:
            return open_regular(self.path, os.O_RDWR, follow=False, create=True)
        except EnvironmentLimitError as e:  # read-only, permissions: the machine's refusal
            raise EnvironmentLimitError(f"{self.directory}: cannot write there ({e})") from None

    def _record(self, fd: int) -> None:
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "started": started}
        data = (json.dumps(me) + "\n").encode()
        try:
            if os.fstat(fd).st_size:  # a dead writer's record
                os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as e:
            os.close(fd)
            raise EnvironmentLimitError(f"{self.path}: {e.strerror or e}") from None

    def release(self) -> None:
        """Unlink the file while still holding it (so nobody mistakes it for a dead writer's), then
        let go.  Idempotent."""
        if self.fd < 0:
            return
        # Failures here cost nothing: the lock goes with the descriptor, and a leftover file is
        # taken over by the next writer.
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def ensure_not_being_written(directory: str | Path) -> None:
    """Refuse (exit 3, naming the writer) while convert or merge is writing `directory`."""
    directory = Path(directory)
    path = directory / LOCK_NAME
    try:
        st = os.lstat(path)
    except OSError:  # no lock file: the usual case
        return
    if not stat.S_ISREG(st.st_mode):  # a symlink, FIFO or directory: refused at once, never waited on
        raise UserError(
            f"{path}: is {kind_of(st.st_mode)}, not a regular file (plamo2-tools never makes one): remove it"
        )
    try:
        fd = open_regular(path, follow=False)
    except Plamo2Error:  # one we cannot read, or gone since: nothing to go on
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or Holder(None, None, None, None)
            raise OutputBusyError(
                f"{directory} is still being written by {holder.describe()}; wait for it to finish"
            ) from None
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
