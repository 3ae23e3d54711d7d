"""From a validated request body to the engine's `GenerationRequest`s: tokenise, check against the
model (vocabulary, context), and fan out one sequence per (prompt, choice)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from ..generation_request import RequestRefused, check_context, check_prompt, default_max_tokens
from .engine_api import Engine, GenerationRequest, ModelInfo
from .protocol import ApiError, bad_request

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text as the client sent it (echoed back); None when it sent token ids
    max_tokens: int  # resolved: what the client asked, or all the room left in the context


class TokenizerThread:
    """The engine's tokenize/detokenize on one thread of their own: off the event loop (a long
    prompt must not stall every stream) and never two at once (tokenizers keep caches)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plamo2-serve-tokenizer")

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        return await self.call(lambda: [list(self.engine.tokenize(t, add_special_tokens)) for t in texts])

    async def decode(self, ids: Sequence[int]) -> str:
        return await self.call(lambda: self.engine.detokenize(ids))

    async def pieces(self, ids: Sequence[int]) -> list[str]:
        return await self.call(lambda: [self.engine.detokenize([t]) for t in ids])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def check_token_ids(ids: Sequence[int], info: ModelInfo, what: str, param: str = "prompt") -> None:
    with refused_as_400():
        check_prompt(ids, info.vocab_size, what, param)


def resolve_max_tokens(prompt_len: int, requested: int | None, info: ModelInfo, param: str = "max_tokens") -> int:
    """`requested`, or all the room left when None (vLLM's default); refuses what does not fit."""
    wanted = default_max_tokens(prompt_len, requested, info.max_context)
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


async def completion_prompts(
    raw: Sequence[str | list[int]], max_tokens: int | None, info: ModelInfo, tokenizer: TokenizerThread
) -> list[Prompt]:
    """/v1/completions prompts: texts get BOS as the tokenizer config says; token ids go as they are."""
    texts = [p for p in raw if isinstance(p, str)]
    for i, p in enumerate(raw):
        if p == "":
            raise bad_request(f"prompt {i} is empty", param="prompt")
    encoded = iter(await tokenizer.encode(texts, add_special_tokens=True)) if texts else iter(())
    out = []
    for i, p in enumerate(raw):
        ids = next(encoded) if isinstance(p, str) else list(p)
        check_token_ids(ids, info, f"prompt {i}")
        out.append(Prompt(ids, p if isinstance(p, str) else None, resolve_max_tokens(len(ids), max_tokens, info)))
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
