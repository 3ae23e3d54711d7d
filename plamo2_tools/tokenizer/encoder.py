"""PLaMo's encoding in pure Python and numpy: the same ids as ``tokenization_plamo.py`` (docs/tokenizer.md §3–4).

The segmentation is a best path over Unicode code points: every piece that matches at a position
is a candidate worth its integer score, a character no piece covers costs -UNKNOWN_SCORE and
becomes its UTF-8 byte tokens, and the path with the largest total score wins.  PLaMo computes
it from the end of the text towards the start (``cost[i]`` = the least cost of encoding
``text[i:]``) and walks the result from the start, taking at each position the *longest* piece
among those that reach the optimum; ties are exact because the scores are integers.

The candidates at a position are found with PLaMo's suffix structure: a state is the longest
string that is a suffix of some piece and starts at the position, its candidates are the pieces
among its prefixes, and stepping one character to the left has a memoised transition.

What makes this fast without numba: a text splits at every boundary between two characters that
sit next to each other in no piece (no piece can cover such a boundary, so both sides encode
independently and exactly as the whole would); the parts are words and punctuation for usual
vocabularies, and their ids come from a dictionary after the first time.  Short texts find their
cuts with a set of the pairs, longer ones with numpy (_PairTable).

PLaMo 3 (``plamo3=Plamo3Cuts(...)``, docs/tokenizer.md §9) is the same encoder on a rewritten text:
U+EE00 around every ``<|plamo:…|>`` string and threshold run, U+EE00 a piece of its own whose id
is dropped.  Where no other piece holds U+EE00 (real vocabularies have none), the splitting above
cuts on both sides of it by itself.  PLaMo 3's array also ends where its last id was written, so
the trailing zeros of docs/tokenizer.md §2 do not appear.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from .plamo3 import Plamo3Cuts
from .vocab import BOUNDARY_TOKEN_ID, UNKNOWN_SCORE, VocabTables, build_tables, read_rows

_HASH_A = np.uint32(0x9E3779B1)  # multiplicative hashing of a character pair (Knuth's constant)
_HASH_B = np.uint32(0x85EBCA77)
_HASH_C = np.uint32(0xC2B2AE3D)
_HASH_D = np.uint32(0x27D4EB2F)


class _State:
    """The longest piece-suffix starting at a position, with what the DP needs from it.

    The options are (−length, score, token id) for the candidate pieces, longest first, then
    PLaMo's unknown sentinel (−1, UNKNOWN_SCORE, −1 = byte fallback) unless a one-character piece
    always beats it, split into ``first`` and ``rest`` for the DP's inner loop.  ``next``
    memoises the step one character to the left, ``rows`` the prefixes that step tries.
    """

    __slots__ = ("first", "next", "rest", "rows", "text")

    def __init__(self, text: str, options: list[tuple[int, int, int]]) -> None:
        self.text = text
        self.first = options[0]
        self.rest = tuple(options[1:])
        self.next: dict[str, _State] = {}
        self.rows: list[str | None] | None = None  # filled by PlamoEncoder._rows when first stepped from


class PlamoEncoder:
    """text -> token ids for one ``tokenizer.jsonl`` (special tokens are the transformers layer's business)."""

    max_cached_chars = 64  # parts longer than this are solved every time (they rarely repeat)
    max_cache_entries = 200_000
    max_transitions = 2_000_000  # memoised steps kept before the state graph is rebuilt
    short_text = 256  # up to this many characters, cuts are found character by character

    def __init__(
        self, rows: Sequence[Sequence[Any]], where: str = "tokenizer.jsonl", plamo3: Plamo3Cuts | None = None
    ) -> None:
        self.plamo3 = plamo3  # None: PLaMo 2's encoder
        self.tables: VocabTables = build_tables(rows, where, boundary=plamo3 is not None)
        self._cache: dict[str, tuple[int, ...]] = {}
        self._reset_states()
        # A piece scored exactly like PLaMo's sentinel changes how its suffix walk ends (see
        # _step); the boundary argument for splitting does not cover that, so such a
        # vocabulary is encoded in one piece per text.
        self._pair_table = None if self.tables.sentinel_pieces else _PairTable(self.tables.candidates)
        self._pairs = {piece[k : k + 2] for piece in self.tables.candidates for k in range(len(piece) - 1)}

    @classmethod
    def from_file(cls, path: str | Path, plamo3: Plamo3Cuts | None = None) -> PlamoEncoder:
        return cls(read_rows(path), str(path), plamo3)

    @property
    def rows(self) -> int:
        return self.tables.rows

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """PLaMo's ids for ``text`` (what ``AhoCorasick.encode`` returns)."""
        if not text:
            return []
        if self.plamo3 is not None:
            text = self.plamo3.insert(text)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # raises on lone surrogates, as PLaMo does
        if self._pair_table is None or len(codes) < 2:
            ids, filler = self._solve(text)
            return ids + [0] * filler  # see _solve: PLaMo's array ends with `filler` unfilled ids
        if len(text) <= self.short_text:  # numpy's per-call cost outweighs its per-character speed
            pairs = self._pairs
            bounds = [k for k in range(1, len(text)) if text[k - 1 : k + 1] not in pairs]
        else:
            bounds = (np.flatnonzero(self._cuts(codes)) + 1).tolist()
        parts = _slices(text, bounds)
        found: list[tuple[int, ...] | None] = list(map(self._cache.get, parts))
        if None in found:
            self._fill(parts, found)
        return list(chain.from_iterable(found))  # type: ignore[arg-type]

    def _cuts(self, codes: np.ndarray) -> np.ndarray:
        """For each boundary between two characters: True where no candidate piece can span it.

        A boundary between a and b is spanned only by a piece containing "ab" (docs/tokenizer.md §4).
        """
        return ~self._pair_table.joined(codes)  # type: ignore[union-attr]

    def _fill(self, parts: list[str], found: list[tuple[int, ...] | None]) -> None:
        """Solve the parts the cache did not have (each distinct one once, even if it repeats)."""
        get = self._cache.get
        index = found.index(None)  # list.index scans in C: the loop visits only the misses
        while True:
            part = parts[index]
            ids = get(part)
            found[index] = ids if ids is not None else self._remember(part, self._solve(part)[0])
            try:
                index = found.index(None, index + 1)
            except ValueError:
                return

    def _remember(self, text: str, ids: list[int]) -> tuple[int, ...]:
        """Cache the ids of a part: cut at both ends, they do not depend on what surrounds it."""
        part = tuple(ids)
        if len(text) <= self.max_cached_chars:
            if len(self._cache) >= self.max_cache_entries:
                self._cache.clear()
            self._cache[text] = part
        return part

    # ---- the best path over one part -------------------------------------------------------------
    def _solve(self, text: str) -> tuple[list[int], int]:
        """Ids of ``text`` by PLaMo's DP, and how many trailing zero ids PLaMo's array would get."""
        if self._transitions > self.max_transitions:
            self._reset_states()
        # cost[i] for i = n, n-1, ..., 0 is appended to `rev`, so rev[-L] is cost[i + L] while
        # cost[i] is computed (options store -L).  The first option reaching the least cost is
        # kept: options are longest first, so that is PLaMo's choice at this position.
        rev = [0]
        chosen: list[tuple[int, int, int]] = []
        push, keep = rev.append, chosen.append
        state = self._root
        step = self._step
        for char in reversed(text):
            state = state.next.get(char) or step(state, char)
            choice = state.first
            best = rev[choice[0]] - choice[1]
            for option in state.rest:
                value = rev[option[0]] - option[1]
                if value < best:
                    best = value
                    choice = option
            push(best)
            keep(choice)
        # Walk from the start along the choices.
        ids: list[int] = []
        filler = 0
        n = len(text)
        i = 0
        while i < n:
            neg_length, score, token = chosen[n - 1 - i]
            if token < 0:
                ids.extend(self._byte_ids_of(text[i]))
            else:
                ids.append(token)
                if score == UNKNOWN_SCORE:
                    # PLaMo counts output slots as if this piece were byte fallback, fills one, and
                    # leaves the rest of its array zero at the end: reproduced, not endorsed.
                    filler += len(text[i].encode("utf-8")) - 1
            i -= neg_length
        if self.plamo3 is not None:  # PLaMo 3 skips the boundary's id and returns only what it wrote
            return [token for token in ids if token != BOUNDARY_TOKEN_ID], 0
        return ids, filler

    def _byte_ids_of(self, char: str) -> list[int]:
        return [self.tables.byte_ids[b] for b in char.encode("utf-8")]

    # ---- PLaMo's suffix structure, built as it is visited ------------------------------------------
    def _reset_states(self) -> None:
        self._states: dict[str, _State] = {}
        self._transitions = 0
        self._root = self._state("")

    def _state(self, text: str) -> _State:
        state = self._states.get(text)
        if state is None:
            state = self._states[text] = self._make_state(text)
        return state

    def _make_state(self, text: str) -> _State:
        candidates = self.tables.candidates
        options: list[tuple[int, int, int]] = []
        for length in range(len(text), 0, -1):
            found = candidates.get(text[:length])
            if found is None:
                continue
            token, score = found
            options.append((-length, score, token))
            if score == UNKNOWN_SCORE:  # PLaMo stops its candidate rows here, sentinel included
                break
        else:
            # A one-character piece scoring above the sentinel always beats it, so it is left out.
            if not (options and options[-1][0] == -1 and options[-1][1] > UNKNOWN_SCORE):
                options.append((-1, UNKNOWN_SCORE, -1))
        return _State(text, options)

    def _step(self, state: _State, char: str) -> _State:
        """The state one character to the left: char + the longest prefix of ``state.text`` for which
        that is still a piece-suffix (PLaMo's search order, including its early stop)."""
        if state.rows is None:
            state.rows = self._rows(state.text)
        suffixes = self.tables.suffixes
        result = self._root
        for prefix in state.rows:  # PLaMo's rows for this state, longest first, "" last
            if prefix is None:  # a piece scored like the sentinel: PLaMo's search ends here
                break
            if char + prefix in suffixes:
                result = self._state(char + prefix)
                break
        state.next[char] = result
        self._transitions += 1
        return result

    def _rows(self, text: str) -> list[str | None]:
        """The prefixes of ``text`` that are piece-suffixes, longest first, then "" (PLaMo's rows for
        this state), with None in place of the search's end after a sentinel-scored piece."""
        suffixes = self.tables.suffixes
        sentinel = self.tables.sentinel_pieces
        rows: list[str | None] = []
        for length in range(len(text), 0, -1):
            prefix = text[:length]
            if prefix in suffixes:
                rows.append(prefix)
                if sentinel and self.tables.candidates.get(prefix, (0, 0))[1] == UNKNOWN_SCORE:
                    rows.append(None)
                    return rows
        rows.append("")
        return rows


def _slices(text: str, bounds: list[int]) -> list[str]:
    """text cut at the given positions (sorted, strictly inside)."""
    if not bounds:
        return [text]
    return [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]


class _PairTable:
    """Which pairs of neighbouring characters occur inside candidate pieces.

    Exact for ASCII pairs (a 128 x 128 table: English text's boundaries); other pairs go through a
    two-hash Bloom filter with ~64 slots per pair, whose rare false "yes" only costs a missed cut.
    """

    def __init__(self, candidates: Iterable[str]) -> None:
        long_pieces = [p for p in candidates if len(p) > 1]
        keys = np.zeros(0, dtype=np.uint64)
        if long_pieces:
            codes = np.frombuffer("".join(long_pieces).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
            starts = np.cumsum([len(p) for p in long_pieces])[:-1]
            inside = np.ones(len(codes) - 1, dtype=bool)
            inside[starts - 1] = False  # the pair across two joined pieces is not a pair of either
            keys = np.unique((codes[:-1][inside] << np.uint64(21)) | codes[1:][inside])
        a = (keys >> np.uint64(21)).astype(np.uint32)
        b = (keys & np.uint64((1 << 21) - 1)).astype(np.uint32)
        self.ascii = np.zeros(128 * 128, dtype=bool)
        small = (a < 128) & (b < 128)
        self.ascii[a[small] * 128 + b[small]] = True
        bits = 12
        while (1 << bits) < 64 * len(keys) and bits < 25:
            bits += 1
        self.shift = np.uint32(32 - bits)
        self.bloom = np.zeros(1 << bits, dtype=bool)
        for h in self._hashes(a, b):
            self.bloom[h] = True

    def _hashes(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ((a * _HASH_A) ^ (b * _HASH_B)) >> self.shift, ((a * _HASH_C) ^ (b * _HASH_D)) >> self.shift

    def joined(self, codes: np.ndarray) -> np.ndarray:
        """For each boundary of ``codes``: may a candidate piece span it?"""
        a, b = codes[:-1], codes[1:]
        h1, h2 = self._hashes(a, b)
        maybe = self.bloom[h1] & self.bloom[h2]
        ascii_pair = (a | b) < 128
        if ascii_pair.any():
            maybe[ascii_pair] = self.ascii[a[ascii_pair] * 128 + b[ascii_pair]]
        return maybe
