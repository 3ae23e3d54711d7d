"""The tuning cache is a hint, never trusted: a corrupt, stale (other software or device), oversized
or invalid cache is ignored and rewritten; a valid one is read back; writes are atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.kernels.tune_cache import MAX_BYTES, TuneCache

ID = {"plamo2_tools": "1", "torch": "2", "triton": "3", "device": "H200", "capability": "9.0"}
CHOICES = {("parallel", 64), ("sequential", 128)}


def _valid(v: object) -> bool:
    return isinstance(v, list) and tuple(v) in CHOICES


def test_a_decision_comes_back_in_the_next_process(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    TuneCache("k", ID, path).put("H=8|P=64", ["parallel", 64])
    assert TuneCache("k", ID, path).get("H=8|P=64", _valid) == ["parallel", 64]
    assert TuneCache("k", ID, path).get("H=4|P=64", _valid) is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"identity": {**ID, "triton": "9.9"}, "entries": {"a": ["parallel", 64]}}),
        json.dumps({"identity": {**ID, "device": "A100"}, "entries": {"a": ["parallel", 64]}}),
        json.dumps({"identity": {**ID, "format_version": "0"}, "entries": {"a": ["parallel", 64]}}),
        json.dumps({"identity": ID, "entries": ["a"]}),
        "\udcff",
    ],
    ids=["corrupt", "a list", "other triton", "other device", "old format", "entries not an object", "not text"],
)
def test_a_bad_or_stale_cache_is_ignored_and_rewritten(tmp_path: Path, content: str) -> None:
    path = tmp_path / "k.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    cache = TuneCache("k", ID, path)
    assert cache.get("a", _valid) is None  # measured again, not taken from the file
    cache.put("a", ["sequential", 128])
    data = json.loads(path.read_text())
    assert data["identity"] == {"format_version": "1", **ID} and data["entries"] == {"a": ["sequential", 128]}


def test_an_entry_that_is_not_a_choice_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    identity = {"format_version": "1", **ID}
    path.write_text(
        json.dumps({"identity": identity, "entries": {"a": ["parallel", 7], "b": "x", "c": ["parallel", 64]}})
    )
    cache = TuneCache("k", ID, path)
    assert cache.get("a", _valid) is None and cache.get("b", _valid) is None
    assert cache.get("c", _valid) == ["parallel", 64]


def test_an_oversized_file_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    path.write_text(
        json.dumps({"identity": {"format_version": "1", **ID}, "entries": {"a": ["parallel", 64]}}) + " " * MAX_BYTES
    )
    assert TuneCache("k", ID, path).get("a", _valid) is None


def test_no_cache_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAMO2_TUNE_CACHE", "0")
    cache = TuneCache("k", ID)
    cache.put("a", ["parallel", 64])
    assert cache.path is None and cache.get("a", _valid) == ["parallel", 64]  # in memory only
    monkeypatch.setenv("PLAMO2_TUNE_CACHE", "1")
    monkeypatch.setenv("PLAMO2_CACHE_DIR", str(tmp_path))
    assert TuneCache("k", ID).path == tmp_path / "kernels" / "k.json"


def test_a_write_failure_costs_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    cache = TuneCache("k", ID, blocker / "k.json")
    cache.put("a", ["parallel", 64])  # no exception: the decision is kept in memory
    assert cache.get("a", _valid) == ["parallel", 64] and blocker.read_text().startswith("a file")
