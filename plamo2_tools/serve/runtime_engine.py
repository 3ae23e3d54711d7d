"""The engine that serves PLaMo: `engine_api.Engine` over the runtime's continuous-batching loop
(`runtime/serving/online.py:OnlineLoop`).

Every HTTP sequence is one `GenerationRequest` of one loop (the seam's type is the loop's own), so
concurrent clients share its decode steps; a finished or cancelled sequence gives its slot back at
the loop's next iteration.  What this module adds to the loop:

* **Text** by the runtime's rules (`runtime/serving/text.py`): `TextStream` over the generated
  tokens (an EOS that ended the sequence adds none), cut at the earliest stop string; the same
  text `generate` and `eval` give (`SequenceText`, also used by batch files).
* **EOS**: the loop's, i.e. `text.stop_token_ids` of the checkpoint (tokenizer + generation_config),
  the one rule of generate, eval and the server; `ignore_eos` per request.
* **Logprobs** (generated tokens, and the prompt's with echo) in one scoring pass over prompt +
  completion after the sequence ends (`OnlineLoop.token_scores`, run inside the loop between two of
  its iterations): the decode step computes no log-softmax.  They come with the last event
  (engine_api allows it); the text streams as it is generated.
* **Threads**: the loop calls back on its own thread; events are handed to the asyncio loop in
  one `call_soon_threadsafe` per batch of arrivals, not one per event.
* **Failure**: if the loop dies, every request fails (500), `health` says so and `failed` is set,
  which stops the server with a non-zero exit (`server.serve_forever`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..runtime.serving.engine import Runtime, TokenScores
from ..runtime.serving.online import Event, OnlineLoop
from ..runtime.serving.text import TextStream, decode_kept_specials
from .engine_api import (
    Candidate,
    EngineError,
    EngineStats,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestRejected,
    TokenEvent,
    TokenLogprob,
)

log = logging.getLogger(__name__)
WARM_UP_TIMEOUT_S = 600.0  # the first request also captures every decode graph on CUDA


@dataclass(frozen=True)
class LoopOptions:
    """How the online loop is built: the same on every rank (torchrun ranks build their own)."""

    max_batch: int | str = "auto"  # decode slots, or "auto" (as the device's memory allows)
    max_context: int | None = None  # tokens per sequence (prompt + generated); None: 4096 or the model's
    sync_every: int = 8  # decode steps between two looks at the tokens (events come per look)
    memory_budget: int | None = None  # bytes for "auto" instead of the device's free memory

    def build(self, runtime: Runtime, **kwargs: Any) -> OnlineLoop:
        return OnlineLoop(runtime, max_batch=self.max_batch, max_context=self.max_context,
                          sync_every=self.sync_every, memory_budget=self.memory_budget, **kwargs)  # fmt: skip


def merged(event: Event, queue: asyncio.Queue[Event]) -> Event:
    """`event` and whatever else of its sequence is already waiting, as one event: when the HTTP
    thread falls behind the loop (hundreds of streams), each stream then gets one chunk per look
    instead of a backlog of small ones, and the work per token shrinks as the load grows."""
    while not event.finished and event.error is None and not queue.empty():
        nxt = queue.get_nowait()
        event = dataclasses.replace(nxt, token_ids=event.token_ids + nxt.token_ids,
                                    prompt_logprobs=event.prompt_logprobs or nxt.prompt_logprobs)  # fmt: skip
    return event


class SequenceText:
    """One sequence's text from the loop's events: what `TokenEvent.text` says, by the runtime's
    `TextStream` (no prompt context, so the text is decode(generated tokens) cut at the earliest
    stop string, exactly what eval's `finish_text` gives)."""

    def __init__(self, decode: Any, stop: Sequence[str], eos: Sequence[int]) -> None:
        self.stream = TextStream(decode, stop)
        self.eos = frozenset(eos)
        self.tokens: list[int] = []

    def text(self, event: Event) -> str:
        new = list(event.token_ids)
        self.tokens += new
        if event.finished and event.finish_reason == "stop" and isinstance(event.stop_reason, int) and new:
            new = new[:-1]  # the EOS that ended it shows no text (vLLM's skip_special_tokens)
        out = self.stream.extend(new) if new and self.stream.stopped is None else ""
        if event.finished:
            out += self.stream.finish()
        return out


class RuntimeEngine:
    """`engine_api.Engine` over a loaded `Runtime` (rank 0's side under torchrun)."""

    def __init__(self, runtime: Runtime, model_id: str, options: LoopOptions | None = None,
                 max_logprobs: int = 20, log_failures: bool = True) -> None:  # fmt: skip
        self.runtime = runtime
        self.log_failures = log_failures  # False: the caller raises the loop's failure itself (batch files)
        self.options = options or LoopOptions()
        self.loop = self.options.build(runtime)
        tok = runtime.tokenizer
        self.decode = decode_kept_specials(tok)
        self._info = ModelInfo(
            model_id=model_id,
            vocab_size=int(runtime.config.vocab_size),
            max_context=self.loop.capacity,
            max_batch=self.loop.max_batch,
            eos_token_ids=self.loop.eos,
            bos_token=_text(getattr(tok, "bos_token", None)),
            eos_token=_text(getattr(tok, "eos_token", None)),
            pad_token=_text(getattr(tok, "pad_token", None)),
            chat_template=_chat_template(tok),
            max_logprobs=max_logprobs,
            created=int(time.time()),
        )
        self.aio: asyncio.AbstractEventLoop | None = None
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.lock = threading.Lock()
        self.arrived: list[Event] = []
        self.flush_scheduled = False
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plamo2-serve-score")
        self.stopping = False
        self.failed: str | None = None
        self._pieces: dict[int, str] = {}

    @property
    def info(self) -> ModelInfo:
        return self._info

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop and run one warm-up request through it (the first forward, and on CUDA
        every decode graph's capture, happen before the server takes connections)."""
        self.aio = asyncio.get_running_loop()
        self.loop.start()
        threading.Thread(target=self._watch, name="plamo2-serve-watch", daemon=True).start()
        prompt = (self.info.eos_token_ids or (0,))[:1]
        warm = self.loop.submit(GenerationRequest("plamo2-warm-up", tuple(prompt), 1, temperature=0.0))
        final = await self.aio.run_in_executor(None, warm.result, WARM_UP_TIMEOUT_S)
        if final.error is not None:
            raise EngineError(f"the generation loop failed at start: {final.error}")

    async def stop(self) -> None:
        self.stopping = True
        assert self.aio is not None
        try:
            await self.aio.run_in_executor(None, lambda: self.loop.close(cancel=True))
        except BaseException as e:  # noqa: BLE001 - the failure was reported already (failed, 500s)
            if self.log_failures:
                log.error("the generation loop ended with %r", e)
        self.scorer.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        """The loop's thread ending while the server still serves is fatal."""
        thread = self.loop.thread
        assert thread is not None
        thread.join()
        if not self.stopping:
            why = f"the generation loop died: {self.loop.error!r}" if self.loop.error else "the generation loop stopped"
            if self.log_failures:
                log.error("%s", why)
            self.failed = why

    async def health(self) -> Health:
        if self.failed is not None or not self.loop.alive:
            return Health(False, self.failed or "the generation loop is not running")
        return Health(True)

    def stats(self) -> EngineStats:
        s = self.loop.stats()
        return EngineStats(waiting=s.waiting, running=s.running)

    # ---- tokens ----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.runtime.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.decode(list(token_ids))

    def piece(self, token_id: int) -> str:
        """A token's own text (OpenAI's logprobs.tokens), cached."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.decode([token_id])
        return text

    # ---- requests --------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.failed is not None:
            raise EngineError(self.failed)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.queues[request.request_id] = queue
        try:
            try:
                self.loop.submit(request, on_event=self._from_loop)
            except UserError as e:
                if not self.loop.alive or self.failed is not None:
                    raise EngineError(self.failed or str(e)) from None
                raise RequestRejected(str(e)) from None
            text = SequenceText(self.decode, request.stop, self.info.eos_token_ids)
            scored = request.logprobs is not None or request.prompt_logprobs is not None
            while True:
                event = merged(await queue.get(), queue)
                if event.error is not None:
                    raise EngineError(event.error)
                if event.finish_reason == "cancelled":
                    return  # engine_api: a cancelled sequence's iterator ends without a finish reason
                delta = text.text(event)
                if event.finished:
                    logprobs, prompt = await self._scores(request, text.tokens) if scored else (None, None)
                    yield TokenEvent(event.token_ids, delta, logprobs, prompt, event.finish_reason,  # type: ignore[arg-type]
                                     event.stop_reason)  # fmt: skip
                    return
                if event.token_ids or delta:
                    yield TokenEvent(event.token_ids, delta, () if request.logprobs is not None else None)
        finally:
            self.queues.pop(request.request_id, None)

    def _from_loop(self, event: Event) -> None:
        """On the loop's thread: queue the event; one wake-up of the asyncio loop per batch."""
        with self.lock:
            self.arrived.append(event)
            if self.flush_scheduled:
                return
            self.flush_scheduled = True
        assert self.aio is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
            self.aio.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            events, self.arrived, self.flush_scheduled = self.arrived, [], False
        for e in events:
            queue = self.queues.get(e.request_id)
            if queue is not None:
                queue.put_nowait(e)

    async def _scores(self, request: GenerationRequest, generated: list[int]
                      ) -> tuple[tuple[TokenLogprob, ...] | None, tuple[TokenLogprob, ...] | None]:  # fmt: skip
        """Logprobs of the generated tokens (and of the prompt, when asked) from one scoring pass
        over prompt + completion: the model's log-softmax, before temperature and top-p."""
        prompt = list(request.prompt_token_ids)
        seq = prompt + list(generated)
        want_prompt = request.prompt_logprobs is not None
        start = 1 if want_prompt else len(prompt)
        k = max(request.logprobs or 0, request.prompt_logprobs or 0)
        if start >= len(seq):  # nothing to score (a one-token prompt and no new token)
            scores = None
        else:
            assert self.aio is not None
            try:
                (scores,) = await self.aio.run_in_executor(self.scorer, self.loop.token_scores, [seq], [start], k)
            except (UserError, TimeoutError) as e:
                raise EngineError(f"scoring the sequence failed: {e}") from None
        entries = self._entries(seq, start, scores) if scores is not None else []
        split = len(prompt) - start
        gen = tuple(self._top(e, request.logprobs or 0) for e in entries[split:])
        prompt_lp = None
        if want_prompt:
            first = TokenLogprob(prompt[0], self.piece(prompt[0]), None)
            prompt_lp = (first, *(self._top(e, request.prompt_logprobs or 0) for e in entries[:split]))
        return (gen if request.logprobs is not None else None), prompt_lp

    def _entries(self, seq: list[int], start: int, s: TokenScores) -> list[TokenLogprob]:
        ids, vals = s.top_ids.tolist(), s.top_logprobs.tolist()
        return [
            TokenLogprob(t, self.piece(t), float(lp), tuple(Candidate(i, self.piece(i), float(v))
                                                            for i, v in zip(ids[n], vals[n], strict=True)))
            for n, (t, lp) in enumerate(zip(seq[start:], s.logprobs.tolist(), strict=True))
        ]  # fmt: skip

    @staticmethod
    def _top(entry: TokenLogprob, k: int) -> TokenLogprob:
        return TokenLogprob(entry.token_id, entry.token, entry.logprob, entry.top[:k])


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _chat_template(tok: Any) -> str | None:
    """The checkpoint's chat template (tokenizer_config.json's `chat_template`), if it has one."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # HF allows named templates; the default one serves chat
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None
