"""`engine_api.Engine` over the runtime's online loop, whichever side of a process boundary the loop
is on: the text, the EOS rule, logprobs and the hand-over of events to asyncio, written once.

Two engines build on it:

* `runtime_engine.RuntimeEngine`: the loop is a thread of this process (batch files; the server
  with `PLAMO2_SERVE_HTTP_PROCESS=0`);
* `front.ProcessEngine`: the loop runs in the model's process and this one serves HTTP
  (`plamo2-tools serve`'s default, docs/serve.md "Two processes"): requests go out over a pipe,
  one message per drain of the loop comes back.

This module never imports torch: what the loop sends is plain data (`LoopEvent` has the fields
of the runtime's `online.Event`, `Scores` the numbers of its `TokenScores`).

* **Text** by the runtime's rules (`runtime/batching/text.py`): `TextStream` over the generated
  tokens (an EOS that ended the sequence adds none), cut at the earliest stop string; the same
  text `generate` and `eval` give.
* **Logprobs** (generated tokens, and the prompt's with echo) in one scoring pass over prompt +
  completion after the sequence ends, run inside the loop between two of its iterations: the
  decode step computes no log-softmax.  They come with the last event (engine_api allows it).
* **Events** arrive in batches (one per drain of the loop) and are handed to the asyncio loop in
  one call per batch; events of one sequence that piled up while the HTTP side was busy go out as
  one (`merged`), so the work per token shrinks as the load grows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..runtime.batching.text import TextStream
from .engine_api import (
    Candidate,
    EngineError,
    EngineStats,
    GenerationRequest,
    Health,
    ModelInfo,
    TokenEvent,
    TokenLogprob,
)


@dataclass(frozen=True, slots=True)
class LoopEvent:
    """New tokens of one sequence from one drain of the loop (the fields of `online.Event` the
    server reads; `online.Event` itself passes for one)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    stop_reason: str | int | None = None
    error: str | None = None
    stamps: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class Scores:
    """One scored sequence: per position p >= start, log p(seq[p] | seq[:p]) and the top-k
    alternatives (ids, log-probabilities, most likely first), from one float32 log-softmax."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def merged(event: Any, queue: asyncio.Queue[Any]) -> Any:
    """`event` and whatever else of its sequence is already waiting, as one event: when the HTTP
    side falls behind the loop (hundreds of streams), each stream then gets one chunk per look
    instead of a backlog of small ones, and the work per token shrinks as the load grows."""
    while not event.finished and event.error is None and not queue.empty():
        nxt = queue.get_nowait()
        event = dataclasses.replace(nxt, token_ids=event.token_ids + nxt.token_ids, stamps=event.stamps or nxt.stamps)
    return event


class SequenceText:
    """One sequence's text from the loop's events: what `TokenEvent.text` says, by the runtime's
    `TextStream` (no prompt context, so the text is decode(generated tokens) cut at the earliest
    stop string, exactly what eval's `finish_text` gives)."""

    def __init__(self, decode: Any, stop: Sequence[str], eos: Sequence[int]) -> None:
        self.stream = TextStream(decode, stop)
        self.eos = frozenset(eos)
        self.tokens: list[int] = []

    def text(self, event: Any) -> str:
        new = list(event.token_ids)
        self.tokens += new
        if event.finished and event.finish_reason == "stop" and isinstance(event.stop_reason, int) and new:
            new = new[:-1]  # the EOS that ended it shows no text (vLLM's skip_special_tokens)
        out = self.stream.extend(new) if new and self.stream.stopped is None else ""
        if event.finished:
            out += self.stream.finish()
        return out


class LoopEngine:
    """The engine's common part; a subclass connects it to a loop (`_send_submit`, `_send_cancel`,
    `_token_scores`, `stats`, `start`, `stop`) and calls `deliver` with the loop's events on the
    asyncio thread."""

    def __init__(self, info: ModelInfo, tokenizer: Any, decode: Any) -> None:
        self._info = info
        self.tokenizer, self.decode = tokenizer, decode
        self.aio: asyncio.AbstractEventLoop | None = None
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.failed: str | None = None
        self.tracing = False  # stamp `submitted` / `delivered` (serve/trace.py)
        self._pieces: dict[int, str] = {}

    @property
    def info(self) -> ModelInfo:
        return self._info

    # ---- what a subclass provides ------------------------------------------------------------------
    def _send_submit(self, request: GenerationRequest) -> None:
        """Hand the request to the loop (raise `EngineError` / `RequestRejected` to refuse it)."""
        raise NotImplementedError

    def _send_cancel(self, request_id: str) -> None:
        raise NotImplementedError

    async def _token_scores(self, seqs: list[list[int]], starts: list[int], top_k: int) -> list[Scores]:
        raise NotImplementedError

    def _alive(self) -> bool:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    # ---- the contract ------------------------------------------------------------------------------
    async def health(self) -> Health:
        if self.failed is not None or not self._alive():
            return Health(False, self.failed or "the generation loop is not running")
        return Health(True)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.decode(list(token_ids))

    def piece(self, token_id: int) -> str:
        """A token's own text (OpenAI's logprobs.tokens), cached."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.decode([token_id])
        return text

    def cancel(self, request_id: str) -> None:
        # Always sent (the loop ignores a request it no longer holds): a stream whose task was
        # cancelled while it waited for its next event has dropped its queue already (`submit`'s
        # finally), and its sequence must still stop.
        self._send_cancel(request_id)

    def deliver(self, events: Iterable[Any]) -> None:
        """On the asyncio thread: a batch of the loop's events into their sequences' queues."""
        now = time.monotonic() if self.tracing else 0.0
        for e in events:
            queue = self.queues.get(e.request_id)
            if queue is None:
                continue
            if e.stamps is not None:
                e.stamps["delivered"] = now
            queue.put_nowait(e)

    def fail_all(self, why: str) -> None:
        """The loop is gone: every waiting sequence ends with an error (on the asyncio thread)."""
        self.failed = self.failed or why
        for rid in list(self.queues):
            self.queues[rid].put_nowait(LoopEvent(rid, (), True, None, error=why))

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.failed is not None:
            raise EngineError(self.failed)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request.request_id] = queue
        submitted = time.monotonic() if self.tracing else None
        # Prompt logprobs come from the scoring pass at the end (`_scores`), never from the loop's
        # own pass at arrival: one pass, not two, per echo request.
        to_loop = dataclasses.replace(request, prompt_logprobs=None) if request.prompt_logprobs is not None else request
        try:
            self._send_submit(to_loop)
            text = SequenceText(self.decode, request.stop, self.info.eos_token_ids)
            scored = request.logprobs is not None or request.prompt_logprobs is not None
            while True:
                event = merged(await queue.get(), queue)
                if event.error is not None:
                    raise EngineError(event.error)
                if event.finish_reason == "cancelled":
                    return  # engine_api: a cancelled sequence's iterator ends without a finish reason
                delta = text.text(event)
                stamps = None
                if event.stamps is not None:
                    stamps = {**event.stamps, "submitted": submitted}
                if event.finished:
                    logprobs, prompt = await self._scores(request, text.tokens) if scored else (None, None)
                    yield TokenEvent(
                        event.token_ids,
                        delta,
                        logprobs,
                        prompt,
                        event.finish_reason,  # type: ignore[arg-type]
                        event.stop_reason,
                        stamps,
                    )
                    return
                if event.token_ids or delta:
                    yield TokenEvent(
                        event.token_ids, delta, () if request.logprobs is not None else None, stamps=stamps
                    )
        finally:
            self.queues.pop(request.request_id, None)

    # ---- logprobs ------------------------------------------------------------------------------------
    async def _scores(
        self, request: GenerationRequest, generated: list[int]
    ) -> tuple[tuple[TokenLogprob, ...] | None, tuple[TokenLogprob, ...] | None]:
        """Logprobs of the generated tokens (and of the prompt, when asked) from one scoring pass
        over prompt + completion: the model's log-softmax, before temperature and top-p."""
        prompt = list(request.prompt_token_ids)
        seq = prompt + list(generated)
        want_prompt = request.prompt_logprobs is not None
        start = 1 if want_prompt else len(prompt)
        k = max(request.logprobs or 0, request.prompt_logprobs or 0)
        scores = None
        if start < len(seq):  # else nothing to score (a one-token prompt and no new token)
            (scores,) = await self._token_scores([seq], [start], k)
        entries = self._entries(seq, start, scores) if scores is not None else []
        split = len(prompt) - start
        gen = tuple(self._top(e, request.logprobs or 0) for e in entries[split:])
        prompt_lp = None
        if want_prompt:
            first = TokenLogprob(prompt[0], self.piece(prompt[0]), None)
            prompt_lp = (first, *(self._top(e, request.prompt_logprobs or 0) for e in entries[:split]))
        return (gen if request.logprobs is not None else None), prompt_lp

    def _entries(self, seq: list[int], start: int, s: Scores) -> list[TokenLogprob]:
        def top(n: int) -> tuple[Candidate, ...]:
            return tuple(
                Candidate(i, self.piece(i), float(v)) for i, v in zip(s.top_ids[n], s.top_logprobs[n], strict=True)
            )

        return [
            TokenLogprob(t, self.piece(t), float(lp), top(n))
            for n, (t, lp) in enumerate(zip(seq[start:], s.logprobs, strict=True))
        ]

    @staticmethod
    def _top(entry: TokenLogprob, k: int) -> TokenLogprob:
        return TokenLogprob(entry.token_id, entry.token, entry.logprob, entry.top[:k])


GC_FREEZE_ENV = "PLAMO2_SERVE_GC_FREEZE"  # "0": leave the start-up heap to the collector (the A/B)


def freeze_heap() -> None:
    """Move everything alive after start-up (the model's objects, torch's, the tokenizer's vocabulary,
    FastAPI's) out of the cyclic collector's reach (`gc.freeze`): a full collection of that heap held
    the interpreter for ~0.6 s on the CPU box (232k objects; 340k with a 100k-piece tokenizer), and
    the server's allocations set one off every few seconds (docs/serve.md, "Where the time goes")."""
    if os.environ.get(GC_FREEZE_ENV, "1") != "0":
        gc.collect()
        gc.freeze()


def chat_template_of(tok: Any) -> str | None:
    """The checkpoint's chat template (tokenizer_config.json's `chat_template`), if it has one."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # HF allows named templates; the default one serves chat
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
