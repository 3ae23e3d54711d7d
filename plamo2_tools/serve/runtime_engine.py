"""The engine that serves PLaMo in this process: `loop_engine.LoopEngine` over the runtime's
continuous-batching loop (`runtime/batching/online.py:OnlineLoop`) running as a thread here.

Batch files (`generate --input`) use it; `plamo2-tools serve` runs its loop in the model's process
and HTTP in another (`engine_core` + `front`), unless `PLAMO2_SERVE_HTTP_PROCESS=0` asks for this
one (the A/B of docs/serve.md, "Where the time goes").

Every HTTP sequence is one `GenerationRequest` of one loop (the seam's type is the loop's own), so
concurrent clients share its decode steps; a finished or cancelled sequence gives its slot back at
the loop's next iteration.  The loop calls back on its own thread; events are handed to the asyncio
loop in one `call_soon_threadsafe` per batch of arrivals, not one per event.  If the loop dies,
every request fails (500), `health` says so and `failed` is set, which stops the server with a
non-zero exit (`server.serve_forever`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..runtime.batching.engine import Runtime, TokenScores
from ..runtime.batching.online import Event, OnlineLoop
from ..runtime.batching.text import chat_turn_ends, decode_kept_specials, max_piece_chars
from .engine_api import EngineError, EngineStats, GenerationRequest, ModelInfo, RequestRejected
from .loop_engine import LoopEngine, Scores, chat_template_of, freeze_heap, merged, text_or_none
from .trace import TRACE_ENV

log = logging.getLogger(__name__)
WARM_UP_TIMEOUT_S = 600.0  # the first request also captures every decode graph on CUDA

__all__ = ["LoopOptions", "RuntimeEngine", "freeze_heap", "merged", "model_info", "warm_up_request"]


@dataclass(frozen=True)
class LoopOptions:
    """How the online loop is built: the same on every rank (torchrun ranks build their own)."""

    max_batch: int | str = "auto"  # decode slots, or "auto" (as the device's memory allows)
    max_context: int | None = None  # tokens per sequence (prompt + generated); None: 4096 or the model's
    sync_every: int = 8  # decode steps between two looks at the tokens (events come per look)
    memory_budget: int | None = None  # bytes for "auto" instead of the device's free memory

    def build(self, runtime: Runtime, **kwargs: Any) -> OnlineLoop:
        return OnlineLoop(
            runtime,
            max_batch=self.max_batch,
            max_context=self.max_context,
            sync_every=self.sync_every,
            memory_budget=self.memory_budget,
            **kwargs,
        )


def model_info(
    runtime: Runtime,
    loop: OnlineLoop,
    model_id: str,
    created: int,
    max_logprobs: int = 20,
    chat_template: str | None = None,
) -> ModelInfo:
    """What the server tells clients about the model (`chat_template` replaces the checkpoint's)."""
    tok = runtime.tokenizer
    bos_id = getattr(tok, "bos_token_id", None) if getattr(tok, "add_bos_token", False) else None
    return ModelInfo(
        model_id=model_id,
        vocab_size=int(runtime.config.vocab_size),
        max_context=loop.capacity,
        max_batch=loop.max_batch,
        eos_token_ids=loop.eos,
        bos_token=text_or_none(getattr(tok, "bos_token", None)),
        eos_token=text_or_none(getattr(tok, "eos_token", None)),
        pad_token=text_or_none(getattr(tok, "pad_token", None)),
        chat_template=chat_template if chat_template is not None else chat_template_of(tok),
        max_logprobs=max_logprobs,
        created=created,
        prompt_bos_id=int(bos_id) if isinstance(bos_id, int) else None,
        max_piece_chars=max_piece_chars(tok),
        chat_stop=chat_turn_ends(tok),
    )


def warm_up_request(info: ModelInfo) -> GenerationRequest:
    """One greedy token from a one-token prompt: the first forward (and on CUDA every decode graph's
    capture) before the server takes connections."""
    prompt = (info.eos_token_ids or (0,))[:1]
    return GenerationRequest("plamo2-warm-up", tuple(prompt), 1, temperature=0.0)


def scores_of(t: TokenScores) -> Scores:
    return Scores(t.logprobs.tolist(), t.top_ids.tolist(), t.top_logprobs.tolist())


class RuntimeEngine(LoopEngine):
    """`engine_api.Engine` over a loaded `Runtime` whose loop runs as a thread of this process."""

    def __init__(
        self,
        runtime: Runtime,
        model_id: str,
        options: LoopOptions | None = None,
        max_logprobs: int = 20,
        chat_template: str | None = None,
        log_failures: bool = True,
    ) -> None:
        self.runtime = runtime
        self.log_failures = log_failures  # False: the caller raises the loop's failure itself (batch files)
        self.options = options or LoopOptions()
        self.loop = self.options.build(runtime)
        info = model_info(runtime, self.loop, model_id, int(time.time()), max_logprobs, chat_template)
        super().__init__(info, runtime.tokenizer, decode_kept_specials(runtime.tokenizer))
        self.lock = threading.Lock()
        self.arrived: list[Event] = []
        self.flush_scheduled = False
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plamo2-serve-score")
        self.stopping = False
        self.tracing = self.loop.trace = bool(os.environ.get(TRACE_ENV))

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop and run one warm-up request through it (the first forward, and on CUDA
        every decode graph's capture, happen before the server takes connections)."""
        self.aio = asyncio.get_running_loop()
        self.loop.start()
        threading.Thread(target=self._watch, name="plamo2-serve-watch", daemon=True).start()
        warm = self.loop.submit(warm_up_request(self.info))
        final = await self.aio.run_in_executor(None, warm.result, WARM_UP_TIMEOUT_S)
        if final.error is not None:
            raise EngineError(f"the generation loop failed at start: {final.error}")
        freeze_heap()

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

    def _alive(self) -> bool:
        return self.loop.alive

    def stats(self) -> EngineStats:
        s = self.loop.stats()
        return EngineStats(waiting=s.waiting, running=s.running)

    # ---- the loop's side -------------------------------------------------------------------------
    def _send_submit(self, request: GenerationRequest) -> None:
        try:
            self.loop.submit(request, on_event=self._from_loop)
        except UserError as e:
            if not self.loop.alive or self.failed is not None:
                raise EngineError(self.failed or str(e)) from None
            raise RequestRejected(str(e)) from None

    def _send_cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)

    async def _token_scores(self, seqs: list[list[int]], starts: list[int], top_k: int) -> list[Scores]:
        assert self.aio is not None
        try:
            got = await self.aio.run_in_executor(self.scorer, self.loop.token_scores, seqs, starts, top_k)
        except (UserError, TimeoutError) as e:
            raise EngineError(f"scoring the sequence failed: {e}") from None
        return [scores_of(t) for t in got]

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
        self.deliver(events)
