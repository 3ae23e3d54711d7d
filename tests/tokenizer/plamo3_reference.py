"""PLaMo 3's cuts written out from the rule, for checking plamo2_tools.tokenizer (docs/tokenizer.md §9).

Nothing here comes from the package or uses regular expressions: the matches are found by
scanning characters.  The rule, as PFN's ``Plamo3Tokenizer`` (``AhoCorasick.encode``) applies it:

1. left to right, every ``<|plamo:`` + body + ``|>`` whose body is 0 to 64 characters, none of
   them ``|`` or whitespace (``str.isspace``), gets U+EE00 on both sides; a failed attempt moves
   on by one character, a match by its length;
2. then, on that text, left to right: a run of at least N equal characters other than a newline
   (repeated-chars threshold N), else a run of at least M spaces (spaces threshold M), gets U+EE00
   on both sides; only N >= 1 and M >= 1 are modelled here;
3. the text is encoded with U+EE00 as one more piece (score 0, id 10 000 000) whose id is left out.

``split_ids`` encodes the pieces between U+EE00 separately instead of step 3 (what the cuts
mean when no piece contains U+EE00); ``whole_ids`` is step 3 literally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizer_reference import Reference

BOUNDARY = "\uee00"
BOUNDARY_ID = 10_000_000
OPEN, CLOSE, LONGEST_BODY = "<|plamo:", "|>", 64


def mark_special(text: str) -> str:
    """Step 1."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(OPEN, i):
            body = end = i + len(OPEN)
            while end < len(text) and end - body < LONGEST_BODY and text[end] != "|" and not text[end].isspace():
                end += 1
            if text.startswith(CLOSE, end):
                end += len(CLOSE)
                out += [BOUNDARY, text[i:end], BOUNDARY]
                i = end
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def mark_runs(text: str, repeated: int | None, spaces: int | None) -> str:
    """Step 2 (thresholds None = not set)."""
    assert repeated is None or repeated >= 1
    assert spaces is None or spaces >= 1
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        run = 1
        while i + run < len(text) and text[i + run] == char:
            run += 1
        long_repeat = repeated is not None and char != "\n" and run >= repeated
        long_spaces = spaces is not None and char == " " and run >= spaces
        if long_repeat or long_spaces:
            out += [BOUNDARY, text[i : i + run], BOUNDARY]
            i += run
        else:
            out.append(char)
            i += 1
    return "".join(out)


def marked(text: str, repeated: int | None = None, spaces: int | None = None) -> str:
    return mark_runs(mark_special(text), repeated, spaces)


def split_ids(reference: Reference, text: str, repeated: int | None = None, spaces: int | None = None) -> list[int]:
    """Every piece of text between boundaries encoded on its own by PLaMo 2's rule."""
    return [i for part in marked(text, repeated, spaces).split(BOUNDARY) if part for i in reference.plain_dp(part)]


def whole_ids(
    rows: Sequence[Sequence[Any]], text: str, repeated: int | None = None, spaces: int | None = None
) -> list[int]:
    """Step 3: the marked text by PLaMo 2's rule with the boundary as a piece, its id left out."""
    reference = Reference(rows)
    reference.pieces[BOUNDARY] = (BOUNDARY_ID, 0)  # replaces a row of that piece, as PLaMo 3's table does
    return [i for i in reference.plain_dp(marked(text, repeated, spaces)) if i != BOUNDARY_ID]
