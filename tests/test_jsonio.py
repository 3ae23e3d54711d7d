"""jsonio's rules, one test each (issue 34, class 4): the depth limit counts every level, objects inside arrays
and arrays inside objects alike, up to MAX_DEPTH accepted and one more refused (also where json's own recursion
would not fail); a top level that is not an object refused by `read_object`; the size limit.

The depth oracle is the definition written recursively here (a scalar 0, a container 1 + its deepest child),
checked on random JSON trees (hypothesis) against `jsonio.depth`, whose loop is iterative.  Seen red on
bench/mutants.py's `valid-json-*` mutants (objects' children not pushed, depth not counted for objects,
the limit off by one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plamo2_tools.errors import CheckpointError
from plamo2_tools.jsonio import MAX_DEPTH, depth, parse_json, read_json, read_object


def depth_by_definition(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max((depth_by_definition(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((depth_by_definition(x) for x in v), default=0)
    return 0


json_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=2), children, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_trees)
def test_depth_is_the_definition_on_random_trees(tree: Any) -> None:
    assert depth(tree) == depth_by_definition(tree)


def nest(levels: list[str], leaf: str = "0") -> str:
    """JSON text of containers nested in the given order ("a": an array, "o": an object) around `leaf`."""
    text = leaf
    for kind in reversed(levels):
        text = f"[{text}]" if kind == "a" else f'{{"k": {text}}}'
    return text


SHAPES = {
    "arrays in arrays": ["a"],
    "objects in objects": ["o"],
    "objects in arrays": ["a", "o"],
    "arrays in objects": ["o", "a"],
    "objects in arrays in objects": ["o", "a", "a"],
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_max_depth_is_accepted_and_one_more_refused(shape: str) -> None:
    pattern = SHAPES[shape]
    levels = (pattern * MAX_DEPTH)[:MAX_DEPTH]
    ok = parse_json(nest(levels), "ok.json")
    assert depth(ok) == MAX_DEPTH
    deeper = (pattern * (MAX_DEPTH + 1))[: MAX_DEPTH + 1]
    with pytest.raises(CheckpointError, match=r"deep.json: JSON nested too deeply \(more than 64 levels\)"):
        parse_json(nest(deeper), "deep.json")


def test_a_deep_object_beside_shallow_siblings_is_found() -> None:
    """The deepest branch counts, wherever it is: last, first, or inside an object among scalars."""
    deep = nest(["a", "o"] * 40)  # 80 levels
    for text in (f"[1, 2, {deep}]", f"[{deep}, 1, 2]", f'{{"a": 1, "b": [{{"c": {deep}}}], "d": "x"}}'):
        with pytest.raises(CheckpointError, match="nested too deeply"):
            parse_json(text, "x.json")


def test_recursion_deep_text_is_one_error_not_a_crash() -> None:
    with pytest.raises(CheckpointError, match="nested too deeply"):
        parse_json("[" * 100_000 + "]" * 100_000, "x.json")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        parse_json('{"a":' * 50_000 + "1" + "}" * 50_000, "x.json")


@pytest.mark.parametrize("text", ["{", "[1,]", "nul", '{"a": 1} x', "\ud800"])
def test_invalid_json_is_refused(text: str) -> None:
    with pytest.raises(CheckpointError, match="x.json: not valid JSON"):
        parse_json(text, "x.json")


def test_a_huge_integer_is_refused() -> None:
    with pytest.raises(CheckpointError, match="x.json: not valid JSON"):
        parse_json("1" * 10_000, "x.json")


@pytest.mark.parametrize(
    ("text", "kind"), [("[]", "array"), ('"s"', "string"), ("1", "number"), ("true", "boolean"), ("null", "null")]
)
def test_read_object_refuses_every_other_top_level(tmp_path: Path, text: str, kind: str) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"not a JSON object \\(the top level is a JSON {kind}\\)"):
        read_object(tmp_path / "c.json")
    (tmp_path / "c.json").write_text('{"a": [1]}')
    assert read_object(tmp_path / "c.json") == {"a": [1]}


def test_the_size_limit(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"a": "x" * 100}))
    assert read_json(tmp_path / "c.json", limit=200)["a"] == "x" * 100
    with pytest.raises(Exception, match="more than the"):
        read_json(tmp_path / "c.json", limit=50)
