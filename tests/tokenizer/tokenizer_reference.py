"""Independent formulations of PLaMo's segmentation, for checking plamo2_tools.tokenizer.

Neither uses the package's suffix structure, its splitting or its cache; both read the rows
themselves.  The rule they spell out (docs/tokenizer.md §3): among all segmentations of the text
into candidate pieces (non-byte rows scoring above -2000 after round(score * 1e4)) and unknown
characters (cost 10^7 each, emitted as UTF-8 byte tokens), the least total cost wins; between
equal costs, the one whose first token is longer wins, then the same at the next token, and a
piece beats an unknown character of the same length.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

INVALID = -20_000_000
UNKNOWN_COST = 10_000_000
CONTROL = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>"]


class Reference:
    def __init__(self, rows: Sequence[Sequence[Any]]) -> None:
        self.pieces: dict[str, tuple[int, int]] = {}  # piece -> (id, cost)
        self.byte_ids = {}
        for token_id, row in enumerate(rows):
            if len(row) > 2 and row[2] == "BYTE":
                self.byte_ids[int(row[0][3:5], 16)] = token_id
                continue
            value = round(float(row[1]) * 1e4)
            if value > INVALID:
                self.pieces[row[0]] = (token_id, -value)
        self.longest = max(map(len, self.pieces), default=1)

    def options(self, text: str, i: int) -> list[tuple[int, int, int | None]]:
        """(length, cost, id or None for unknown) at position i, in preference order."""
        out = []
        for length in range(min(self.longest, len(text) - i), 0, -1):
            found = self.pieces.get(text[i : i + length])
            if found is not None:
                out.append((length, found[1], found[0]))
        out.append((1, UNKNOWN_COST, None))
        return out

    def ids(self, text: str, path: Sequence[tuple[int, int | None]]) -> list[int]:
        out, i = [], 0
        for length, token in path:
            if token is None:
                out += [self.byte_ids[b] for b in text[i].encode("utf-8")]
            else:
                out.append(token)
            i += length
        return out

    def brute_force(self, text: str) -> list[int]:
        """Every segmentation, compared by (total cost, preference sequence)."""
        best: tuple[int, list[tuple[int, int]], list[tuple[int, int | None]]] | None = None

        def visit(i: int, cost: int, rank: list[tuple[int, int]], path: list[tuple[int, int | None]]) -> None:
            nonlocal best
            if i == len(text):
                if best is None or (cost, rank) < (best[0], best[1]):
                    best = (cost, list(rank), list(path))
                return
            for order, (length, c, token) in enumerate(self.options(text, i)):
                rank.append((-length, order))  # longer first; among equal lengths, a piece before unknown
                path.append((length, token))
                visit(i + length, cost + c, rank, path)
                rank.pop()
                path.pop()

        visit(0, 0, [], [])
        assert best is not None
        return self.ids(text, best[2])

    def plain_dp(self, text: str) -> list[int]:
        """Least cost to the end from every position by substring lookups, then the longest optimal step."""
        n = len(text)
        cost = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            cost[i] = min(c + cost[i + length] for length, c, _ in self.options(text, i))
        path, i = [], 0
        while i < n:
            length, _, token = next(o for o in self.options(text, i) if o[1] + cost[i + o[0]] == cost[i])
            path.append((length, token))
            i += length
        return self.ids(text, path)


def rows_for(pieces: dict[str, float]) -> list[list[Any]]:
    """tokenizer.jsonl rows: PLaMo's first control rows, the 256 byte rows, then the pieces."""
    rows: list[list[Any]] = [[CONTROL[0], 0.0, "UNKNOWN"]] + [[t, 0.0, "CONTROL"] for t in CONTROL[1:]]
    rows += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    rows += [[p, s, "NORMAL"] for p, s in pieces.items()]
    return rows


# Characters for random texts: ASCII, 2/3/4-byte UTF-8, a combining mark, NUL, BOM, newline.
ALPHABET = ["a", "b", "c", " ", "é", "日", "本", "👍", "\u0301", "\x00", "\ufeff", "\n"]
SCORES = [-1.0, -2.0, -3.0, -1.5, -0.5, -4.0]  # few values, so equal totals (ties) are common


def random_vocab(
    rng: random.Random, size: int, alphabet: Sequence[str] = ALPHABET, longest: int = 4
) -> dict[str, float]:
    """Random pieces over part of the alphabet (the rest needs byte fallback); some random scores."""
    covered = rng.sample(list(alphabet), k=max(1, len(alphabet) * 2 // 3))
    pieces: dict[str, float] = {}
    for _ in range(50 * size):  # fewer when the covered characters cannot make `size` distinct pieces
        if len(pieces) == size:
            break
        piece = "".join(rng.choice(covered) for _ in range(rng.randint(1, longest)))
        pieces[piece] = rng.choice(SCORES) if rng.random() < 0.8 else round(rng.uniform(-6.0, 0.0), 5)
    return pieces


def random_text(rng: random.Random, length: int, alphabet: Sequence[str] = ALPHABET) -> str:
    return "".join(rng.choice(alphabet) for _ in range(length))
