"""What ends a generation and which text comes back, exactly as lm-eval's vLLM backend sets up vLLM.

The reference gsm8k numbers for PLaMo 2 come from vLLM, and flexible-extract is very sensitive to
where a generation stops (docs/eval.md §6), so these rules are copied rather than improved:

* stop strings = the task's ``until`` + the decoded EOS token (``handle_stop_sequences``);
* the engine also stops on the EOS *ids*, by the one rule every command uses
  (runtime/batching/text.py `stop_token_ids`);
* the text is decoded with special tokens kept and no spaces between them; the text of a token that
  stopped generation by id is dropped (vLLM does not show it); the rest is cut at the earliest stop
  string (``postprocess_generated_text``);
* ``max_gen_toks`` defaults to 256; greedy unless the request asks for sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ..errors import UserError
from ..runtime.batching.text import Decode, StopStringWatcher, decode_kept_specials, stop_token_ids

__all__ = [
    "DEFAULT_MAX_GEN_TOKS",
    "GenSettings",
    "StopStringWatcher",
    "decode_kept_specials",
    "finish_text",
    "gen_settings",
    "stop_token_ids",
]
DEFAULT_MAX_GEN_TOKS = 256

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
        raise UserError(
            f"generation kwargs {unknown} are not supported by the plamo2 model (only until, "
            "max_gen_toks, do_sample, temperature, top_p)"
        )
    if max_gen_toks < 0:
        raise UserError(f"max_gen_toks must be >= 0, got {max_gen_toks}")
    return GenSettings(tuple(until), max_gen_toks, temperature, top_p)


def finish_text(tokens: Sequence[int], stop_ids: Sequence[int], decode: Decode, until: Sequence[str]) -> str:
    """The continuation lm-eval receives: the stopping EOS token's text dropped, the rest cut at
    the earliest stop string (the stop string itself excluded)."""
    if tokens and tokens[-1] in set(stop_ids):
        tokens = tokens[:-1]
    return postprocess_generated_text(decode(tokens), list(until), None)
