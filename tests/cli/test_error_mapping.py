"""The machine's refusals exit 3 with one line, never 70 (a bug) or 2 (the user's input): a full
disk wherever it surfaces (a kernel copy, a write, a raw OSError out of any command), the host out
of memory, the GPU out of memory.  Each failure is injected into a real command at the call the
operating system or torch would fail, and the whole CLI error path runs."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from plamo2_tools.errors import EnvironmentLimitError, os_error
from plamo2_tools.runtime.batching import engine


def _raise(exc: BaseException):  # type: ignore[no-untyped-def]
    def fail(*args: object, **kwargs: object) -> None:
        raise exc

    return fail


ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_in_a_kernel_copy(
    cli, one_line_error, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", _raise(ENOSPC))
    r = cli("convert", checkpoint("tiny"), tmp_path / "out", "--copy", "copy_file_range", "--json", expect=None)
    assert "no space left on device" in one_line_error(r, 3)


def test_disk_full_in_a_write(cli, one_line_error, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up under the shard files' writes (the lock file still had room)."""
    real = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            raise ENOSPC
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    r = cli(
        "convert", checkpoint("tiny"), tmp_path / "out", "--copy", "user", "--dtype", "float16", "--json", expect=None
    )
    assert "no space left on device" in one_line_error(r, 3).lower()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EACCES, errno.EROFS, errno.EIO])
def test_a_raw_os_error_of_the_machine_exits_3(
    cli, one_line_error, shards, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """An OSError nobody translated (it escaped from a library) still is the machine's refusal."""
    monkeypatch.setattr(engine.Runtime, "generate", _raise(OSError(code, os.strerror(code), "/some/file")))
    r = cli("generate", shards("tiny", 1, 1, seed=11), "--prompt", "x", expect=None)
    assert os.strerror(code) in one_line_error(r, 3)
    assert os_error(OSError(code, os.strerror(code)), "x: cannot write").exit_code == 3


def test_the_rule_for_other_os_errors_is_the_users_input() -> None:
    assert os_error(OSError(errno.ENOENT, "No such file or directory"), "x: cannot read").exit_code == 2
    assert isinstance(os_error(ENOSPC, "x: cannot write"), EnvironmentLimitError)
    assert "no space left on device" in str(os_error(ENOSPC, "x: cannot write"))


@pytest.mark.parametrize(
    "exc",
    [MemoryError(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")],
    ids=["host", "cuda"],
)
def test_out_of_memory_exits_3(cli, one_line_error, shards, monkeypatch: pytest.MonkeyPatch, exc) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(engine.Runtime, "generate", _raise(exc))
    r = cli("generate", shards("tiny", 1, 1, seed=11), "--prompt", "x", expect=None)
    assert one_line_error(r, 3).startswith("error: out of memory")
