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


def load_text_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer for text alone (the server's HTTP process), without torch: what
    `engine.load_tokenizer` loads (PLaMo's tokenizer.jsonl natively, in the flavour its model family
    declares)."""
    from ...model.registry import tokenizer_flavour
    from ...tokenizer import load_tokenizer

    return load_tokenizer(path, trust_remote_code=trust_remote_code, flavour=tokenizer_flavour(path))


# PLaMo 3's end of an assistant turn in its chat format, one token of its vocabulary (vLLM's plamo3
# parser, vllm-project/vllm#56575: EOT_TAG; llama.cpp's converter hard-codes id 4 instead).  `</s>` is
# not one: it is an ordinary piece of every PLaMo vocabulary (llama.cpp#29577 stopped on it by spelling).
CHAT_TURN_ENDS = ("<|plamo:tag|>",)


def chat_turn_ends(tokenizer: Any) -> tuple[str, ...]:
    """The markers of CHAT_TURN_ENDS that this tokenizer reads as one token: where a chat answer ends
    (the model's end of its turn), as EOS ends a completion.  A tokenizer without the marker (PLaMo 2's)
    gets none, so its text never stops an answer by accident."""
    out = []
    for marker in CHAT_TURN_ENDS:
        ids = list(tokenizer(marker, add_special_tokens=False)["input_ids"])
        if len(ids) == 1 and tokenizer.decode(ids) == marker:
            out.append(marker)
    return tuple(out)


def max_piece_chars(tokenizer: Any) -> int | None:
    """The longest text one token of PLaMo's native tokenizer stands for, in characters (pieces are
    substrings of the text, a byte token a part of one character), so a text of L characters is at
    least L / this many tokens; None for other tokenizers (one that normalizes text could make one
    token of many characters)."""
    from ...tokenizer.hf import PlamoTokenizerNative

    if not isinstance(tokenizer, PlamoTokenizerNative):
        return None
    return max((len(piece) for piece in tokenizer.get_vocab()), default=None)


def decode_kept_specials(tokenizer: Any) -> Decode:
    """vLLM's output text: special tokens kept, no spaces between them, no clean-up (the native
    tokenizer's `decode_kept` where it has one: the same text, faster)."""
    fast = getattr(tokenizer, "decode_kept", None)
    if callable(fast):
        return lambda ids: fast(list(ids))

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


# Prompt tokens kept as decoding context before the first generated one (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for any leading-space rule.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class TextStream:
    """Text deltas of one sequence as its tokens arrive, for every caller that shows text while it
    is generated (`generate`, the server, batch files).  The rules:

    * the deltas concatenate to the sequence's text, cut right before the earliest stop string
      (the stop string and everything after it are never given out);
    * text that may still turn out to be the start of a stop string is held back (exactly the
      longest suffix that begins one), and released at `finish` if no stop string came; text is
      never taken back;
    * a character split over byte tokens is released once complete (held back while the text
      ends in U+FFFD), an incomplete one at the end comes out as U+FFFD.

    `stopped` is the stop string once found: the token that completed it was the sequence's last
    (pushing more is a bug).  Callers do not push an EOS token whose text they do not show.

    Decoding follows vLLM's incremental detokenizer (prefix/read offsets): each step decodes a
    short window ending at the newest token and keeps the part beyond the window's already
    released prefix, so a step costs O(window), not O(length), and tokenizers whose pieces render
    differently at the start of a text (a leading space) give the text a full decode gives.
    `context` (a few prompt tokens) makes the first generated token render as it would after the
    prompt; without it the text is decode(generated tokens), the text eval cuts.
    """

    def __init__(self, decode: Decode, stops: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)  # '' would stop before anything
        self.ids = list(context[-CONTEXT_TOKENS:]) if context else []
        self.prefix = 0  # start of the decoding window
        self.read = len(self.ids)  # tokens before this have their text given out (or held)
        self.held = ""  # decoded but not given out: could be the start of a stop string
        self.stopped: str | None = None  # the stop string found, once found

    def push(self, token: int) -> str:
        """Add one generated token; the text it releases (possibly '')."""
        return self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> str:
        """Add several generated tokens at once (one decode): the text they release, the same as
        their pushes' together."""
        if self.stopped is not None:
            raise RuntimeError("TextStream.push after a stop string: that token was the last")
        self.ids.extend(int(t) for t in tokens)
        return self._release(self._new_text(final=False))

    def finish(self) -> str:
        """The end of a sequence that did not stop on a string (EOS, max_tokens): what is held back."""
        if self.stopped is not None:
            return ""
        out = self._release(self._new_text(final=True))
        if self.stopped is None:
            out, self.held = out + self.held, ""
        return out

    def _new_text(self, final: bool) -> str:
        """Text the tokens since the last release add, or '' while a character is incomplete."""
        before = self.decode(self.ids[self.prefix : self.read])
        window = self.decode(self.ids[self.prefix :])
        if len(window) <= len(before) or (window.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        del self.ids[: self.prefix]  # never decoded again
        self.read -= self.prefix
        self.prefix = 0
        return window[len(before) :]

    def _release(self, new: str) -> str:
        text = self.held + new
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            at, stop = min(found, key=lambda f: f[0])
            self.stopped, self.held = stop, ""
            return text[:at]
        keep = self._stop_prefix_length(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _stop_prefix_length(self, text: str) -> int:
        """The longest suffix of `text` that begins some stop string: it must wait.  (Any later
        occurrence starting before it would make a longer such suffix.)"""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
