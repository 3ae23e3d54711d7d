"""One output file, ours or refused: the rule `convert` and `merge` keep for a directory ("never
write over a file we did not write", docs/security.md), for a command whose output is one file
(`generate --input --output FILE`; `export gguf` will want the same).

* The path the user names may be a symbolic link to an existing file (the user's choice, as for
  every argument we are given); a link to nothing is refused: following it would create a file
  wherever it points.
* What stands there must be a regular file: a FIFO, socket, device or directory is refused at once,
  never opened for reading or writing (a FIFO would block us forever).
* An existing file is appended to or replaced only when it is ours, which the file's format says
  (`is_ours(first bytes)`: a batch results file starts with its header line).  An empty file is
  taken: there is nothing in it to lose.  Anything else is one line naming the file and what to do.
* One writer at a time: `.NAME.plamo2.lock` beside the file, held for the whole run (a second
  writer exits 3 naming the first; a lock left by a killed run is taken over).
* The file is replaced only whole, by rename from `.NAME.tmp` created fresh (O_EXCL | O_NOFOLLOW:
  a link planted at the temporary name is removed, never written through), and appended to only
  through a descriptor opened O_NOFOLLOW | O_APPEND on the file judged above (the same inode).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import OutputExistsError, UserError
from .output_lock import OutputLock
from .safe_files import create_fresh, kind_of, open_regular, write_all, write_error

HEAD_BYTES = 64 * 1024  # what `is_ours` sees of an existing file


def resolve_output(path: Path, option: str) -> Path:
    """The file to write: `path`, or the existing file a symbolic link there points to.  One line
    for a dangling link, something that is not a regular file, or a missing directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise write_error(e, path) from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        if not target.exists():
            raise UserError(
                f"{option} {path}: a symbolic link to {target}, which does not exist: refused "
                "(plamo2-tools would create a file there); name the file itself"
            )
        path, st = target, os.stat(target)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{option} {path}: is {kind_of(st.st_mode)}, not a regular file: refused")
    if not path.parent.is_dir():
        raise UserError(f"{option} {path}: the directory {path.parent} does not exist")
    return path


class SingleFileOutput:
    """An output file that is ours (or absent, or empty) for as long as this object holds its lock.
    Use as a context manager; `close()` lets the lock go."""

    def __init__(
        self,
        path: Path,
        option: str,
        command: str,
        is_ours: Callable[[bytes], bool],
        how_to_proceed: str = "move it away or name another file",
    ) -> None:
        self.option = option
        self.path = resolve_output(Path(path), option)
        self.lock = OutputLock(
            self.path.parent, command, name=f".{self.path.name}.plamo2.lock", what=f"{option} {self.path}"
        )
        try:
            head = self.head()
            if head and not is_ours(head):
                raise OutputExistsError(
                    f"{option} {self.path}: exists and plamo2-tools did not write it: "
                    f"refused, nothing was changed ({how_to_proceed})"
                )
        except BaseException:
            self.close()
            raise

    @property
    def tmp(self) -> Path:
        return self.path.with_name(f".{self.path.name}.tmp")

    def _open(self, flags: int) -> int:
        """The file itself, never through a link (a link planted since we resolved it is refused)."""
        return open_regular(self.path, flags, follow=False)

    def head(self, size: int = HEAD_BYTES) -> bytes:
        """The first bytes of the file (b"" when there is none)."""
        if not os.path.lexists(self.path):
            return b""
        fd = self._open(os.O_RDONLY)
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def read(self) -> bytes:
        """The whole file (b"" when there is none)."""
        if not os.path.lexists(self.path):
            return b""
        fd = self._open(os.O_RDONLY)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def replace(self, chunks: Iterable[bytes]) -> None:
        """The file's new content, whole: written to `.NAME.tmp` (created fresh), fsync'd, renamed
        over the file, the directory fsync'd.  A kill leaves the old file or the new one."""
        fd = create_fresh(self.tmp, os.O_WRONLY)
        try:
            for chunk in chunks:
                write_all(fd, chunk, self.path)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise write_error(e, self.path) from None
        _fsync_dir(self.path.parent)

    def append_fd(self) -> int:
        """A descriptor appending to the file (created first, empty, when absent: by `replace`, so
        never through a link).  The caller closes it, and before any `replace` (which makes a new
        file: appends to the old descriptor would be lost)."""
        if not os.path.lexists(self.path):
            self.replace([])
        return self._open(os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> SingleFileOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the rename stands
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
