"""PLaMo 3's forced cuts: what ``Plamo3Tokenizer``'s ``AhoCorasick.encode`` does to a text before
its DP (docs/tokenizer.md §9).

Two substitutions, in this order, each surrounding every match with BOUNDARY_CHAR (U+EE00):

1. ``<\\|plamo:[^|\\s]{,64}\\|>``: any ``<|plamo:…|>``-shaped string whose body is at most 64
   characters without ``|`` or whitespace, registered or not;
2. when ``tokenizer_config.json`` sets them, one alternation of ``(.)\\2{N-1,}`` (runs of at least
   N equal characters other than newline, ``break_around_repeated_chars_threshold``) and ``" {M,}"``
   (runs of at least M spaces, ``break_around_consecutive_spaces_threshold``), over the text that
   step 1 produced.

The patterns are built from the thresholds exactly as PLaMo builds them (the same f-strings, so
any value means what it means there, see §9).  BOUNDARY_CHAR is a piece of its own that the
encoder drops, so every match is encoded apart from its neighbours and the inserted characters,
like a literal U+EE00 in the input, leave no id.
"""

from __future__ import annotations

import re
from typing import Any

from .vocab import BOUNDARY_CHAR

SPECIAL_TOKEN_PATTERN = re.compile(r"(<\|plamo:[^|\s]{,64}\|>)")
_SURROUND = BOUNDARY_CHAR + r"\1" + BOUNDARY_CHAR


class Plamo3Cuts:
    """The text rewriting of PLaMo 3's encoder, for one pair of thresholds (None = not set)."""

    def __init__(self, repeated_chars_threshold: Any = None, consecutive_spaces_threshold: Any = None) -> None:
        self.repeated_chars_threshold = repeated_chars_threshold
        self.consecutive_spaces_threshold = consecutive_spaces_threshold
        patterns = []
        if repeated_chars_threshold is not None:
            patterns.append(f"(.)\\2{{{repeated_chars_threshold - 1},}}")
        if consecutive_spaces_threshold is not None:
            patterns.append(f" {{{consecutive_spaces_threshold},}}")
        self.runs = re.compile(f"({'|'.join(patterns)})") if patterns else None

    def insert(self, text: str) -> str:
        """``text`` with BOUNDARY_CHAR around every match, as PLaMo 3 rewrites it."""
        if "<|plamo:" in text:  # the only place the first pattern can match
            text = SPECIAL_TOKEN_PATTERN.sub(_SURROUND, text)
        if self.runs is not None:
            text = self.runs.sub(_SURROUND, text)
        return text
