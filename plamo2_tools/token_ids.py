"""Token ids against a model's vocabulary: the one range check that every way into the model uses
(the reference forwards, the runtime, the online loop, the commands and the server)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .errors import UserError


def first_outside(ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id not in [0, vocab_size), or None."""
    return next(((p, t) for p, t in enumerate(ids) if not 0 <= t < vocab_size), None)


def check_token_ids(seqs: Iterable[Sequence[int]], vocab_size: int, what: str = "") -> None:
    """Every id of every sequence in [0, vocab_size); else one line naming up to five of the others
    (a UserError: exit 2 from a command, 400 from the server)."""
    bad = sorted({t for ids in seqs for t in ids if not 0 <= t < vocab_size})
    if bad:
        where = f"{what}: " if what else ""
        raise UserError(f"{where}token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


def check_tokens(ids: list[int], cfg: Any, new_tokens: int, what: str) -> None:
    """Token ids inside the vocabulary, and the sequence (with the tokens to generate) inside the
    model's positions."""
    check_token_ids([ids], cfg.vocab_size, what)
    limit = cfg.max_position_embeddings
    if len(ids) + new_tokens > limit:
        extra = f" + {new_tokens} new tokens" if new_tokens else ""
        raise UserError(f"{what}: {len(ids)} tokens{extra} exceed the model's limit of {limit} positions")
