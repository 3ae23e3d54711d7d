"""When convert makes its data durable (`--sync`, docs/convert.md "Durability"): the manifest is
written only after every shard file it lists (and the directory) has been fsync'd."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plamo2_tools.convert import engine
from plamo2_tools.errors import UserError
from plamo2_tools.safetensors_io import PartialFile


def record_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    real_fsync_path, real_fsync_dir, real_write = engine.fsync_path, engine.fsync_dir, engine.write_manifest
    real_sync = PartialFile.sync

    def fsync_path(path: Path) -> None:
        calls.append(("fsync", Path(path).name))
        real_fsync_path(path)

    def fsync_dir(path: Path) -> None:
        calls.append(("fsync_dir", Path(path).name))
        real_fsync_dir(path)

    def write_manifest(out: Path, manifest: dict) -> None:
        calls.append(("manifest", ""))
        real_write(out, manifest)

    def sync(self: PartialFile) -> None:
        calls.append(("fsync", self.path.name))
        real_sync(self)

    monkeypatch.setattr(engine, "fsync_path", fsync_path)
    monkeypatch.setattr(engine, "fsync_dir", fsync_dir)
    monkeypatch.setattr(engine, "write_manifest", write_manifest)
    monkeypatch.setattr(PartialFile, "sync", sync)
    return calls


@pytest.mark.parametrize("sync", ["end", "file"])
def test_every_file_is_durable_before_the_manifest(sync: str, checkpoint, monkeypatch, tmp_path: Path) -> None:
    src = checkpoint("tiny-gqa")  # before recording: writing the source fsyncs its own files
    calls = record_calls(monkeypatch)
    result = engine.convert(src, tmp_path / "out", tp=2, pp=2, max_part_size=200_000, sync=sync)
    files = {f.name for f in result.plan.files}
    assert len(files) > 4
    manifest_at = calls.index(("manifest", ""))
    synced = {name for kind, name in calls[:manifest_at] if kind == "fsync"}
    assert files <= synced, sorted(files - synced)
    # the side files (config.json, the tokenizer ...) are fsynced as they are copied
    # (outputs.copy_file): tests/convert/test_durability.py follows os.fsync itself for those
    assert ("fsync_dir", "out") in calls[:manifest_at]


def test_sync_none_never_fsyncs_the_shard_data(checkpoint, monkeypatch, tmp_path: Path) -> None:
    src = checkpoint("tiny")
    calls = record_calls(monkeypatch)
    engine.convert(src, tmp_path / "out", tp=2, sync="none")
    assert not [c for c in calls if c[0] == "fsync" and c[1].endswith(".safetensors")]
    assert (tmp_path / "out" / "plamo2_shards.json").is_file()


def test_an_unknown_sync_mode_is_refused(checkpoint, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--sync must be one of"):
        engine.convert(checkpoint("tiny"), tmp_path / "out", sync="sometimes")
    assert not os.path.exists(tmp_path / "out")


def test_the_cli_default_is_the_engine_default() -> None:
    import inspect

    from plamo2_tools.cli import shards

    assert inspect.signature(shards.convert).parameters["sync"].default == engine.DEFAULT_SYNC
