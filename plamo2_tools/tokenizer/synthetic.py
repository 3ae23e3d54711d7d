"""PLaMo-format tokenizer files for synthetic checkpoints (docs/tokenizer.md §6).

``tokenizer.jsonl`` has PLaMo's structure: control rows 0–6 (unknown, BOS, EOS, pad, op and two
reserved rows), the 256 ``<0xHH>`` byte rows, then normal pieces with scores.  The pieces are
learned from the embedded text in ``corpus.py`` the way a unigram tokenizer would: candidate
pieces are substrings of pre-tokens (words with an optional leading space, up to three digits,
runs of kana/kanji, runs of one whitespace character, punctuation), scored by a few rounds of
hard EM (best segmentation of every pre-token, counts of the pieces it uses).  Overlapping pieces
with different scores make the encoder choose between segmentations for real.  Vocabularies
larger than the corpus supports are filled with generated pseudo-words, numbers and kanji pairs
scored below every learned piece, so the 100k-row size of a real PLaMo 2 vocabulary can be
reached for benchmarks.

``tokenizer_config.json`` and ``special_tokens_map.json`` carry the keys real checkpoints have;
BOS, EOS and pad are ids 1, 2 and 3 as in PLaMo 2.  With ``plamo3`` the config names
``Plamo3Tokenizer`` and sets its two thresholds (PLAMO3_THRESHOLDS); the rows are the same.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import UserError
from .corpus import TEXT
from .vocab import FLAVOURS

CONTROL_TOKENS = (
    "<|plamo:unk|>",
    "<|plamo:bos|>",
    "<|plamo:eos|>",
    "<|plamo:pad|>",
    "<|plamo:op|>",
    "<|plamo:reserved:0x05|>",
    "<|plamo:reserved:0x06|>",
)
PLAMO2_ROWS = 100_000  # rows of the real PLaMo 2 tokenizer.jsonl (configs say 100000 or 100032)
# PLaMo 3's optional cuts (docs/tokenizer.md §9).  These values are ours: the real checkpoints'
# tokenizer_config.json is not public, so what PFN sets (if anything) is not known here.
PLAMO3_THRESHOLDS = {"break_around_repeated_chars_threshold": 16, "break_around_consecutive_spaces_threshold": 8}
FIRST_PIECE_ID = len(CONTROL_TOKENS) + 256
MAX_PIECE_CHARS = 10

_KANA_KANJI = "\u3040-\u30ff\u3400-\u9fff\u3005"
_PRETOKEN = re.compile(rf" ?[A-Za-z]+|[0-9]{{1,3}}|[{_KANA_KANJI}]+|( |\n|\t)\1*| ?[^\sA-Za-z0-9{_KANA_KANJI}]|\s")


def write_synthetic_tokenizer(
    directory: str | Path,
    vocab_size: int,
    seed: int = 0,
    rows: int | None = None,
    add_bos_token: bool = True,
    flavour: str = "plamo2",
) -> Path:
    """Write tokenizer.jsonl, tokenizer_config.json and special_tokens_map.json into ``directory``.

    ``rows`` defaults to min(vocab_size, 100000): like PLaMo 2, a config vocab_size above the
    tokenizer's row count leaves ids without a row.  ``flavour``: "plamo3" for a PLaMo 3 tokenizer
    config (a model family's `tokenizer_flavour`).
    """
    directory = Path(directory)
    table = synthetic_rows(vocab_size, seed=seed, rows=rows)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "tokenizer.jsonl").open("w", encoding="utf-8") as f:
        for row in table:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    config = tokenizer_config(add_bos_token, flavour)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n")
    return directory


def synthetic_rows(vocab_size: int, seed: int = 0, rows: int | None = None) -> list[list[Any]]:
    """The rows of a synthetic tokenizer.jsonl: [piece, score, type]."""
    count = min(vocab_size, PLAMO2_ROWS) if rows is None else rows
    if count > vocab_size:
        raise UserError(f"a tokenizer of {count} rows does not fit vocab_size {vocab_size}")
    if count < FIRST_PIECE_ID:
        raise UserError(f"vocab_size {vocab_size} is too small for a PLaMo tokenizer (needs >= {FIRST_PIECE_ID})")
    table: list[list[Any]] = [[CONTROL_TOKENS[0], 0.0, "UNKNOWN"]]
    table += [[token, 0.0, "CONTROL"] for token in CONTROL_TOKENS[1:]]
    table += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    table += [[piece, score, "NORMAL"] for piece, score in learn_pieces(count - FIRST_PIECE_ID, seed)]
    return table


def tokenizer_config(add_bos_token: bool = True, flavour: str = "plamo2") -> dict[str, Any]:
    """tokenizer_config.json as PLaMo 2 checkpoints ship it (transformers' layout for Plamo2Tokenizer),
    or with flavour "plamo3" for Plamo3Tokenizer with our PLAMO3_THRESHOLDS."""
    if flavour not in FLAVOURS:
        raise ValueError(f"tokenizer flavour must be one of {', '.join(FLAVOURS)}, not {flavour!r}")
    plamo3 = flavour == "plamo3"
    added = {
        str(i): {
            "content": CONTROL_TOKENS[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in range(4)
    }
    name = FLAVOURS[flavour]
    config = {
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": [f"tokenization_plamo.{name}", None]},
        "bos_token": CONTROL_TOKENS[1],
        "clean_up_tokenization_spaces": False,
        "cls_token": None,
        "eos_token": CONTROL_TOKENS[2],
        "extra_special_tokens": {},
        "local_file_only": True,
        "mask_token": None,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": CONTROL_TOKENS[3],
        "sep_token": None,
        "tokenizer_class": name,
        "unk_token": CONTROL_TOKENS[0],
    }
    return {**config, **PLAMO3_THRESHOLDS} if plamo3 else config


def special_tokens_map() -> dict[str, Any]:
    """special_tokens_map.json of pfnet/plamo-2-1b."""
    names = {"bos_token": 1, "eos_token": 2, "pad_token": 3, "unk_token": 0}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {name: {"content": CONTROL_TOKENS[i], **flags} for name, i in names.items()}


# ---- the piece learner -----------------------------------------------------------------------------
def learn_pieces(count: int, seed: int = 0, text: str = TEXT, rounds: int = 3) -> list[tuple[str, float]]:
    """``count`` (piece, score) pairs, best first: learned from ``text``, then generated filler."""
    words = Counter(m.group(0) for m in _PRETOKEN.finditer(text))
    candidates = _substring_counts(words)
    scores = _normalise({p: float(c) for p, c in candidates.items()})
    for _ in range(rounds):
        used = _viterbi_counts(words, scores)
        # Pieces the best segmentations never use keep a small share of their substring count,
        # so they stay plausible alternatives instead of dropping out.
        scores = _normalise({p: used.get(p, 0) + 0.05 * c for p, c in candidates.items()})
    singles = sorted((p for p in scores if len(p) == 1), key=lambda p: (-scores[p], p))
    others = sorted((p for p in scores if len(p) > 1), key=lambda p: (-scores[p], p))
    # Single characters first: a small vocabulary should still cover the common letters.
    chosen = [(p, round(scores[p], 6)) for p in (singles + others)[:count]]
    if len(chosen) < count:
        floor = min(s for _, s in chosen) if chosen else -10.0
        chosen += _filler(count - len(chosen), {p for p, _ in chosen}, floor, seed)
    chosen.sort(key=lambda item: -item[1])
    return chosen


def _substring_counts(words: Counter[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for word, freq in words.items():
        limit = 4 if re.fullmatch(f"[{_KANA_KANJI}]+", word) else MAX_PIECE_CHARS
        for start in range(len(word)):
            for end in range(start + 1, min(len(word), start + limit) + 1):
                counts[word[start:end]] += freq
    return counts


def _normalise(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {p: math.log(w / total) for p, w in weights.items() if w > 0}


def _viterbi_counts(words: Counter[str], scores: dict[str, float]) -> Counter[str]:
    """How often each piece is used by the best segmentation of every pre-token."""
    used: Counter[str] = Counter()
    for word, freq in words.items():
        n = len(word)
        best = [0.0] + [-math.inf] * n
        back = [0] * (n + 1)
        for end in range(1, n + 1):
            for start in range(max(0, end - MAX_PIECE_CHARS), end):
                s = scores.get(word[start:end])
                if s is not None and best[start] + s > best[end]:
                    best[end], back[end] = best[start] + s, start
        end = n
        while end > 0:
            used[word[back[end] : end]] += freq
            end = back[end]
    return used


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in "aeiou"] + ["th", "sh", "ch", "ng", "st", "er", "an"]
_KANJI = sorted({c for c in TEXT if "\u3400" <= c <= "\u9fff"})
_KANA = [chr(c) for c in range(0x3041, 0x3094)] + [chr(c) for c in range(0x30A1, 0x30F5)]


def _filler(count: int, taken: set[str], floor: float, seed: int) -> list[tuple[str, float]]:
    """Generated pieces with the corpus pieces' shapes, scored below all of them."""
    rng = random.Random(seed)
    out: list[tuple[str, float]] = []
    numbers = [str(n) for n in range(1000)]
    while len(out) < count:
        kind = rng.random()
        if kind < 0.55:
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))[:MAX_PIECE_CHARS]
            piece = (" " + word[: MAX_PIECE_CHARS - 1]) if rng.random() < 0.5 else word
        elif kind < 0.85:
            piece = "".join(rng.choice(_KANJI if rng.random() < 0.6 else _KANA) for _ in range(rng.randint(2, 4)))
        elif kind < 0.9 and numbers:
            piece = numbers.pop(rng.randrange(len(numbers)))
        else:
            piece = "".join(rng.choice(_KANA) for _ in range(rng.randint(1, 3)))
        if piece not in taken:
            taken.add(piece)
            out.append((piece, round(floor - 0.5 - 4.0 * rng.random(), 6)))
    return out
