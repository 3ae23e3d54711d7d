"""What ends a generation and which text comes back, exactly as lm-eval's vLLM backend sets up vLLM.

The reference gsm8k numbers for PLaMo 2 come from vLLM, and flexible-extract is very sensitive to
where a generation stops (docs/eval.md §6), so these rules are copied rather than improved:

* stop strings = the task's ``until`` + the decoded EOS token (``handle_stop_sequences``);
* the engine also stops on the EOS *ids*: generation_config.json's ``eos_token_id`` (config.json's
  when there is no generation config) plus the tokenizer's ``eos_token_id``;
* the text is decoded with special tokens kept and no spaces between them; the text of a token that
  stopped generation by id is dropped (vLLM does not show it); the rest is cut at the earliest stop
  string (``postprocess_generated_text``);
* ``max_gen_toks`` defaults to 256; greedy unless the request asks for sampling.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ..errors import UserError

DEFAULT_MAX_GEN_TOKS = 256
Decode = Callable[[Sequence[int]], str]

# gen_kwargs keys that change nothing here: do_sample is folded into temperature by
# normalize_gen_kwargs, and the two detokenizer flags are the values we always use.
_NO_EFFECT = {"do_sample", "skip_special_tokens", "spaces_between_special_tokens"}


@dataclass(frozen=True)
class GenSettings:
    """One request's generation settings after lm-eval's normalisation."""

    until: tuple[str, ...]  # stop strings, EOS text included
    max_gen_toks: int
    temperature: float
    top_p: float


def gen_settings(gen_kwargs: dict[str, Any], eos_text: str | None, default_max_gen_toks: int) -> GenSettings:
    """vLLM backend's ``modify_gen_kwargs``; unsupported sampling knobs are refused, not ignored,
    so that a run never silently differs from what the task asked for."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=default_max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
    max_gen_toks = int(kwargs.pop("max_gen_toks"))
    temperature = float(kwargs.pop("temperature", 0.0))
    top_p = float(kwargs.pop("top_p", 1.0))
    unknown = sorted(set(kwargs) - _NO_EFFECT)
    if unknown:
        raise UserError(f"generation kwargs {unknown} are not supported by the plamo2 model (only until, "
                        "max_gen_toks, do_sample, temperature, top_p)")  # fmt: skip
    if max_gen_toks < 0:
        raise UserError(f"max_gen_toks must be >= 0, got {max_gen_toks}")
    return GenSettings(tuple(until), max_gen_toks, temperature, top_p)


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
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else [int(x) for x in eos or []]
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


def finish_text(tokens: Sequence[int], stop_ids: Sequence[int], decode: Decode, until: Sequence[str]) -> str:
    """The continuation lm-eval receives: the stopping EOS token's text dropped, the rest cut at
    the earliest stop string (the stop string itself excluded)."""
    if tokens and tokens[-1] in set(stop_ids):
        tokens = tokens[:-1]
    return postprocess_generated_text(decode(tokens), list(until), None)
