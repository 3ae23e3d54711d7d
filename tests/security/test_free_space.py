"""Issue 21, class 6: the free-space check before writing counts the side files and the manifest,
and every "disk full" line names the output's filesystem (before: a disk that fit only the
weights passed the check, and the failure named the source's tokenizer.jsonl).

A real small filesystem: a tmpfs mounted in a private mount namespace (`unshare -rm`), gone when
the command ends.  Skipped where the kernel does not allow that."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_env import ROOT, cli_env


def _in_small_fs(mnt: Path, kib: int, *args: str | Path, input: str | None = None) -> subprocess.CompletedProcess:
    cli = " ".join(shlex.quote(str(a)) for a in [sys.executable, "-m", "plamo2_tools.cli", *args])
    script = f"mount -t tmpfs -o size={kib}k tmpfs {shlex.quote(str(mnt))} && {cli}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=cli_env(),
        input=input,
    )


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory: pytest.TempPathFactory) -> None:
    mnt = tmp_path_factory.mktemp("probe")
    try:
        r = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no unshare here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {r.stderr.decode().strip()}")


def _sizes(shards: Path) -> tuple[int, int]:
    """(bytes of the shard files, bytes of everything else convert writes)."""
    m = json.loads((shards / "plamo2_shards.json").read_text())
    weights = sum(r["size"] for r in m["files"].values())
    return weights, sum(r["size"] for r in m["side_files"].values()) + (shards / "plamo2_shards.json").stat().st_size


def test_side_files_and_manifest_are_counted(can_mount, one_line_error, checkpoint, tiny_shards, work) -> None:
    weights, rest = _sizes(tiny_shards)
    mnt = work / "mnt"
    mnt.mkdir()
    room = (weights + rest // 2) // 1024  # the weights fit, the side files and manifest do not
    r = _in_small_fs(mnt, room, "convert", checkpoint("tiny"), mnt / "out", "--tp", 2)
    line = one_line_error(r, 3)
    assert "not enough disk space: the conversion needs" in line and f"mounted at {mnt}" in line, line
    assert "tokenizer.jsonl" not in line
    r = _in_small_fs(mnt, room, "merge", tiny_shards, mnt / "merged")
    line = one_line_error(r, 3)
    assert "not enough disk space: the merge needs" in line and f"mounted at {mnt}" in line, line


def test_full_disk_while_writing_names_the_output_filesystem(can_mount, one_line_error, checkpoint, work) -> None:
    mnt = work / "mnt"
    mnt.mkdir()
    texts = "".join(json.dumps(f"line {i} " + "text " * 50) + "\n" for i in range(2000))
    r = _in_small_fs(mnt, 64, "tokenize", checkpoint("tiny"), "--out", mnt / "ids.jsonl", input=texts)
    line = one_line_error(r, 3)
    assert f"ids.jsonl: no space left on device (the filesystem mounted at {mnt} is full)" in line, line
