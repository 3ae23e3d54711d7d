"""What survives a power cut or a kill (issue 24): every file's data is fsynced before the file
that announces the output complete (the manifest, merge's record) is renamed into place, and the
directory after; a run killed half way leaves `.partial` files that a re-run (with
the same or other options) treats as its own; a user's `*.partial` / `*.tmp` files beside ours
are never written over, even with --force.

The order of fsync and rename is seen by wrapping the real `os.fsync` / `os.replace` (both still
run) and naming each fsynced descriptor by its /proc link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from convert_expect import kill_convert_half_way

from plamo2_tools.outputs import RECORD_NAME
from plamo2_tools.shards.manifest import MANIFEST_NAME


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """('fsync', path, '') and ('replace', src, dst) in the order they happened (any thread)."""
    seen: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        real_fsync(fd)

    def replace(src: object, dst: object, **kwargs: object) -> None:
        seen.append(("replace", os.path.realpath(str(src)), os.path.realpath(str(dst))))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def _assert_durable(calls: list[tuple[str, str, str]], out: Path, commit: str) -> int:
    """Nothing is announced before it is on disk: every file renamed into `out` has its data fsynced
    (under its temporary or its final name) before `commit` (the manifest, or the record that says
    complete) is renamed into place, `commit` itself before its rename, and the directory after."""
    out = Path(os.path.realpath(out))
    renames = [
        (i, src, dst) for i, (what, src, dst) in enumerate(calls) if what == "replace" and Path(dst).parent == out
    ]
    done = max(i for i, _, dst in renames if Path(dst).name == commit)
    synced = {path for what, path, _ in calls[:done] if what == "fsync"}
    for i, src, dst in renames:
        if i <= done:
            assert {src, dst} & synced, f"{Path(dst).name}: in place before its data was fsynced"
    assert ("fsync", str(out), "") in calls[done + 1 :], "the directory was not fsynced after the commit"
    return len(renames)


def test_convert_fsyncs_every_file_before_the_manifest(cli, calls, checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cli("convert", checkpoint("tiny-gqa"), out, "--tp", 2, "--max-part-size", "30000", "--json")
    renamed = _assert_durable(calls, out, MANIFEST_NAME)
    assert renamed >= len(list(out.glob("*.safetensors"))) + 1  # the shard files and the manifest


def test_merge_fsyncs_every_file_before_its_record(cli, calls, shards, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    cli("merge", shards("tiny-gqa", 2, 1), out, "--json")
    assert _assert_durable(calls, out, RECORD_NAME) >= 2


# ---- a killed run, then a re-run ------------------------------------------------------------------------
SPLIT = ("--tp", "2", "--pp", "2", "--max-part-size", "1MB")


@pytest.mark.parametrize("options", [SPLIT, ("--tp", "4")], ids=["same-options", "other-options"])
def test_a_rerun_after_a_kill_takes_its_own_partial_files(
    cli, medium_checkpoint: Path, tmp_path: Path, options: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    kill_convert_half_way(medium_checkpoint, out, SPLIT)
    assert list(out.glob("*.partial")), "the kill should leave unfinished files behind"
    result = json.loads(cli("convert", medium_checkpoint, out, *options, "--json").stdout)
    assert result["status"] == ("resumed" if options == SPLIT else "converted")
    assert not list(out.glob("*.partial")) and not list(out.glob("*.tmp"))
    cli("check", out, "--source", medium_checkpoint, "--json")


@pytest.mark.parametrize("name", ["model-rank-0-part-0.safetensors.partial", "config.json.tmp"])
def test_a_users_partial_or_tmp_file_is_never_written_over(
    cli, one_line_error, checkpoint, tmp_path: Path, name: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("the user's own notes\n")
    r = cli("convert", checkpoint("tiny"), out, "--force", "--json", expect=2)
    assert name in one_line_error(r, 2)
    assert (out / name).read_text() == "the user's own notes\n"
