"""PlamoEncoder against the independent formulations in tokenizer_reference.py.

Random vocabularies over a small alphabet with few distinct scores make ties, pieces that are
prefixes and suffixes of one another, and characters no piece covers (2-, 3- and 4-byte UTF-8,
a combining mark, NUL, U+FEFF) common; random texts over the same alphabet exercise them.
"""

from __future__ import annotations

import random

import pytest
from tokenizer_reference import ALPHABET, Reference, random_text, random_vocab, rows_for

from plamo2_tools.errors import UserError
from plamo2_tools.tokenizer import PlamoEncoder


def byte_ids(text: str) -> list[int]:
    """Ids of the <0xHH> rows in rows_for(): 4 control rows come first."""
    return [4 + b for b in text.encode("utf-8")]


@pytest.mark.parametrize("seed", range(12))
def test_short_texts_match_every_segmentation(seed: int) -> None:
    rng = random.Random(seed)
    pieces = random_vocab(rng, size=rng.choice([3, 8, 20, 40]))
    rows = rows_for(pieces)
    encoder, reference = PlamoEncoder(rows), Reference(rows)
    for _ in range(40):
        text = random_text(rng, rng.randint(0, 6))
        assert encoder.encode(text) == reference.brute_force(text), (pieces, text)


@pytest.mark.parametrize("seed", range(12))
def test_long_texts_match_a_plain_dp(seed: int) -> None:
    rng = random.Random(100 + seed)
    pieces = random_vocab(rng, size=rng.choice([5, 30, 120]), longest=rng.choice([2, 4, 7]))
    rows = rows_for(pieces)
    encoder, reference = PlamoEncoder(rows), Reference(rows)
    for _ in range(10):
        text = random_text(rng, rng.randint(20, 300))
        assert encoder.encode(text) == reference.plain_dp(text), (pieces, text)
    # The same texts again: now parts come from the cache.
    rng = random.Random(100 + seed)
    random_vocab(rng, size=len(pieces))
    for _ in range(10):
        text = random_text(rng, rng.randint(20, 300))
        assert encoder.encode(text) == reference.plain_dp(text)


def test_word_like_vocabulary_splits_and_caches_exactly() -> None:
    """Pieces that never hold a space after a letter make texts split at word ends; a piece that
    does ("d e") must stop that split wherever it could match."""
    pieces = {" a": -1.0, " b": -1.0, "a": -2.0, "b": -2.0, "ab": -2.5, " ab": -1.5, " ": -3.0, "d": -2.0, "e": -2.0}
    rows = rows_for(pieces)
    encoder, reference = PlamoEncoder(rows), Reference(rows)
    text = " ab a b ab  abab ba"
    assert encoder._cuts(_codes(text)).sum() > 5  # the text is cut into parts
    assert encoder.encode(text) == reference.plain_dp(text)
    rows = rows_for({**pieces, "d e": -0.1})
    encoder, reference = PlamoEncoder(rows), Reference(rows)
    for text in ["d e", "ad e ab", "d ed e", "dd  e"]:
        assert encoder.encode(text) == reference.plain_dp(text)
    assert encoder.encode("ad e") == [rows.index(["a", -2.0, "NORMAL"]), rows.index(["d e", -0.1, "NORMAL"])]


def _codes(text: str):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def test_ties_go_to_the_longest_first_piece() -> None:
    rows = rows_for({"a": -1.0, "b": -1.0, "ab": -2.0, "abc": -3.0, "c": -1.0, "bc": -1.0})
    ids = {row[0]: i for i, row in enumerate(rows)}
    encoder = PlamoEncoder(rows)
    assert encoder.encode("ab") == [ids["ab"]]  # "ab" costs what "a" + "b" cost
    assert encoder.encode("abc") == [ids["a"], ids["bc"]]  # cheaper than "abc" and "ab" + "c"
    rows = rows_for({"a": -1.0, "b": -1.0, "ab": -2.0, "c": -1.0, "bc": -2.0})
    ids = {row[0]: i for i, row in enumerate(rows)}
    # ab+c, a+bc and a+b+c all cost 3: the longest first piece, then the longest next one.
    assert PlamoEncoder(rows).encode("abc") == [ids["ab"], ids["c"]]


def test_scores_are_compared_as_integers() -> None:
    # round(score * 1e4): -1.00004 and -1.0 are the same score, -1.00006 is worse.
    rows = rows_for({"a": -0.5, "aa": -1.00004})
    assert PlamoEncoder(rows).encode("aa") == [len(rows) - 1]  # tie -> the longer piece
    rows = rows_for({"a": -0.5, "aa": -1.00006})
    assert PlamoEncoder(rows).encode("aa") == [len(rows) - 2] * 2


@pytest.mark.parametrize(
    "text",
    ["€", "日本", "👍🏽", "👨\u200d👩\u200d👧", "e\u0301", "\x00", "\ufeffa", "a\ufeff", "\U0010ffff"],
)
def test_characters_without_a_piece_become_their_utf8_bytes(text: str) -> None:
    rows = rows_for({"a": -1.0})
    expected = [x for c in text for x in ([len(rows) - 1] if c == "a" else byte_ids(c))]
    assert PlamoEncoder(rows).encode(text) == expected


def test_unknown_costs_more_than_any_usual_piece_but_not_everything() -> None:
    # A character may be covered by a piece scoring below -1000: then its bytes are cheaper.
    rows = rows_for({"x": -1500.0, "y": -999.0})
    assert PlamoEncoder(rows).encode("xy") == byte_ids("x") + [len(rows) - 1]
    # Below -2000 a piece is invalid altogether (never chosen), as in PLaMo's table.
    rows = rows_for({"xy": -2500.0, "y": -1.0})
    assert PlamoEncoder(rows).encode("xy") == byte_ids("x") + [len(rows) - 1]


@pytest.mark.parametrize("text", ["", " ", "   ", "\n", "\t \n ", "\u3000"])
def test_empty_and_whitespace_only(text: str) -> None:
    rows = rows_for({" ": -1.0, "  ": -1.5, "\n": -1.0})
    assert PlamoEncoder(rows).encode(text) == Reference(rows).brute_force(text)


def test_control_rows_are_pieces_and_byte_rows_are_not() -> None:
    rows = rows_for({"<": -1.0, "|": -1.0})
    encoder = PlamoEncoder(rows)
    assert encoder.encode("<|plamo:eos|>") == [2]  # scores 0: cheaper than any spelling of it
    assert encoder.encode("<0x41>") == [len(rows) - 2] + byte_ids("0x41") + byte_ids(">")


def test_sentinel_scored_piece_reproduces_plamo() -> None:
    """A piece scoring exactly -1000 collides with PLaMo's sentinel: PLaMo emits the piece, sizes
    its output as if it were byte fallback (zeros left at the end), and its suffix search stops at
    that row.  These outputs were checked against tokenization_plamo.py + numba."""
    rows = rows_for({"é": -1000.0, "a": -1.0})
    e, a = len(rows) - 2, len(rows) - 1
    encoder = PlamoEncoder(rows)
    assert encoder.encode("é") == [e, 0]
    assert encoder.encode("éa") == [e, a, 0]
    assert encoder.encode("ééa") == byte_ids("é") + [e, a, 0]
    rows = rows_for({"x": -1.0, "yx": -1000.0, "zyx": -3.0, "y": -2.0, "z": -2.0, "wzy": -0.5})
    ids = {row[0]: i for i, row in enumerate(rows)}
    encoder = PlamoEncoder(rows)
    assert encoder.encode("zyx") == [ids["zyx"]]
    assert encoder.encode("wzyx") == [ids["wzy"], ids["x"]]
    assert encoder.encode("wzyxzyx") == [ids["wzy"], ids["x"], ids["zyx"]]
    # The row list of a state ends at such a piece ("a" + "b" would be cheaper than "ab"), and the
    # search for the state one character to the left ends there too (so the first "a"/"z" has
    # no candidate and becomes bytes).
    rows = rows_for({"ab": -1000.0, "a": -1.0, "b": -1.0})
    ab = len(rows) - 3
    assert PlamoEncoder(rows).encode("ab") == [ab]
    assert PlamoEncoder(rows).encode("aab") == byte_ids("a") + [ab]
    rows = rows_for({"xy": -1000.0, "x": -1.0, "y": -1.0, "z": -1.0})
    xy, x, z = len(rows) - 4, len(rows) - 3, len(rows) - 1
    assert PlamoEncoder(rows).encode("zxy") == byte_ids("z") + [xy]
    assert PlamoEncoder(rows).encode("zx") == [z, x]


def test_repeated_pieces_keep_the_last_score_and_id() -> None:
    rows = rows_for({"a": -1.0, "b": -1.0, "ab": -5.0})
    rows.append(["ab", -0.5, "NORMAL"])  # a later row with the same piece wins
    assert PlamoEncoder(rows).encode("ab") == [len(rows) - 1]


def test_bad_files_are_refused() -> None:
    rows = rows_for({"a": -1.0})
    with pytest.raises(UserError, match="BYTE row"):
        PlamoEncoder(rows[:100] + rows[101:])
    with pytest.raises(UserError, match="empty piece"):
        PlamoEncoder([*rows, ["", -1.0, "NORMAL"]])
    with pytest.raises(UserError, match="not <0xHH>"):
        PlamoEncoder([*rows, ["<0x4>", 0.0, "BYTE"]])
    with pytest.raises(UserError, match="numeric score"):
        PlamoEncoder([*rows, ["x", "1.0", "NORMAL"]])


def test_lone_surrogates_fail_as_in_plamo() -> None:
    with pytest.raises(UnicodeEncodeError):
        PlamoEncoder(rows_for({"a": -1.0})).encode("a\ud800")


def test_all_of_the_alphabet_round_trips_through_bytes() -> None:
    rows = rows_for({"a": -1.0, "日本": -1.0})
    pieces = [row[0] for row in rows]
    text = "".join(ALPHABET) * 3
    ids = PlamoEncoder(rows).encode(text)
    data = b"".join(bytes([int(pieces[i][3:5], 16)]) if i < 260 else pieces[i].encode() for i in ids)
    assert data.decode("utf-8") == text
