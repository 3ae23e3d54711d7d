"""Text around the token loop, once for every caller (`generate`, `eval`, the server): which token
ids end a generation, how tokens become text, where a stop string cuts, and text streamed as it
is generated.

The EOS rule is vLLM's (the published PLaMo 2 numbers come from vLLM, docs/eval.md §6): the
tokenizer's `eos_token_id`, then `eos_token_id` of generation_config.json (config.json's when the
checkpoint has no generation config).  Text is decoded as vLLM shows it: special tokens kept, no
spaces between them, no clean-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...jsonio import read_object

Decode = Callable[[Sequence[int]], str]


def stop_token_ids(model_dir: str | Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids that end a generation, in vLLM's order: the tokenizer's EOS, then generation_config's
    (config.json's when the checkpoint has no generation_config.json)."""
    model_dir = Path(model_dir)
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            try:
                eos = read_object(path).get("eos_token_id")  # bounded, a JSON object or one line
                ids += [eos] if isinstance(eos, int) else [int(x) for x in eos or []]
            except (ValueError, TypeError, AttributeError, OverflowError):
                raise CheckpointError(f"{path}: eos_token_id must be an integer or a list of integers") from None
            break
    return tuple(dict.fromkeys(ids))


def decode_kept_specials(tokenizer: Any) -> Decode:
    """vLLM's output text: special tokens kept, no spaces between them, no clean-up."""

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(
            list(ids),
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )

    return decode


class StopStringWatcher:
    """The runtime's ``stop(i, tokens)`` callback: True once sequence i's text contains a stop string.

    Called after every new token, it only decodes the last few tokens: a stop string that was not
    there one token ago must end in the newest token's text, so it lies within the last
    ``max(len(stop))`` characters, and every token decodes to at least one character or is one of
    at most 4 bytes of one.  (A decoded tail is a substring of the full text, up to a broken first
    character, so the answer is the one a full decode would give, at O(1) cost per step.)

    `first_hit` answers for many new tokens at once (the runtime looks at tokens every few decode
    steps): one decode of the new tokens plus a window before them tells whether any prefix ends
    in a stop string; only then is each prefix asked, as token-by-token generation would have, so
    the first stopping prefix is the same.

    In-process the ranks are threads that all call this with the same (i, tokens); the memo makes
    them decode once.  Its dict is only read and written whole-key (atomic under the GIL) and the
    answer is deterministic, so a race can only repeat work, never change the result.
    """

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = [s for s in stops if s]  # '' would match everything (lm-eval ignores it too)
        self.window = 4 * (max((len(s) for s in self.stops), default=0) + 1)
        self._seen: dict[tuple[int, int], bool] = {}

    def __call__(self, i: int, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        key = (i, len(tokens))
        hit = self._seen.get(key)
        if hit is None:
            tail = self.decode(tokens[-self.window :])
            hit = any(s in tail for s in self.stops)
            self._seen[key] = hit
        return hit

    def first_hit(self, i: int, tokens: list[int], checked: int) -> int | None:
        if not self.stops or checked >= len(tokens):
            return None
        # A stop string that first appears at prefix n > checked lies within the last `window`
        # tokens before n (see above), so within this tail.
        tail = self.decode(tokens[max(0, checked - self.window) :])
        if not any(s in tail for s in self.stops):
            return None
        return next((n for n in range(checked + 1, len(tokens) + 1) if self(i, tokens[:n])), None)


def earliest_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that occurs first in `text` (the longest of those starting there), or None."""
    found = [(i, -len(s), s) for s in stops if s and (i := text.find(s)) >= 0]
    return min(found)[2] if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string (the stop string itself excluded), and whether one
    was found."""
    cut = min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class TextStream:
    """Text deltas of one sequence as its tokens arrive: a delta is released only once it ends in a
    whole character (a multi-byte character split over byte tokens decodes to U+FFFD until its
    last byte arrives), and the text before a stop string never includes a byte of it."""

    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, [s for s in stops if s]
        self.tokens: list[int] = []
        self.sent = ""  # text already given out
        self.stopped = False
        # Text that could still turn out to be the start of a stop string is held back.
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, token: int) -> str:
        """Take one token; the text that may be shown now."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.decode(self.tokens)
        text, hit = cut_at_stop(text, self.stops)
        if hit:
            self.stopped = True
        elif not final:
            if text.endswith("\ufffd"):  # wait for whole UTF-8 characters
                return ""
            text = text[: max(len(self.sent), len(text) - self.hold)]
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta
