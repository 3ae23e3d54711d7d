"""From a validated request body to the engine's `GenerationRequest`s: tokenise, check against the
model (vocabulary, context), and fan out one sequence per (prompt, choice)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ..generation_request import RequestRefused, check_context, check_prompt, default_max_tokens
from .engine_api import Engine, GenerationRequest, ModelInfo
from .protocol import ApiError, bad_request

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text as the client sent it (echoed back); None when it sent token ids
    max_tokens: int  # resolved: what the client asked, or the default (16, or the room left for chat)
    added_bos: int = 0  # leading tokens the tokenizer added (a BOS): not in `text`, so 0 characters of it


class _Work:
    """One request's texts for the tokenizer thread: done one at a time, its results in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, items: list[Callable[[], Any]]) -> None:
        self.loop, self.items = loop, items
        self.results: list[Any] = []
        self.future: asyncio.Future[list[Any]] = loop.create_future()

    def settle(self, error: BaseException | None) -> None:
        if not self.future.done():
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(self.results)


class TokenizerThread:
    """The engine's tokenize/detokenize on one thread of their own: off the event loop (a long
    prompt must not stall every stream) and never two at once (tokenizers keep caches).

    Requests take turns, one text each (round robin): a request with many prompts never makes one
    with a single prompt wait for all of them, only for the text being tokenized (whose length the
    handlers bound by the context before it gets here: `check_text_lengths`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.queue: deque[_Work] = deque()
        self.closed = False
        self.thread: threading.Thread | None = None

    async def run_each(self, items: list[Callable[[], T]]) -> list[T]:
        """Every item's result, in order, run on the tokenizer thread in turn with other requests."""
        if not items:
            return []
        work = _Work(asyncio.get_running_loop(), list(items))
        with self.cond:
            if self.closed:
                raise RuntimeError("the tokenizer thread is closed")
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="plamo2-serve-tokenizer", daemon=True)
                self.thread.start()
            self.queue.append(work)
            self.cond.notify()
        try:
            return await work.future
        finally:
            work.items = []  # abandoned (client gone): the rest is never run

    def _serve(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.closed)
                if self.closed:
                    return
                work = self.queue.popleft()
            done = len(work.results)
            if done >= len(work.items):
                continue  # abandoned
            error: BaseException | None = None
            try:
                work.results.append(work.items[done]())
            except Exception as e:  # handed to the awaiting handler
                error = e
            if error is not None or len(work.results) == len(work.items):
                with contextlib.suppress(RuntimeError):  # the event loop is closed
                    work.loop.call_soon_threadsafe(work.settle, error)
                continue
            with self.cond:
                self.queue.append(work)  # to the back: the others take their turn first

    async def call(self, fn: Callable[[], T]) -> T:
        (out,) = await self.run_each([fn])
        return out

    async def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        engine = self.engine
        return await self.run_each(
            [lambda t=t: list(engine.tokenize(t, add_special_tokens)) for t in texts]  # type: ignore[misc]
        )

    async def decode(self, ids: Sequence[int]) -> str:
        return await self.call(lambda: self.engine.detokenize(ids))

    async def pieces(self, ids: Sequence[int]) -> list[str]:
        return await self.call(lambda: [self.engine.detokenize([t]) for t in ids])

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def check_token_ids(ids: Sequence[int], info: ModelInfo, what: str, param: str = "prompt") -> None:
    with refused_as_400():
        check_prompt(ids, info.vocab_size, what, param)


DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's and vLLM's default


def check_max_tokens(max_tokens: int | None, echo: bool, param: str = "max_tokens") -> None:
    """0 tokens only to score the prompt (completions' echo), as vLLM allows."""
    if max_tokens == 0 and not echo:
        raise bad_request(f"{param} must be >= 1 (0 only with echo, which returns the prompt alone)", param=param)


def resolve_max_tokens(
    prompt_len: int, requested: int | None, info: ModelInfo, param: str = "max_tokens", default: int | None = None
) -> int:
    """`requested`, else `default` within the room left, else all the room left (vLLM's defaults:
    16 for completions, the room for chat); refuses what does not fit."""
    wanted = default_max_tokens(prompt_len, requested, info.max_context, default)
    with refused_as_400():
        check_context(prompt_len, wanted, info.max_context, param if requested is not None else "prompt")
    return wanted


@contextmanager
def refused_as_400() -> Iterator[None]:
    """The request rules (generation_request.py) refuse in OpenAI's shape: 400, param and code."""
    try:
        yield
    except RequestRefused as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


def check_text_lengths(texts: Sequence[str | list[int]], info: ModelInfo, what: str = "prompt") -> None:
    """Refuse, before tokenizing, a text that cannot fit the context at any tokenization: one of L
    characters is at least L / `info.max_piece_chars` tokens (so a 16 MiB text never reaches the
    tokenizer to be refused afterwards)."""
    longest = info.max_piece_chars
    if not longest:
        return
    for i, t in enumerate(texts):
        if isinstance(t, str) and len(t) > info.max_context * longest:
            least = -(-len(t) // longest)
            raise ApiError(
                400,
                f"{what} {i} has {len(t):,} characters, so at least {least:,} tokens: more than "
                f"this model's maximum context length of {info.max_context} tokens",
                param="prompt",
                code="context_length_exceeded",
            )


async def completion_prompts(
    raw: Sequence[str | list[int]], max_tokens: int | None, info: ModelInfo, tokenizer: TokenizerThread
) -> list[Prompt]:
    """/v1/completions prompts: texts get BOS as the tokenizer config says; token ids go as they are.
    Without max_tokens a prompt gets OpenAI's default of 16 (within the room the context leaves)."""
    texts = [p for p in raw if isinstance(p, str)]
    for i, p in enumerate(raw):
        if p == "":
            raise bad_request(f"prompt {i} is empty", param="prompt")
    check_text_lengths(raw, info)
    encoded = iter(await tokenizer.encode(texts, add_special_tokens=True)) if texts else iter(())
    out = []
    for i, p in enumerate(raw):
        ids = next(encoded) if isinstance(p, str) else list(p)
        check_token_ids(ids, info, f"prompt {i}")
        wanted = resolve_max_tokens(len(ids), max_tokens, info, default=DEFAULT_COMPLETION_TOKENS)
        added = int(isinstance(p, str) and info.prompt_bos_id is not None and ids[:1] == [info.prompt_bos_id])
        out.append(Prompt(ids, p if isinstance(p, str) else None, wanted, added))
    return out


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None
    prompt_logprobs: int | None
    ignore_eos: bool = False


def check_logprobs(k: int | None, info: ModelInfo, param: str) -> None:
    if k is not None and k > info.max_logprobs:
        raise bad_request(f"{param} must be at most {info.max_logprobs} for this model", param=param)


def fan_out(base_id: str, prompts: Sequence[Prompt], n: int, s: Sampling) -> list[GenerationRequest]:
    """One request per (prompt, choice), in OpenAI's choice order: index = prompt * n + choice."""
    return [
        GenerationRequest(
            request_id=f"{base_id}-{p}-{j}",
            prompt_token_ids=tuple(prompt.token_ids),
            max_tokens=prompt.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stream=j,
            stop=s.stop,
            logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs,
            ignore_eos=s.ignore_eos,
        )
        for p, prompt in enumerate(prompts)
        for j in range(n)
    ]
