"""Reading PLaMo's ``tokenizer.jsonl`` into the tables the encoder needs (docs/tokenizer.md §1–2).

One JSON array per line, line index = token id: ``[piece, score, type, ...]`` with the types
``NORMAL``, ``CONTROL``, ``UNKNOWN`` and ``BYTE``; extra columns are ignored.  Every row that is
not ``BYTE`` is a piece the encoder may pick (control tokens too: they score 0), and its integer
score is ``round(score * 1e4)``.  Where a piece string appears on several rows the tables keep
what PLaMo's own code keeps: the last row's score among the non-byte rows, and the last row's id
among all rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..jsonio import MiB, parse_json
from ..safe_files import read_regular

VOCAB_BYTES = 256 * MiB  # PLaMo's 100k-row tokenizer.jsonl is about 10 MB
# The flavours of PLaMo's tokenizer (the same file, read by two classes: docs/tokenizer.md §9), and
# the class of each; a model family declares the one its checkpoints carry (Family.tokenizer_flavour).
FLAVOURS = {"plamo2": "Plamo2Tokenizer", "plamo3": "Plamo3Tokenizer"}
# The encoder keeps every suffix of every piece (PLaMo's suffix table), so a piece of n characters
# costs n(n+1)/2 of them: one row of a million characters took 22.9 GB (issue 28).  Real pieces are
# a few characters; these bounds are far above them and keep the table to a few hundred MB.
MAX_PIECE_CHARS = 1024
MAX_SUFFIX_CHARS = 2**26  # the sum of n(n+1)/2 over the pieces (PLaMo 2's 100k rows: about 2 million)

# PLaMo's integer sentinels: rows scoring at or below INVALID_SCORE are never chosen, and a character
# no piece covers costs -UNKNOWN_SCORE and becomes its UTF-8 byte tokens.
INVALID_SCORE = -20_000_000
UNKNOWN_SCORE = -10_000_000
# PLaMo 3's boundary (docs/tokenizer.md §9): Plamo3Tokenizer adds this character as one more piece
# (score 0) after the file's rows, under an id no row has, and never emits that id.
BOUNDARY_CHAR = "\uee00"
BOUNDARY_TOKEN_ID = 10_000_000
_INT32 = 2**31


@dataclass
class VocabTables:
    """Everything the encoder and decoder read, built once per vocabulary."""

    pieces: list[str]  # row id -> piece string
    kinds: list[str]  # row id -> type column ("NORMAL" when the row has none)
    byte_ids: list[int]  # byte value -> id of its <0xHH> row
    candidates: dict[str, tuple[int, int]]  # piece -> (token id, integer score) for pieces that can be chosen
    suffixes: set[str] = field(repr=False)  # every non-byte piece and each of its suffixes, plus ""
    sentinel_pieces: bool = False  # some piece scores exactly UNKNOWN_SCORE (see encoder._State)

    @property
    def rows(self) -> int:
        return len(self.pieces)


def read_rows(path: str | Path) -> list[list[Any]]:
    """The JSON rows of a tokenizer.jsonl, one per line (a line that is not an array is an error)."""
    path = Path(path)
    # A regular file of bounded size (a FIFO is refused at once), each line of bounded depth.
    data = read_regular(path, VOCAB_BYTES)
    return [parse_json(line, f"{path}:{number}") for number, line in enumerate(data.splitlines(), 1)]


def integer_score(score: float) -> int:
    """PLaMo's table value for a score: round(score·1e4) (Python's round), INVALID_SCORE when not finite."""
    if not math.isfinite(score):
        return INVALID_SCORE
    scaled = score * 1e4
    if not math.isfinite(scaled):  # build_tables refuses such rows first (_check_row)
        raise UserError(f"score {score!r} does not fit PLaMo's int32 score table")
    value = round(scaled)
    if not -_INT32 <= value < _INT32:  # PLaMo stores it in an int32 table and fails to load such a file
        raise UserError(f"score {score!r} does not fit PLaMo's int32 score table")
    return value


def check_vocab_file(path: str | Path) -> None:
    """Refuse a tokenizer.jsonl the loader would refuse (one line), without building the suffix
    table: what `convert` checks of a checkpoint's tokenizer before copying it into the shards
    (a row no run can load was copied, digested, and then crashed every decode: issue 28)."""
    build_tables(read_rows(path), str(path), suffixes=False)


def build_tables(
    rows: Sequence[Sequence[Any]], where: str = "tokenizer.jsonl", boundary: bool = False, suffixes: bool = True
) -> VocabTables:
    """Validate the rows and build the piece/score tables (the same choices as PLaMo's loader).

    ``boundary`` (PLaMo 3): BOUNDARY_CHAR becomes a piece scoring 0 with id BOUNDARY_TOKEN_ID, as if
    a row ``[BOUNDARY_CHAR, 0, "CONTROL"]`` came after the last one (it replaces a row of that piece).
    ``suffixes=False`` leaves the suffix table empty (validation only).
    """
    pieces: list[str] = []
    kinds: list[str] = []
    byte_ids = [0] * 256
    token_to_id: dict[str, int] = {}
    score_of: dict[str, float] = {}
    suffix_chars = 0
    for token_id, row in enumerate(rows):
        piece, score, kind = _check_row(row, token_id, where)
        if kind != "BYTE":
            suffix_chars += len(piece) * (len(piece) + 1) // 2
            if suffix_chars > MAX_SUFFIX_CHARS:
                why = "PLaMo's table holds every suffix of every piece"
                raise UserError(
                    f"{where}: the pieces up to row {token_id} have more than {MAX_SUFFIX_CHARS} "
                    f"characters of suffixes ({why}): refused"
                )
        pieces.append(piece)
        kinds.append(kind)
        token_to_id[piece] = token_id
        if kind == "BYTE":
            byte_ids[_byte_value(piece, token_id, where)] = token_id
            continue
        if piece == "":
            raise UserError(f"{where}: row {token_id} has an empty piece (PLaMo's loader refuses it)")
        score_of[piece] = score
    if boundary:
        token_to_id[BOUNDARY_CHAR] = BOUNDARY_TOKEN_ID
        score_of[BOUNDARY_CHAR] = 0.0
    missing = [f"<0x{b:02X}>" for b in range(256) if byte_ids[b] == 0]
    if missing:
        raise UserError(
            f"{where}: no BYTE row (other than id 0) for {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        )
    candidates: dict[str, tuple[int, int]] = {}
    for piece, score in score_of.items():
        value = integer_score(score)
        if value > INVALID_SCORE:
            candidates[piece] = (token_to_id[piece], value)
    return VocabTables(
        pieces=pieces,
        kinds=kinds,
        byte_ids=byte_ids,
        candidates=candidates,
        suffixes=_suffix_set(score_of) if suffixes else set(),
        sentinel_pieces=any(score == UNKNOWN_SCORE for _, score in candidates.values()),
    )


def _check_row(row: Any, token_id: int, where: str) -> tuple[str, float, str]:
    if not isinstance(row, list) or len(row) < 2:
        raise UserError(f"{where}: row {token_id} is not a [piece, score, ...] array")
    piece, score = row[0], row[1]
    if not isinstance(piece, str) or isinstance(score, bool) or not isinstance(score, (int, float)):
        raise UserError(f"{where}: row {token_id} needs a string piece and a numeric score, got {row[:2]!r}")
    try:
        value = float(score)
    except OverflowError:
        raise UserError(f"{where}: row {token_id} has a score too large for a float") from None
    if math.isfinite(value) and not (math.isfinite(value * 1e4) and -_INT32 <= round(value * 1e4) < _INT32):
        # 1e308: round(inf) raised OverflowError here, as it does in PLaMo's own loader (issue 28)
        raise UserError(f"{where}: row {token_id} has score {value!r}, which does not fit PLaMo's int32 score table")
    if len(piece) > MAX_PIECE_CHARS:
        raise UserError(
            f"{where}: row {token_id} has a piece of {len(piece)} characters, more than the "
            f"{MAX_PIECE_CHARS} a piece may have: refused"
        )
    if not piece.isascii():
        try:
            piece.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON): no text decodes to it
            raise UserError(
                f"{where}: row {token_id} has a piece with a lone surrogate "
                f"(U+{ord(piece[e.start]):04X}), which is not text: refused"
            ) from None
    # Only "BYTE" changes how a row is read; PLaMo's code treats any other type column as a piece.
    kind = row[2] if len(row) > 2 and isinstance(row[2], str) else "NORMAL"
    return piece, value, kind


def _byte_value(piece: str, token_id: int, where: str) -> int:
    hexdigits = piece[3:5]
    if len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">") or not _is_hex(hexdigits):
        raise UserError(f"{where}: BYTE row {token_id} is {piece!r}, not <0xHH>")
    return int(hexdigits, 16)


def _is_hex(text: str) -> bool:
    return len(text) == 2 and all(c in "0123456789abcdefABCDEF" for c in text)


def _suffix_set(pieces: Iterable[str]) -> set[str]:
    """Every piece with all its suffixes: the strings PLaMo's suffix table has rows for."""
    suffixes = {""}
    for piece in pieces:
        for start in range(len(piece)):
            tail = piece[start:]
            if tail in suffixes:  # then every shorter suffix is there too
                break
            suffixes.add(tail)
    return suffixes
