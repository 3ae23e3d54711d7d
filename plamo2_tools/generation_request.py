"""One sequence to generate, as it crosses the engine seam: the one request type of the server's
engine (serve/engine_api.py) and of the runtime's online loop (runtime/batching/online.py), and the
one place its limits against a model are written.

A request is made once, from whatever asked for it (an HTTP body, a batch-file line, a test), with
its `max_tokens` resolved; `check` is the rule every way in applies: the server before it answers
(so a refusal is a 400 in OpenAI's shape, with its `param` and `code`), the loop when a request is
submitted (so a caller of the loop gets the same words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import UserError
from .token_ids import first_outside


class RequestRefused(UserError):
    """A request the model cannot run: the message, and the request field it is about."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: one prompt, one choice (no slots: torchrun ranks receive it
    pickled, which frozen slotted dataclasses refuse on Python 3.10)."""

    request_id: str  # unique among live requests; `cancel` names it
    prompt_token_ids: tuple[int, ...]  # non-empty, every id in [0, vocab_size); BOS is already in it if wanted
    max_tokens: int  # >= 0 (0: nothing generated, e.g. echo scoring the prompt) and prompt + max_tokens <= max_context
    temperature: float = 1.0  # 0 = greedy (the first maximum on ties)
    top_p: float = 1.0  # nucleus mass; 1 = the whole vocabulary
    # Sampling: the tokens must be a function of (prompt, temperature, top_p, seed, stream) alone,
    # whatever else shares the batch.  `stream` is the choice index (0 .. n-1) of an n > 1 request,
    # so that its choices differ under one seed; seed None means "any seed" (choices still differ).
    seed: int | None = None  # in [-2**63, 2**63)
    stream: int = 0
    stop: tuple[str, ...] = ()  # stop strings (non-empty), matched against the generated text only
    # None: no logprobs.  k >= 0: every generated token's logprob and the k most likely alternatives.
    logprobs: int | None = None
    # None: none.  k >= 0: the logprob of every prompt token given the tokens before it (position 0
    # has none) with k alternatives, once, in the first event.  lm-eval's loglikelihood tasks send
    # echo + logprobs=1 + max_tokens=1 and read exactly these.
    prompt_logprobs: int | None = None
    ignore_eos: bool = False  # vLLM's extension: the EOS ids do not end it (benchmarks of fixed lengths)

    def check(
        self, vocab_size: int, max_context: int, what: str = "the prompt", max_tokens_param: str = "max_tokens"
    ) -> None:
        """The request's limits against the model: a prompt, its ids in the vocabulary, no negative
        number of tokens to generate, and both inside the context.  `what` names the prompt and
        `max_tokens_param` the field a client set (chat's max_completion_tokens) in a refusal."""
        check_prompt(self.prompt_token_ids, vocab_size, what)
        if self.max_tokens < 0:
            raise RequestRefused(f"{max_tokens_param} must be >= 0", max_tokens_param)
        check_context(len(self.prompt_token_ids), self.max_tokens, max_context, max_tokens_param)


def check_prompt(ids: Sequence[int], vocab_size: int, what: str = "the prompt", param: str = "prompt") -> None:
    """Token ids to run: at least one, each in [0, vocab_size)."""
    if not ids:
        raise RequestRefused(f"{what} is empty", param)
    outside = first_outside(ids, vocab_size)
    if outside is not None:
        pos, bad = outside
        raise RequestRefused(
            f"token id {bad} at position {pos} of {what} is outside the vocabulary (0 .. {vocab_size - 1})",
            param,
            "invalid_token_id",
        )


def check_context(prompt_len: int, max_tokens: int, max_context: int, param: str = "max_tokens") -> None:
    """Prompt and completion inside the context, else OpenAI's refusal (vLLM's words); `param`
    is the field to blame ("prompt" when the client asked for no particular length)."""
    if prompt_len + max_tokens > max_context:
        raise RequestRefused(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param,
            "context_length_exceeded",
        )


def default_max_tokens(prompt_len: int, requested: int | None, max_context: int, default: int | None = None) -> int:
    """`requested`, else `default` (completions: 16, as OpenAI and vLLM) within the room the context
    leaves, else all that room (chat, as vLLM); at least 1, so that a prompt that fills the context is
    refused by `check_context`."""
    if requested is not None:
        return requested
    room = max(max_context - prompt_len, 1)
    return room if default is None else min(default, room)


# Below this a temperature is greedy: vLLM's _SAMPLING_EPS (its SamplingParams), and where the logits'
# scaling by 1/T stops being a number (1e-40 is a float32 subnormal: every logit / T is +-inf).
MIN_TEMPERATURE = 1e-5
_FLOAT32_TINIEST = 2.0**-149  # the smallest positive float32; a top_p below half of it rounds to 0


def sampling_settings(temperature: float, top_p: float) -> tuple[float, float]:
    """(temperature, top_p) as the sampler runs them: (0, 1) is greedy.  A temperature below
    MIN_TEMPERATURE is greedy; so is a top_p that rounds to 0 in float32 (the nucleus of a mass
    smaller than any token's probability is the most likely token alone; at 0 the sampler's mask
    would keep no token at all).  Documented in docs/serve.md ("Refusals and limits")."""
    if temperature < MIN_TEMPERATURE or top_p < _FLOAT32_TINIEST / 2:
        return 0.0, 1.0
    return float(temperature), float(top_p)
