"""The file rules behind "nothing outside the output directory is ever touched" (docs/security.md):

* names read from files (manifests, journals, indexes, records) are plain names: `plain_name`;
* what we write is created fresh: a stale entry of that name is unlinked (which never follows a
  symlink) and the file is created with O_EXCL | O_NOFOLLOW, so a planted symlink, FIFO or hard
  link is never written through: `create_fresh`, `copy_file`;
* what we read is a regular file, checked on the open descriptor, opened with O_NONBLOCK so that
  a FIFO where a file should be is refused at once instead of blocking: `open_regular`,
  `read_regular`;
* a source directory's files may be symlinks only into the directory itself or its Hugging Face
  cache repository (`snapshots/<rev>/x -> ../../blobs/<sha>`): `ensure_inside_source`.

Only the foundation's error model is used, so every layer can call these.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Protocol

from .errors import CheckpointError, EnvironmentLimitError, UserError, os_error

COPY_CHUNK = 1 << 20


class Hasher(Protocol):
    def update(self, data: bytes, /) -> object: ...


# ---- names ------------------------------------------------------------------------------------
def name_problem(name: object) -> str | None:
    """Why `name` is not a plain file name inside a directory (None: it is one)."""
    if not isinstance(name, str):
        return "not a string"
    if not name or name in (".", ".."):
        return "empty or a directory" if name else "empty"
    if "/" in name or "\\" in name:
        return "has a path separator"
    if "\0" in name:
        return "has a NUL byte"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "longer than 255 bytes"
    return None


def plain_name(name: object, where: str) -> str:
    """`name` if it is a plain name (no separator, not `.`/`..`, not absolute, no NUL); else one
    line naming the file it came from (`where`) and the entry: exit 2."""
    problem = name_problem(name)
    if problem is not None:
        raise CheckpointError(f"{where}: entry {name!r} is not a plain file name ({problem}): refused")
    return name  # type: ignore[return-value]


# ---- reading ------------------------------------------------------------------------------------
def kind_of(mode: int) -> str:
    """A file type in words, for messages ("a FIFO", "a symbolic link", ...)."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISLNK, "a symbolic link"),
    )
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def open_regular(path: Path, flags: int = os.O_RDONLY, follow: bool = True, create: bool = False) -> int:
    """A descriptor on the regular file at `path`.  O_NONBLOCK at open: a FIFO or device opens
    (or fails) at once and is then refused by fstat; `follow=False` refuses a symlink (ELOOP)."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise UserError(f"{path}: is a symbolic link; plamo2-tools never makes one here: remove it") from None
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader, a socket
            raise UserError(f"{path}: not a regular file: refused") from None
        if e.errno == errno.EISDIR:
            raise UserError(f"{path}: is a directory, not a regular file: refused") from None
        raise os_error(e, f"{path}: cannot open") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UserError(f"{path}: is {kind_of(mode)}, not a regular file: refused")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (one line otherwise)."""
    fd = open_regular(path, follow=follow)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path}: {size} bytes, more than the {limit} this kind of file may have: refused")
        chunks, total = [], 0
        while chunk := os.read(fd, min(COPY_CHUNK, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while we read
                raise CheckpointError(f"{path}: more than {limit} bytes: refused")
        return b"".join(chunks)
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None
    finally:
        os.close(fd)


# ---- writing ------------------------------------------------------------------------------------
def create_fresh(path: Path, flags: int = os.O_RDWR, mode: int = 0o644) -> int:
    """Create `path` as a new regular file of ours.  What stood there (a stale temporary of ours,
    or something planted) is unlinked first: unlink removes the name, never what a symlink points
    to.  O_EXCL | O_NOFOLLOW then guarantees the descriptor is a file we just created."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"{path}: is a directory where plamo2-tools writes a file: move it away")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(e, f"{path}: cannot replace") from None
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:  # someone made it between our unlink and our open
        raise EnvironmentLimitError(f"{path}: appeared while plamo2-tools was creating it: refused") from None
    except OSError as e:
        raise write_error(e, path) from None


def write_error(e: OSError, path: Path) -> EnvironmentLimitError | UserError:
    """A failed write as one line; a full disk names the filesystem that is full."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = mount_point(path)
        return EnvironmentLimitError(f"{path}: no space left on device (the filesystem mounted at {where} is full)")
    return os_error(e, f"{path}: cannot write")  # type: ignore[return-value]


def write_all(fd: int, data: bytes | memoryview, path: Path) -> None:
    view = memoryview(data).cast("B")
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        raise write_error(e, path) from None


def copy_file(src: Path, dst: Path, hasher: Hasher | None = None, durable: bool = True) -> int:
    """Copy a (regular) source file to `dst` through `dst.tmp` created fresh, fsync'd (when
    `durable`: convert --sync none asks for no fsync at all), renamed: a
    symlink planted at either name is replaced, never written through, and a reader never sees
    half a file.  A full disk names `dst`'s filesystem, not the source.  Returns the bytes copied;
    `hasher` sees every one of them (the digest recorded is of exactly what was written)."""
    size = 0
    tmp = dst.with_name(dst.name + ".tmp")
    fd_in = open_regular(src)
    try:
        fd_out = create_fresh(tmp, os.O_WRONLY)
        try:
            while chunk := _read(fd_in, src):
                write_all(fd_out, chunk, dst)
                size += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
            if durable:
                os.fsync(fd_out)
        except BaseException:
            os.close(fd_out)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd_out)
    finally:
        os.close(fd_in)
    os.replace(tmp, dst)
    return size


def hash_file(path: Path, hasher: Hasher, follow: bool = False) -> int:
    """Feed a regular file's bytes to `hasher` (never through a symlink unless `follow`); its size."""
    fd = open_regular(path, follow=follow)
    size = 0
    try:
        while chunk := _read(fd, path):
            hasher.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size


def _read(fd: int, path: Path) -> bytes:
    try:
        return os.read(fd, COPY_CHUNK)
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        dev = p.stat().st_dev
        while p != p.parent and p.parent.stat().st_dev == dev:
            p = p.parent
    except OSError:
        pass
    return p


# ---- sources ------------------------------------------------------------------------------------
def source_roots(directory: Path) -> tuple[Path, ...]:
    """Where a source directory's symlinks may point: the directory itself and, inside a Hugging
    Face cache (`models--org--name/snapshots/<rev>`), its repository (`blobs/` lives there)."""
    real = directory.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(real.parent.parent)
    return tuple(roots)


def ensure_inside_source(directory: Path, path: Path) -> Path:
    """`path` (a file of the source `directory`) if it does not leave the directory or its cache
    repository through a symlink; one line otherwise (exit 2)."""
    if not path.is_symlink() and path.parent.resolve() == directory.resolve():
        return path
    real = path.resolve()
    if any(real == root or real.is_relative_to(root) for root in source_roots(directory)):
        return path
    raise UserError(
        f"{path}: a symbolic link to {real}, outside {directory} and its Hugging Face cache repository: "
        "refused (copy the file in if it belongs to the checkpoint)"
    )
