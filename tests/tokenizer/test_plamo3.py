"""PLaMo 3's encoder (PlamoEncoder with Plamo3Cuts) against plamo3_reference.py, and the cases that
pin the rule (docs/tokenizer.md §9): ``<|plamo:…|>`` strings glued to text, unregistered ones, 64
and 65 character bodies, ``|`` and whitespace inside, nested starts, literal U+EE00, runs at, below
and above the thresholds, thresholds below 2, multi-byte characters, empty texts; and PLaMo 2's
encoder untouched by any of it.
"""

from __future__ import annotations

import random

import pytest
from plamo3_reference import BOUNDARY, marked, split_ids, whole_ids
from tokenizer_reference import Reference, random_vocab, rows_for

from plamo2_tools.tokenizer import PlamoEncoder
from plamo2_tools.tokenizer.plamo3 import Plamo3Cuts

ALPHABET = ["a", "b", " ", "<", "|", ">", ":", "p", "l", "m", "o", "é", "日", "👍", "\n", "\t", "\u3000", "\x1c"]
BODY64 = ("ab" * 33)[:64]  # alternating: no runs of equal characters
FRAGMENTS = [
    "<|plamo:",
    "|>",
    "<|plamo:op|>",
    "<|plamo:xyz|>",
    "<|plamo:|>",
    "<|plamo:a b|>",
    "<|plamo:a|b|>",
    f"<|plamo:{BODY64}|>",
    f"<|plamo:{BODY64}a|>",
    "<|plamo:<|plamo:op|>|>",
    "<|plamo:\u3000|>",
    BOUNDARY,
    "aaaa",
    "     ",
    "\n\n\n",
    "日日日",
    "👍👍👍",
]
THRESHOLDS = [None, None, 1, 2, 3, 4]


def random_text(rng: random.Random, units: int, alphabet: list[str] = ALPHABET) -> str:
    return "".join(rng.choice(FRAGMENTS) if rng.random() < 0.25 else rng.choice(alphabet) for _ in range(units))


def encoder(rows: list[list[object]], repeated: int | None = None, spaces: int | None = None) -> PlamoEncoder:
    return PlamoEncoder(rows, plamo3=Plamo3Cuts(repeated, spaces))


def ids_of(rows: list[list[object]]) -> dict[str, int]:
    return {row[0]: i for i, row in enumerate(rows)}  # type: ignore[misc]


# ---- random vocabularies against the rule ----------------------------------------------------------
@pytest.mark.parametrize("seed", range(16))
def test_random_vocabularies_follow_the_rule(seed: int) -> None:
    rng = random.Random(3000 + seed)
    pieces = random_vocab(rng, size=rng.choice([5, 20, 60]), alphabet=ALPHABET, longest=rng.choice([2, 4, 8]))
    if rng.random() < 0.5:
        pieces["<|plamo:op|>"] = 0.0  # a control piece, as in PLaMo's files
    rows = rows_for(pieces)
    reference = Reference(rows)
    for _ in range(6):
        repeated, spaces = rng.choice(THRESHOLDS), rng.choice(THRESHOLDS)
        enc = encoder(rows, repeated, spaces)
        texts = [random_text(rng, rng.randint(0, 12)) for _ in range(25)] + [random_text(rng, 200) for _ in range(2)]
        for text in texts:
            expected = split_ids(reference, text, repeated, spaces)
            assert whole_ids(rows, text, repeated, spaces) == expected  # the two readings of the rule agree
            assert enc.encode(text) == expected, (pieces, repeated, spaces, text)
        # Again, now from the encoder's cache.
        assert [enc.encode(t) for t in texts] == [split_ids(reference, t, repeated, spaces) for t in texts]


@pytest.mark.parametrize("seed", range(6))
def test_pieces_holding_the_boundary_character_follow_the_literal_rule(seed: int) -> None:
    """A vocabulary with U+EE00 inside pieces (no real one has them): the boundary is then only a
    piece of score 0 whose id is dropped, and longer pieces may still run across it."""
    rng = random.Random(4000 + seed)
    alphabet = [*ALPHABET[:8], BOUNDARY, BOUNDARY]
    pieces = random_vocab(rng, size=rng.choice([10, 40]), alphabet=alphabet, longest=3)
    rows = rows_for(pieces)
    for _ in range(4):
        repeated, spaces = rng.choice(THRESHOLDS), rng.choice(THRESHOLDS)
        enc = encoder(rows, repeated, spaces)
        for _ in range(40):
            text = random_text(rng, rng.randint(0, 10), alphabet)
            assert enc.encode(text) == whole_ids(rows, text, repeated, spaces), (pieces, repeated, spaces, text)


def test_boundary_pieces_pinned() -> None:
    """Checked against the public Plamo3Tokenizer code (docs/tokenizer.md §9)."""
    rows = rows_for({"a\uee00": 5.0, "\uee00b": -1.0, "\uee00": -3.0, "a": -1.0, "b": -1.0})
    ids = ids_of(rows)
    enc = encoder(rows)
    assert enc.encode("a\uee00b") == [ids["a\uee00"], ids["b"]]
    assert enc.encode("\uee00") == [] and enc.encode("b\uee00") == [ids["b"]]  # its own row is replaced
    assert enc.encode("a<|plamo:op|>b")[0] == ids["a\uee00"]  # the inserted boundary, taken by a piece


# ---- the special-token pattern -----------------------------------------------------------------------
GLUE = {c: -1.0 for c in "abxyz<|>:plmo日é"} | {"x<": -0.1, ">y": -0.1, "<|plamo:op|>": 0.0}
GLUE |= {"x<|plamo:op|>y": -0.1, "<|": -0.3}


def test_plamo_strings_are_cut_from_their_neighbours() -> None:
    rows = rows_for(GLUE)
    ids = ids_of(rows)
    enc, plamo2 = encoder(rows), PlamoEncoder(rows)
    assert plamo2.encode("x<|plamo:op|>y") == [ids["x<|plamo:op|>y"]]
    assert enc.encode("x<|plamo:op|>y") == [ids["x"], ids["<|plamo:op|>"], ids["y"]]
    assert enc.encode("<|plamo:op|><|plamo:op|>") == [ids["<|plamo:op|>"]] * 2
    # Not in the vocabulary: spelled in pieces, still apart from "x" and "y".
    spelled = [ids["<|"], *(ids[c] for c in "plamo:xyz|>")]
    assert enc.encode("x<|plamo:xyz|>y") == [ids["x"], *spelled, ids["y"]]
    assert plamo2.encode("x<|plamo:xyz|>y") == [ids["x<"], ids["|"], *(ids[c] for c in "plamo:xyz|"), ids[">y"]]


@pytest.mark.parametrize(
    ("body", "cut"),
    [
        ("", True),
        ("op", True),
        (BODY64, True),
        (BODY64 + "a", False),  # 65 characters
        ("a|b", False),
        ("a b", False),
        ("a\tb", False),
        ("a\nb", False),
        ("a\u3000b", False),  # ideographic space
        ("a\x1cb", False),  # a separator str.isspace() counts as whitespace
        ("a\u2028b", False),
        ("a\u200bb", True),  # zero-width space is not whitespace
        ("a<b>", True),
        ("日é:", True),
        ("\uee00", True),
    ],
)
def test_which_bodies_are_cut(body: str, cut: bool) -> None:
    rows = rows_for(GLUE)
    ids = ids_of(rows)
    got = encoder(rows).encode(f"x<|plamo:{body}|>y")
    assert (got[0], got[-1]) == ((ids["x"], ids["y"]) if cut else (ids["x<"], ids[">y"]))
    assert got == split_ids(Reference(rows), f"x<|plamo:{body}|>y")


def test_nested_and_overlapping_starts() -> None:
    rows = rows_for(GLUE)
    ids = ids_of(rows)
    enc = encoder(rows)
    op = ids["<|plamo:op|>"]
    # Only the inner string matches: the outer start runs into "|" before any "|>".
    got = enc.encode("x<|plamo:<|plamo:op|>|>y")
    assert got[0] == ids["x<"] and op in got and got[-2:] == [ids["|"], ids[">y"]]
    assert enc.encode("<|plamo:op|>|>y") == [op, ids["|"], ids[">y"]]
    assert enc.encode("x<|plamo:op|>op|>") == [ids["x"], op, *(ids[c] for c in "op|>")]
    assert marked("<|plamo:a<|plamo:b|>") == f"<|plamo:a{BOUNDARY}<|plamo:b|>{BOUNDARY}"
    for text in ["<|plamo:<|plamo:", "|><|plamo:", "<|plamo:op|", "<|plamo:op>", "<|plamo:op||>"]:
        assert enc.encode(f"x{text}y") == PlamoEncoder(rows).encode(f"x{text}y"), text  # nothing matches


def test_a_literal_boundary_character_cuts_and_disappears() -> None:
    rows = rows_for({"a": -1.0, "b": -1.0, "ab": -0.1})
    ids = ids_of(rows)
    enc = encoder(rows)
    assert enc.encode("ab") == [ids["ab"]]
    assert enc.encode("a\uee00b") == [ids["a"], ids["b"]]
    assert enc.encode("\uee00") == [] and enc.encode("\uee00\uee00") == []
    assert enc.encode("\uee00ab\uee00\uee00ab") == [ids["ab"], ids["ab"]]
    # PLaMo 2 has no such character: it is spelled in bytes.
    assert PlamoEncoder(rows).encode("a\uee00b") == [ids["a"], 4 + 0xEE, 4 + 0xB8, 4 + 0x80, ids["b"]]


# ---- the thresholds ----------------------------------------------------------------------------------
RUNS = {"x": -1.0, "y": -1.0, "a": -1.0, " ": -1.0, "\n": -1.0, "日": -1.0, "xa": -0.1, "ay": -0.1}
RUNS |= {"x ": -0.1, " y": -0.1, "x\n": -0.1, "\ny": -0.1, "x日": -0.1, "日y": -0.1, "aa": -1.5, "  ": -1.5}


@pytest.mark.parametrize("char", ["a", "日", " "])
@pytest.mark.parametrize("threshold", [2, 3, 5])
def test_repeated_runs_are_cut_from_the_threshold_on(char: str, threshold: int) -> None:
    rows = rows_for(RUNS)
    ids = ids_of(rows)
    enc = encoder(rows, repeated=threshold)
    for length in (threshold - 1, threshold, threshold + 1):
        text = "x" + char * length + "y"
        got = enc.encode(text)
        if length >= threshold:  # cut on both sides
            assert (got[0], got[-1]) == (ids["x"], ids["y"]), length
        else:  # not cut: one DP, glued to a neighbour
            assert got == PlamoEncoder(rows).encode(text) and (got[0], got[-1]) != (ids["x"], ids["y"]), length
        assert got == split_ids(Reference(rows), text, repeated=threshold)


@pytest.mark.parametrize("threshold", [2, 3, 8])
def test_space_runs_are_cut_from_the_threshold_on(threshold: int) -> None:
    rows = rows_for(RUNS)
    ids = ids_of(rows)
    enc = encoder(rows, spaces=threshold)
    for length in (threshold - 1, threshold, threshold + 1):
        text = "x" + " " * length + "y"
        got = enc.encode(text)
        if length >= threshold:
            assert (got[0], got[-1]) == (ids["x"], ids["y"]), length
        else:
            assert got == PlamoEncoder(rows).encode(text) and (got[0], got[-1]) != (ids["x"], ids["y"]), length
    # Only spaces: other runs and other whitespace are left alone.
    assert enc.encode("x" + "a" * threshold + "y")[0] == ids["xa"]
    assert enc.encode("x" + "\u3000" * threshold + "y")[0] == PlamoEncoder(rows).encode("x\u3000")[0]


def test_both_thresholds_together() -> None:
    rows = rows_for(RUNS)
    ids = ids_of(rows)
    enc = encoder(rows, repeated=4, spaces=2)
    assert enc.encode("x  y")[0] == ids["x"]  # the spaces rule
    assert enc.encode("xaaay")[0] == ids["xa"] and enc.encode("xaaaay")[0] == ids["x"]  # the repeat rule
    text = "x  aaaa   ay\n\n\n\ny"
    assert enc.encode(text) == split_ids(Reference(rows), text, repeated=4, spaces=2)


def test_newline_runs_are_not_repeated_characters() -> None:
    rows = rows_for(RUNS)
    ids = ids_of(rows)
    got = encoder(rows, repeated=2).encode("x\n\n\n\ny")
    assert got[0] == ids["x\n"] and got[-1] == ids["\ny"]  # "." in PLaMo's pattern: not a newline


def test_runs_are_counted_after_the_special_tokens_are_marked() -> None:
    """The boundary after "<|plamo:op|>" splits the run of ">": the special-token marks come first."""
    rows = rows_for(GLUE | {">>": -0.2})
    ids = ids_of(rows)
    got = encoder(rows, repeated=3).encode("<|plamo:op|>>>y")  # ">" + ">>" around a boundary: no run of 3
    assert got == [ids["<|plamo:op|>"], ids[">"], ids[">y"]]
    got = encoder(rows, repeated=3).encode("<|plamo:op|>>>>y")  # a run of 3 after the boundary
    assert got[0] == ids["<|plamo:op|>"] and got[-1] == ids["y"]


def test_runs_inside_a_plamo_string_cut_it() -> None:
    rows = rows_for({**RUNS, "<|plamo:aaaa|>": 0.0, "<": -1.0, "|": -1.0, ">": -1.0})
    ids = ids_of(rows)
    assert encoder(rows, repeated=5).encode("<|plamo:aaaa|>") == [ids["<|plamo:aaaa|>"]]
    assert ids["<|plamo:aaaa|>"] not in encoder(rows, repeated=4).encode("<|plamo:aaaa|>")


def test_multibyte_runs_and_combining_marks() -> None:
    rows = rows_for(RUNS)
    reference = Reference(rows)
    for text in ["x👍👍👍y", "xe\u0301e\u0301e\u0301y", "x日日日日y", "xééé\u0301y"]:
        for threshold in (2, 3, 4):
            assert encoder(rows, repeated=threshold).encode(text) == split_ids(reference, text, repeated=threshold)
    # Runs are of code points: "e" + combining accent repeated is no run.
    assert marked("e\u0301e\u0301", repeated=2) == "e\u0301e\u0301"


def test_thresholds_below_two_mean_what_plamos_patterns_say() -> None:
    """N = 1 isolates every run of equal characters (newlines aside): cuts between any two
    different characters.  Built into PLaMo's f-strings, N <= 0 makes "{N-1,}" a literal text
    (Python's re), and M = 0 matches the empty string everywhere: every character stands alone."""
    rows = rows_for({**RUNS, "xx": -0.1, "\n\n": -0.1, "x{": -0.1})
    ids = ids_of(rows)
    assert encoder(rows, repeated=1).encode("xay") == [ids["x"], ids["a"], ids["y"]]
    assert encoder(rows, repeated=1).encode("xx") == [ids["xx"]]
    assert encoder(rows, repeated=1).encode("x\n\ny") == [ids["x"], ids["\n\n"], ids["y"]]
    assert encoder(rows, spaces=1).encode("x y") == [ids["x"], ids[" "], ids["y"]]
    assert encoder(rows, spaces=0).encode("xxay") == [ids["x"], ids["x"], ids["a"], ids["y"]]
    assert encoder(rows, repeated=0).encode("xxay") == PlamoEncoder(rows).encode("xxay")  # no cut
    got = encoder(rows, repeated=0).encode("xaa{-1,}")  # "aa{-1,}" is what (.)\2{-1,} matches
    assert got[0] == ids["x"] and got[1:] == PlamoEncoder(rows).encode("aa{-1,}")


# ---- edges -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("repeated", [None, 1, 3])
@pytest.mark.parametrize("spaces", [None, 1, 3])
def test_empty_and_edge_only_texts(repeated: int | None, spaces: int | None) -> None:
    rows = rows_for(GLUE)
    reference = Reference(rows)
    enc = encoder(rows, repeated, spaces)
    for text in ["", " ", "   ", "<|plamo:op|>", "\uee00", "aaa", "aaa<|plamo:op|>   "]:
        assert enc.encode(text) == split_ids(reference, text, repeated, spaces), text
    assert enc.encode("") == []


def test_sentinel_scored_piece_leaves_no_trailing_zeros() -> None:
    """PLaMo 3's array ends at the last id written (PLaMo 2's keeps zeros, test_encoder.py).
    Checked against the public Plamo3Tokenizer code."""
    rows = rows_for({"é": -1000.0, "a": -1.0})
    e, a = len(rows) - 2, len(rows) - 1
    enc = encoder(rows)
    assert enc.encode("é") == [e]
    assert enc.encode("éa") == [e, a]
    assert enc.encode("ééa") == [4 + 0xC3, 4 + 0xA9, e, a]
    assert enc.encode("é<|plamo:op|>é")[-1] == e
    assert PlamoEncoder(rows).encode("é") == [e, 0]


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_drops_only_the_boundary_character(seed: int) -> None:
    rng = random.Random(5000 + seed)
    rows = rows_for(random_vocab(rng, size=30, alphabet=ALPHABET, longest=4))
    pieces = [row[0] for row in rows]
    enc = encoder(rows, rng.choice([None, 2, 3]), rng.choice([None, 2]))
    for _ in range(30):
        text = random_text(rng, rng.randint(0, 30))
        data = b"".join(
            bytes([int(pieces[i][3:5], 16)]) if 4 <= i < 260 else pieces[i].encode() for i in enc.encode(text)
        )
        assert data.decode("utf-8") == text.replace(BOUNDARY, "")


# ---- PLaMo 2 is untouched -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_plamo2_encoder_ignores_all_of_it(seed: int) -> None:
    """Without plamo3 the whole text is one DP (U+EE00 a character like any other): the same texts
    give PLaMo 2's ids."""
    rng = random.Random(6000 + seed)
    pieces = random_vocab(rng, size=40, alphabet=ALPHABET, longest=6) | {"<|plamo:op|>": 0.0}
    rows = rows_for(pieces)
    reference, plamo2 = Reference(rows), PlamoEncoder(rows)
    assert plamo2.plamo3 is None and BOUNDARY not in plamo2.tables.candidates
    for _ in range(40):
        text = random_text(rng, rng.randint(0, 15))
        assert plamo2.encode(text) == reference.plain_dp(text), text
