"""What the HTTP layer needs from an engine: the one seam between `serve/` and the runtime.

The app (`serve/app.py`) speaks OpenAI's protocol and never touches tensors; an engine runs the
model and never sees HTTP.  Everything that crosses between them is defined here, as plain frozen
dataclasses, so that an engine can be written (and tested) without FastAPI installed.  The engine
that runs PLaMo is `serve/runtime_engine.py:RuntimeEngine` (the runtime's online loop); the tests
also run the app against a deterministic fake (tests/serve/serve_fake_engine.py).

Division of labour
------------------
The app validates every request before an engine sees it, by the rules written once in
`generation_request.py` (`GenerationRequest.check`: token ids are inside ``[0, info.vocab_size)``,
``len(prompt_token_ids) + max_tokens <= info.max_context``, ``max_tokens >= 1``) and the protocol's
(``0 <= temperature <= 2``, ``0 < top_p <= 1``, ``logprobs`` / ``prompt_logprobs`` in
``[0, info.max_logprobs]``, stop strings non-empty).  It fans a request with several prompts or
``n > 1`` out into one `GenerationRequest` per (prompt, choice), and it bounds how many sequences
are in the engine at once (``info.max_batch`` running + the server's ``max_queue`` waiting), so an
engine may queue whatever it is given.

The engine owns everything that depends on the model or the tokenizer: sampling, stopping (EOS
ids, stop strings, max_tokens) and the text.  It stops in its own scheduler so that a finished
sequence's decode slot is freed at once; `runtime/batching/text.py:TextStream` implements the text
rules below (the one text stream of `generate`, batch files and the server).

Threads
-------
Every method is called from the app's event-loop thread, except `tokenize` and `detokenize`,
which the app calls from one worker thread of its own (never two at once), so that a long prompt
does not stall the streams of everyone else; they must be safe to run while the engine's own
threads use the tokenizer.  `cancel` and `stats` must not block.  An engine that runs the model on
a thread of its own hands events to the loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ..generation_request import GenerationRequest  # the one request type, shared with the runtime's loop

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine serves; read once by `create_app`, before `start()` (so from the config and
    tokenizer files, not from loaded weights), and never again."""

    model_id: str  # the name /v1/models lists and responses carry (the server may add aliases)
    vocab_size: int  # valid token ids are 0 .. vocab_size-1: the tokenizer's, not the padded embedding rows
    max_context: int  # the most tokens (prompt + generated) one sequence may hold
    max_batch: int  # how many sequences decode at once; the app admits max_batch + max_queue
    eos_token_ids: tuple[int, ...] = ()  # ids that end a generation (shown by /tokenizer_info)
    bos_token: str | None = None  # the special tokens' texts, for chat templates and /tokenizer_info
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None  # a Jinja chat template (HF's dialect); None refuses /v1/chat/completions
    max_logprobs: int = 20  # the most alternatives per token the engine returns (OpenAI allows 5 / 20)
    created: int = 0  # unix time the model was loaded, shown by /v1/models
    prompt_bos_id: int | None = None  # the BOS the tokenizer puts before every text prompt (None: none)
    # The longest text one token stands for (in characters): a text of L characters is then at least
    # L / max_piece_chars tokens, which refuses an oversized prompt before it is tokenized.  None: unknown.
    max_piece_chars: int | None = None
    chat_stop: tuple[str, ...] = ()  # where a chat answer ends besides EOS: the model's end-of-turn marker(s)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One entry of a token's top-k: an alternative the model considered."""

    token_id: int
    token: str  # the token's own text (see `TokenLogprob.token`)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token that was generated (or is in the prompt) with its log-probability.

    `token` is the token's own text as OpenAI's ``logprobs.tokens`` shows it: by convention
    ``detokenize([token_id])`` (a lone byte of a multi-byte character shows as U+FFFD, as in vLLM).
    `logprob` is the model's log-softmax at this position (before temperature and top-p: what
    lm-eval scores), None only for the first prompt token.  `top` holds the k most likely tokens,
    most likely first, computed from the same numbers as `logprob`: lm-eval decides "greedy" by
    ``logprob == max(top)``, so the two must compare equal when the token is the argmax.
    """

    token_id: int
    token: str
    logprob: float | None
    top: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of one sequence, in order: what `Engine.submit` yields.

    An event may carry several tokens (an engine that looks at the device every few steps sends
    them together; streaming clients then get them in one chunk).  Only the last event may have
    no token.  Rules for `text`, which the app forwards verbatim and never takes back:

    * the concatenation of all `text` deltas is the completion's text;
    * it ends right before the earliest occurrence of any stop string (the stop string and
      everything after it are never sent), so text that might still turn out to be the start of a
      stop string is held back until it cannot, and released at the end if no stop string came;
    * an EOS token adds no text (vLLM's ``skip_special_tokens``); other special tokens' text is
      the engine's choice (keep PLaMo's ``<|plamo:op|>`` visible if clients stop on it);
    * a character split across tokens is sent once complete (held back meanwhile).

    Logprobs may come later than the tokens they describe (an engine that scores them in one pass
    after the sequence ends sends them all with its last event), in order: `prompt_logprobs` in an
    event no later than the first `logprobs`, and `logprobs` in the order of the tokens.
    """

    token_ids: tuple[int, ...]  # the new tokens (a stop string's last token and the EOS token included)
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, in order (see above)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # once: one per prompt token
    finish_reason: FinishReason | None = None  # set on the last event only: "stop" (EOS or stop string), "length"
    stop_reason: str | int | None = None  # the stop string or EOS id that ended the sequence, if any
    # Tracing only (serve/trace.py): when the engine reached its stages for this sequence, in its first event.
    stamps: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's own view of its load, read on every /metrics scrape (must not block)."""

    waiting: int  # sequences accepted but not yet decoding
    running: int  # sequences decoding now


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    detail: str = ""  # why not, for /health's 503 body and the logs


class EngineError(Exception):
    """The engine failed a request (or everything): 500 to the client, the message logged and shown."""


class RequestRejected(EngineError):
    """The engine refuses this request for a reason the app could not check (e.g. no memory for a
    context this long): 400 with this message."""


class EngineBusy(EngineError):
    """The engine cannot take more work now: 503 with Retry-After."""

    def __init__(self, message: str = "the engine is busy", retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@runtime_checkable
class Engine(Protocol):
    """The interface `serve.app.create_app` needs.  See the module docstring for threads."""

    @property
    def info(self) -> ModelInfo: ...

    async def start(self) -> None:
        """Called once in the event loop before the first request (load weights, start the
        scheduler thread, remember the loop).  The server accepts connections only after it."""
        ...

    async def stop(self) -> None:
        """Called once at shutdown after in-flight requests have finished or been cancelled."""
        ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Start generating; an async iterator of the sequence's events (an async generator
        function is the natural way to write it).

        The work may start when `submit` is called or at the first ``__anext__``; the app iterates
        right away.  The iterator ends after the event with `finish_reason`.  It raises
        `EngineError` (or a subclass) to fail the request; it ends early, without a finish reason,
        after `cancel(request.request_id)`.  The app may also stop iterating and call
        ``aclose()`` at any time (client gone): then it calls `cancel` first.
        """
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a request now (client disconnected): free its slot, end its iterator.  A no-op
        for an id that is unknown or already finished.  Must not block."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids; `add_special_tokens` adds BOS where the tokenizer config says
        (True for /v1/completions text prompts, False after a chat template, which writes its own)."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of these ids (special tokens kept, so that /detokenize round-trips)."""
        ...

    def stats(self) -> EngineStats: ...

    # Optional (read with getattr): `failed: str | None`, why the engine can no longer serve at all
    # (its scheduler died).  The server polls it; once set it stops and exits non-zero.

    async def health(self) -> Health:
        """Whether the engine can serve (scheduler alive, device usable); must answer quickly."""
        ...


__all__ = [
    "Candidate",
    "Engine",
    "EngineBusy",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "Health",
    "ModelInfo",
    "RequestRejected",
    "TokenEvent",
    "TokenLogprob",
]
