"""Engine events -> OpenAI response bodies and stream chunks.

Each choice keeps one small state object whose `delta(event)` gives what that event adds (text,
logprobs).  A non-streamed response is the concatenation of exactly the deltas a stream sends, so
the two can never disagree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .engine_api import TokenEvent, TokenLogprob
from .protocol import ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, TopLogprob, Usage


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(message: str, type: str = "server_error", code: int = 500) -> str:
    """OpenAI's in-stream error event (the status line was 200 already)."""
    return sse(json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}))


def usage(prompt_lengths: Sequence[int], completion_tokens: Sequence[int]) -> Usage:
    """Each prompt counts once however many choices it has (OpenAI's and vLLM's rule)."""
    p, c = sum(prompt_lengths), sum(completion_tokens)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


# JSON has no -inf: a token the model rules out (a masked or underflowed logit) shows as this
# number, vLLM's convention, in streams and whole responses alike.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def token_name(t: TokenLogprob, as_ids: bool) -> str:
    """How a token is named in a logprobs object: its text, or with vLLM's
    `return_tokens_as_token_ids` "token_id:N" (texts collide: every lone byte of a multi-byte
    character shows as U+FFFD, so a client mapping texts back to ids cannot tell them apart)."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def _top_dict(t: TokenLogprob, as_ids: bool = False) -> dict[str, float] | None:
    """OpenAI's {token text: logprob} of the alternatives, the chosen token always among them
    (vLLM's rule; lm-eval compares the chosen logprob with the maximum of these)."""
    if t.logprob is None:
        return None
    top = {token_name(c, as_ids): finite(c.logprob) for c in t.top}
    top.setdefault(token_name(t, as_ids), finite(t.logprob))
    return top


def legacy_logprobs(
    tokens: Sequence[TokenLogprob], offset: int, as_ids: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The completions logprobs object of these tokens, text offsets counted from `offset` by the
    tokens' own texts (an approximation, as in vLLM, where a stop string cut the last token);
    `as_ids`: tokens named "token_id:N" (`token_name`)."""
    out = CompletionLogprobs()
    for t in tokens:
        out.tokens.append(token_name(t, as_ids))
        out.token_logprobs.append(None if t.logprob is None else finite(t.logprob))
        out.top_logprobs.append(_top_dict(t, as_ids))
        out.text_offset.append(offset)
        offset += len(t.token)
    return out, offset


def prompt_logprobs(
    tokens: Sequence[TokenLogprob], added: int, text_length: int, as_ids: bool = False
) -> CompletionLogprobs:
    """The echoed prompt's logprobs object: offsets into the echoed text, so the `added` leading tokens
    the tokenizer put there (a BOS, not in the text) take no characters, and no offset passes the
    text's end (byte tokens show one U+FFFD each for what is one character of the text), which keeps
    the offsets monotonic into the generated tokens' (they start at the text's end)."""
    out, _ = legacy_logprobs(tokens, 0, as_ids)
    offset, offsets = 0, []
    for n, t in enumerate(tokens):
        offsets.append(min(offset, text_length))
        if n >= added:
            offset += len(t.token)
    out.text_offset = offsets
    return out


def extend_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


@dataclass
class CompletionChoiceState:
    """One /v1/completions choice.  With echo, the first delta starts with the prompt text; the
    prompt's logprobs (when asked) come in the delta of the event that carries them, which is never
    after the first generated logprobs (engine_api.TokenEvent), so the token lists keep prompt
    first; generated tokens' text offsets continue after the echoed text.  Keeps what it gave
    out, for the non-streamed response."""

    index: int
    echo_text: str | None  # None: no echo
    want_logprobs: bool
    prompt_token_ids: list[int] | None = None  # set: return_token_ids (vLLM's extension)
    offset: int = 0
    started: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    texts: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] = field(default_factory=list)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    added_bos: int = 0  # leading prompt tokens the tokenizer added (not in the echoed text: no offset width)

    def delta(self, event: TokenEvent) -> tuple[str, CompletionLogprobs | None]:
        text, lp = "", CompletionLogprobs() if self.want_logprobs else None
        if not self.started:
            self.started = True
            if self.echo_text is not None:
                text = self.echo_text
                self.offset = len(self.echo_text)
        if lp is not None and self.echo_text is not None and event.prompt_logprobs is not None:
            extend_logprobs(
                lp, prompt_logprobs(event.prompt_logprobs, self.added_bos, len(self.echo_text), self.tokens_as_ids)
            )
        self.token_ids += event.token_ids
        text += event.text
        if lp is not None and event.logprobs is not None:
            more, self.offset = legacy_logprobs(event.logprobs, self.offset, self.tokens_as_ids)
            extend_logprobs(lp, more)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        self.texts.append(text)
        if lp is not None:
            if self.logprobs is None:
                self.logprobs = CompletionLogprobs()
            extend_logprobs(self.logprobs, lp)
        return text, lp

    def choice(self) -> CompletionChoice:
        """The whole choice so far (the non-streamed response's)."""
        ids = self.prompt_token_ids is not None
        return CompletionChoice(
            index=self.index,
            text="".join(self.texts),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids) if ids else None,
        )


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> ChatLogprobs:
    def entry(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8")))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=t.token,
                logprob=finite(t.logprob) if t.logprob is not None else LOGPROB_FLOOR,
                bytes=list(t.token.encode("utf-8")),
                top_logprobs=[entry(c.token, c.logprob) for c in t.top],
            )
            for t in tokens
        ]
    )


@dataclass
class ChatChoiceState:
    """One /v1/chat/completions choice."""

    index: int
    want_logprobs: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def delta(self, event: TokenEvent) -> tuple[str, ChatLogprobs | None]:
        self.text.append(event.text)
        lp = None
        if self.want_logprobs and event.logprobs is not None:
            self.logprobs += event.logprobs
            lp = chat_logprobs(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        return event.text, lp
