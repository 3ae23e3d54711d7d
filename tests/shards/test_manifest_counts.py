"""The manifest reader refuses what it must not accept (issue 34, class 4): every count it reads (sizes, ranks,
parts, layer bounds, TP/PP sizes, the part-size and vocabulary options) must be a JSON integer in range: a
negative number, a float, a string and `true` (which Python's `int()` takes as 1) are a malformed manifest, one
line, exit 2; the flag `tied_embeddings` must be a boolean (Python's `bool("false")` is True).

Every case here was accepted by `load_manifest` before this test (it called `int()` / `bool()` on the values),
seen red on that code; bench/mutants.py's `valid-manifest-*` mutants put back one `int()` each.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plamo2_tools.errors import CheckpointError
from plamo2_tools.shards.manifest import MANIFEST_NAME, load_manifest

Edit = Callable[[dict[str, Any]], Any]


def first(d: dict[str, Any]) -> Any:
    return next(iter(d.values()))


def setter(path: tuple[Any, ...]) -> Callable[[Any], Edit]:
    """setter(("files", first, "size"))(value): an edit that puts `value` there (callables pick a child)."""

    def with_value(value: Any) -> Edit:
        def edit(m: dict[str, Any]) -> None:
            node: Any = m
            for step in path[:-1]:
                node = step(node) if callable(step) else node[step]
            node[path[-1]] = value

        return edit

    return with_value


# (name, where the count lives); each is tried with -1, 1.5, "2", true (and tp/pp/options with 0)
COUNTS: list[tuple[str, tuple[Any, ...]]] = [
    ("tp_size", ("mapping", "tp_size")),
    ("pp_size", ("mapping", "pp_size")),
    ("stage bound", ("mapping", "stages", 0, 1)),
    ("rank", ("mapping", "ranks", 1, "rank")),
    ("tp_rank", ("mapping", "ranks", 1, "tp_rank")),
    ("pp_rank", ("mapping", "ranks", 1, "pp_rank")),
    ("file size", ("files", first, "size")),
    ("file rank", ("files", first, "rank")),
    ("file part", ("files", first, "part")),
    ("max_part_size", ("options", "max_part_size")),
    ("padded_vocab", ("options", "padded_vocab")),
    ("side file size", ("side_files", first, "size")),
    ("shape", ("tensors", "0", first, "shape", 0)),
    ("piece start", ("tensors", "0", first, "pieces", 0, 2)),
]
BAD = [-1, 1.5, "2", True]
POSITIVE = {"tp_size", "pp_size", "max_part_size", "padded_vocab"}  # where 0 is no count either
CASES = [(name, path, v) for name, path in COUNTS for v in BAD + ([0] if name in POSITIVE else [])]


@pytest.fixture
def damaged(shards, private_copy) -> Callable[[Edit], Path]:
    """damaged(edit): a private tp2 x pp2 shard directory whose manifest JSON went through `edit`."""
    path = private_copy(shards("tiny", 2, 2))

    def make(edit: Edit) -> Path:
        m = json.loads((path / MANIFEST_NAME).read_text())
        edit(m)
        (path / MANIFEST_NAME).write_text(json.dumps(m))
        return path

    return make


def test_the_untouched_manifest_is_read(damaged) -> None:
    m = load_manifest(damaged(lambda m: None))
    assert m.mapping.tp == 2 and m.mapping.pp == 2 and m.options.tied_embeddings in (True, False)


@pytest.mark.parametrize(("name", "path", "value"), CASES, ids=[f"{n}={v!r}" for n, _, v in CASES])
def test_a_count_that_is_no_count_is_malformed(damaged, name: str, path: tuple[Any, ...], value: Any) -> None:
    directory = damaged(setter(path)(value))
    with pytest.raises(CheckpointError, match="malformed manifest|not a count|ranks 0"):
        load_manifest(directory)


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_tied_embeddings_must_be_a_boolean(damaged, value: Any) -> None:
    with pytest.raises(CheckpointError, match="malformed manifest"):
        load_manifest(damaged(setter(("options", "tied_embeddings"))(value)))


def test_a_negative_file_size_is_one_line_from_check(cli, one_line_error, damaged) -> None:
    """Through the real command: exit 2 (the manifest is unreadable), one line, not exit 1 (a damaged
    file) or a traceback."""
    directory = damaged(setter(("files", first, "size"))(-8))
    line = one_line_error(cli("check", directory, expect=2), 2)
    assert "malformed manifest" in line and "-8 is not a count" in line


@pytest.mark.parametrize("version", [True, 2.0, "2", None])
def test_format_version_must_be_a_json_integer(damaged, version: Any) -> None:
    """`true` would be read as format 1 (True == 1 and hashes alike), 2.0 as format 2."""
    with pytest.raises(CheckpointError, match="format_version .* is not supported"):
        load_manifest(damaged(setter(("format_version",))(version)))
