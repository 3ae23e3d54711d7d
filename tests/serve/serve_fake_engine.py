"""A small deterministic engine for the server tests: stands in for the runtime until its online
engine exists, and implements `plamo2_tools.serve.engine_api.Engine` to the letter.

Tokenizer: byte-level.  Ids 0-2 are the specials <eos>, <bos>, <|plamo:op|>; ids 3-258 are the
256 bytes; then a few merges ("hello", " world", "the", "é").  Text encodes greedily (specials and
merges by longest match, else the UTF-8 bytes); ids decode to their bytes joined (U+FFFD for a
broken character), special tokens kept.

"Model": the greedy continuation cycles through the prompt's tokens (BOS skipped): prompt "abc"
continues "abcabc...".  A prompt holding "<eos>" therefore ends at its cycle's EOS.  The next-token
distribution puts 1/2 on that token and spreads the rest evenly over the vocabulary; sampling
(temperature > 0) draws from it with a generator seeded by (seed, stream, prompt), so a seed
reproduces the text and choices differ; top_p <= 0.5 keeps only the likely token.  Prompt
logprobs score each prompt token against the greedy guess for the prefix before it (the prefix's
first content token, what the cycle would say next for that prefix as a prompt).

Knobs for tests: `delay` seconds per token, `chunk` tokens per event, prompts containing
"REJECT" / "BUSY" / "FAIL<n>" raise RequestRejected / EngineBusy / EngineError after n tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from plamo2_tools.runtime.batching.text import TextStream
from plamo2_tools.serve.engine_api import (
    Candidate,
    EngineBusy,
    EngineError,
    EngineStats,
    GenerationRequest,
    Health,
    ModelInfo,
    RequestRejected,
    TokenEvent,
    TokenLogprob,
)

EOS, BOS, OP = 0, 1, 2
SPECIALS = ["<eos>", "<bos>", "<|plamo:op|>"]
BYTE0 = 3
MERGES = ["hello", " world", "the", "é"]
PIECES: list[bytes] = [s.encode() for s in SPECIALS] + [bytes([b]) for b in range(256)] + [m.encode() for m in MERGES]
VOCAB_SIZE = len(PIECES)
_MATCHABLE = sorted(
    ((p.decode(), i) for i, p in enumerate(PIECES) if i < BYTE0 or i >= BYTE0 + 256), key=lambda x: -len(x[0])
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|plamo:op|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
P_TOP = 0.5


def encode(text: str, add_special_tokens: bool = True) -> list[int]:
    ids, i = [BOS] if add_special_tokens else [], 0
    while i < len(text):
        hit = next(((s, t) for s, t in _MATCHABLE if text.startswith(s, i)), None)
        if hit is not None:
            ids.append(hit[1])
            i += len(hit[0])
        else:
            ids += [BYTE0 + b for b in text[i].encode()]
            i += 1
    return ids


def decode(ids: Sequence[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def greedy_next(prompt: Sequence[int], step: int) -> int:
    content = [t for t in prompt if t != BOS]
    return content[step % len(content)] if content else EOS


def greedy_ids(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The greedy continuation, EOS included when reached (what the fake generates at temperature 0)."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(greedy_next(prompt, len(out)))
        if out[-1] == EOS:
            break
    return out


def greedy_text(prompt: Sequence[int], max_tokens: int) -> str:
    """The greedy completion text, no stop strings (EOS shows no text)."""
    return decode([t for t in greedy_ids(prompt, max_tokens) if t != EOS])


def logprob_of(token: int, likely: int) -> float:
    return math.log(P_TOP) if token == likely else math.log((1 - P_TOP) / (VOCAB_SIZE - 1))


def top_k(likely: int, k: int) -> tuple[Candidate, ...]:
    ids = [likely] + [t for t in range(VOCAB_SIZE) if t != likely][: max(k - 1, 0)]
    return tuple(Candidate(t, decode([t]), logprob_of(t, likely)) for t in ids[:k])


def token_logprob(token: int, likely: int, k: int) -> TokenLogprob:
    return TokenLogprob(token, decode([token]), logprob_of(token, likely), top_k(likely, k))


def prompt_logprobs(prompt: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    first = TokenLogprob(prompt[0], decode([prompt[0]]), None)
    return (first, *(token_logprob(prompt[p], greedy_next(prompt[:p], 0), k) for p in range(1, len(prompt))))


@dataclass
class FakeEngine:
    model_id: str = "fake-plamo"
    max_context: int = 256
    max_batch: int = 8
    delay: float = 0.0  # seconds per token
    chunk: int = 1  # tokens per event
    chat_template: str | None = None
    submitted: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    started: bool = False
    stopped: bool = False
    healthy: bool = True
    _live: set[str] = field(default_factory=set)
    _waiting: int = 0
    _running: int = 0
    _slots: asyncio.Semaphore | None = None

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            model_id=self.model_id,
            vocab_size=VOCAB_SIZE,
            max_context=self.max_context,
            max_batch=self.max_batch,
            eos_token_ids=(EOS,),
            bos_token="<bos>",
            eos_token="<eos>",
            chat_template=self.chat_template,
            created=1_700_000_000,
        )

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.max_batch)
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return encode(text, add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return decode(token_ids)

    def stats(self) -> EngineStats:
        return EngineStats(waiting=self._waiting, running=self._running)

    async def health(self) -> Health:
        return Health(self.healthy, "" if self.healthy else "the fake was told to be unhealthy")

    def cancel(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self.cancelled.append(request_id)

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.submitted.append(request)
        self._live.add(request.request_id)
        prompt_text = decode(request.prompt_token_ids)
        if "REJECT" in prompt_text:
            raise RequestRejected("the fake engine rejects prompts that say REJECT")
        if "BUSY" in prompt_text:
            raise EngineBusy("the fake engine is busy", retry_after=2)
        fail = re.search(r"FAIL(\d+)", prompt_text)
        assert self._slots is not None, "start() first"
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            async for event in self._generate(request, int(fail.group(1)) if fail else None):
                yield event
        finally:
            self._running -= 1
            self._slots.release()
            self._live.discard(request.request_id)

    async def _generate(self, r: GenerationRequest, fail_after: int | None) -> AsyncIterator[TokenEvent]:
        rng = (
            random.Random(f"{r.seed}|{r.stream}|{list(r.prompt_token_ids)}") if r.seed is not None else random.Random()
        )
        text = TextStream(decode, r.stop, context=r.prompt_token_ids)
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        pieces: list[str] = []
        first = True
        for step in range(r.max_tokens):
            if fail_after is not None and step >= fail_after:
                raise EngineError(f"the fake engine fails after {fail_after} tokens")
            if self.delay:
                await asyncio.sleep(self.delay)
            if r.request_id not in self._live:
                return  # cancelled: end without a finish reason
            likely = greedy_next(r.prompt_token_ids, step)
            token = self._sample(rng, likely, r)
            ids.append(token)
            if r.logprobs is not None:
                lps.append(token_logprob(token, likely, r.logprobs))
            finish, stop_reason = None, None
            if token == EOS:
                pieces.append(text.finish())
                finish, stop_reason = "stop", EOS
            else:
                pieces.append(text.push(token))
                if text.stopped is not None:
                    finish, stop_reason = "stop", text.stopped
                elif step + 1 == r.max_tokens:
                    pieces.append(text.finish())
                    finish = "length"
            if finish is not None or len(ids) >= self.chunk:
                yield TokenEvent(
                    tuple(ids),
                    "".join(pieces),
                    tuple(lps) if r.logprobs is not None else None,
                    prompt_logprobs(r.prompt_token_ids, r.prompt_logprobs)
                    if first and r.prompt_logprobs is not None
                    else None,
                    finish,
                    stop_reason,
                )
                ids, lps, pieces, first = [], [], [], False
            if finish is not None:
                return
            await asyncio.sleep(0)  # let other sequences run, as a batch would

    @staticmethod
    def _sample(rng: random.Random, likely: int, r: GenerationRequest) -> int:
        if r.temperature == 0 or r.top_p <= P_TOP:
            return likely
        return likely if rng.random() < P_TOP else rng.randrange(BYTE0 + 32, BYTE0 + 127)
