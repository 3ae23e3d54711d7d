"""The generation endpoints: /v1/completions and /v1/chat/completions, streamed or not.

Each handler: parse and check the body (400), check the model name (404), tokenise and check the
prompts against the model (400), admit the sequences (429), then run them.  A stream awaits its
first engine event before the 200 goes out, so that an engine refusing the request at once still
gets its own status code; after that, a failure is an error event inside the stream.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .chat_template import ChatTemplate, no_template_error
from .engine_api import Engine, EngineBusy, EngineError, GenerationRequest, ModelInfo, RequestRejected, TokenEvent
from .gate import ARRIVAL
from .metrics import ServerMetrics
from .prompts import (
    Prompt,
    Sampling,
    TokenizerThread,
    check_logprobs,
    check_max_tokens,
    check_text_lengths,
    check_token_ids,
    completion_prompts,
    fan_out,
    resolve_max_tokens,
)
from .protocol import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
    bad_request,
    validation_message,
)
from .responses import (
    SSE_DONE,
    ChatChoiceState,
    CompletionChoiceState,
    chat_logprobs,
    sse,
    sse_error,
    usage,
)
from .streams import Admission, ClientGone, EventStream, Run, prepend, unless_disconnected
from .trace import RequestTrace, Tracer

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
CLIENT_CLOSED = 499  # nginx's "client closed request": what /metrics counts for those
CUT_MESSAGE = "the server shut down before this answer was finished (its --shutdown-timeout ran out)"


@dataclass
class ServerState:
    """What every handler shares: the engine and what the server keeps around it."""

    engine: Engine
    info: ModelInfo
    model_names: tuple[str, ...]  # the engine's model id first, then aliases
    admission: Admission
    metrics: ServerMetrics
    tokenizer: TokenizerThread
    template: ChatTemplate | None
    retry_after: int
    draining: bool = False
    startup_error: BaseException | None = None  # what engine.start() raised, if it did
    tracer: Tracer | None = None  # PLAMO2_SERVE_TRACE: stage times of every request (serve/trace.py)
    jobs: set[Job] = field(default_factory=set)  # admitted and not yet answered (what a shutdown may cut)

    def cut_all(self) -> None:
        """The shutdown timeout is over: every answer still running ends now, a stream with an error
        event and [DONE] (what OpenAI's clients recognise), a whole answer with 503, their engine
        sequences cancelled; before uvicorn's own deadline, which would cancel the tasks mid-write."""
        for job in list(self.jobs):
            job.run.cut()

    def trace(self, request: Request) -> tuple[float, RequestTrace | None]:
        """The request's arrival (the gate's clock, else now) and its trace when tracing."""
        arrival = getattr(request.state, ARRIVAL, None) or time.monotonic()
        return arrival, (self.tracer.start(arrival) if self.tracer is not None else None)


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as `model`, strictly (wrong JSON or wrong types: 400 naming the field)."""
    try:
        parsed = model.model_validate_json(await request.body())
    except ValidationError as e:
        message, param = validation_message(e)
        raise bad_request(message, param=param) from None
    unsupported = getattr(parsed, "unsupported", lambda: None)()
    if unsupported:
        raise bad_request(f"`{unsupported}` is not supported by this server", param=unsupported, code="unsupported")
    return parsed


def check_model(state: ServerState, name: str | None) -> str:
    if name is None or name in state.model_names:
        return name or state.model_names[0]
    raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def check_serving(state: ServerState) -> None:
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down",
            type="service_unavailable",
            code="shutting_down",
            headers={"Retry-After": str(state.retry_after)},
        )


def engine_error(e: EngineError, cut: bool = False) -> ApiError:
    if cut:
        return ApiError(503, CUT_MESSAGE, type="service_unavailable", code="shutting_down")
    if isinstance(e, RequestRejected):
        return bad_request(str(e), code="rejected_by_engine")
    if isinstance(e, EngineBusy):
        return ApiError(
            503,
            str(e),
            type="service_unavailable",
            code="engine_busy",
            headers={"Retry-After": str(max(1, round(e.retry_after)))},
        )
    return ApiError(500, f"the engine failed: {e}", type="server_error")


def _dump(model: BaseModel) -> str:
    return model.model_dump_json()


@dataclass
class Job:
    """One admitted generation request: its engine run and what every chunk repeats."""

    run: Run
    id: str
    model: str
    prompt_lengths: list[int]
    include_usage: bool
    chunk_object: str  # the `object` of its stream chunks
    created: int = 0
    state: ServerState | None = field(default=None, repr=False)

    __hash__ = object.__hash__  # a member of ServerState.jobs by identity

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def usage(self) -> Usage:
        return usage(self.prompt_lengths, self.run.completion_tokens)

    def closed(self) -> None:
        """The response is over (sent, abandoned or failed): admission slots back, the trace written."""
        if self.state is not None:
            self.state.jobs.discard(self)
        self.run.lease.release_all()
        trace = self.run.trace
        if trace is not None:
            trace.finish(
                id=self.id, prompt_tokens=sum(self.prompt_lengths), completion_tokens=sum(self.run.completion_tokens)
            )


async def respond(
    request: Request, job: Job, stream: AsyncIterator[str] | None, body: Callable[[], Awaitable[BaseModel]]
) -> Response:
    """Both endpoints' tail: the whole body, or a stream primed with its first chunk; either
    abandoned (sequences cancelled, slots freed) when the client leaves first or anything fails."""
    trace = job.run.trace
    try:
        if stream is None:
            response = JSONResponse((await unless_disconnected(request.receive, body())).model_dump())
            if trace is not None:
                trace.mark("written")
            job.closed()
            return response
        first = await unless_disconnected(request.receive, anext(stream))
    except BaseException as e:
        # Run's own `finally` does this once it has started; this covers a run that never did.
        if stream is not None:
            await stream.aclose()
        job.closed()
        if isinstance(e, ClientGone):
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(e, EngineError):
            raise engine_error(e, job.run.was_cut) from None
        raise
    return EventStream(prepend(first, stream), on_close=job.closed, trace=trace)


async def stream_events(
    job: Job, render: Callable[[int, TokenEvent], str | None], opening: Callable[[], list[str]] = list
) -> AsyncIterator[str]:
    """SSE chunks: `opening()` once the first event is in, then `render(i, event)` per event
    (None: nothing to send), the usage chunk if asked, [DONE].  An engine error before the first
    chunk propagates (the handler turns it into a status code); after it, it is an error event."""
    started = False
    try:
        async with aclosing(job.run.events()) as events:
            async for i, event in events:
                if not started:
                    started = True
                    for chunk in opening():
                        yield chunk
                chunk = render(i, event)
                if chunk is not None:
                    yield chunk
    except EngineError as e:
        if not started:
            raise
        if job.run.was_cut:
            log.warning("request %s: cut by the shutdown timeout", job.id)
            yield sse_error(CUT_MESSAGE, type="service_unavailable", code=503)
        else:
            log.error("request %s failed mid-stream: %s", job.id, e)
            yield sse_error(f"the engine failed: {e}")
    if job.include_usage:
        yield sse(
            json.dumps(
                {
                    "id": job.id,
                    "object": job.chunk_object,
                    "created": job.created,
                    "model": job.model,
                    "choices": [],
                    "usage": job.usage().model_dump(),
                }
            )
        )
    yield SSE_DONE


def admit(
    state: ServerState,
    arrival: float,
    cid: str,
    model: str,
    prompts: list[Prompt],
    requests: list[GenerationRequest],
    include_usage: bool,
    trace: RequestTrace | None = None,
) -> Job:
    lease = state.admission.admit(len(requests))
    state.metrics.prompt_tokens.inc(sum(len(p.token_ids) for p in prompts))
    if trace is not None:
        trace.mark("admitted")
    run = Run(state.engine, requests, state.metrics, lease, arrival, trace)
    kind = "chat.completion.chunk" if cid.startswith("chatcmpl-") else "text_completion"
    job = Job(run, cid, model, [len(p.token_ids) for p in prompts], include_usage, kind, state=state)
    state.jobs.add(job)
    return job


# ---- /v1/completions --------------------------------------------------------------------------


async def completions(request: Request, state: ServerState) -> Response:
    arrival, trace = state.trace(request)
    req = await parse_body(request, CompletionRequest)
    if trace is not None:
        trace.mark("parsed")
    check_serving(state)
    model = check_model(state, req.model)
    check_logprobs(req.logprobs, state.info, "logprobs")
    check_max_tokens(req.max_tokens, req.echo)
    state.admission.check_size(len(req.prompt) * req.n)  # counted before a single prompt is tokenized
    prompts = await completion_prompts(req.prompt, req.max_tokens, state.info, state.tokenizer)
    if trace is not None:
        trace.mark("tokenized")
    echo = [await _echo_text(state, p) if req.echo else None for p in prompts]
    sampling = Sampling(
        req.temperature,
        req.top_p,
        req.seed,
        req.stop,
        req.logprobs,
        req.logprobs if req.echo else None,
        req.ignore_eos,
    )
    requests = fan_out(cid := f"cmpl-{uuid.uuid4().hex}", prompts, req.n, sampling)
    job = admit(state, arrival, cid, model, prompts, requests, req.include_usage, trace)
    choices = [
        CompletionChoiceState(
            i,
            echo[i // req.n],
            req.logprobs is not None,
            prompts[i // req.n].token_ids if req.return_token_ids else None,
            tokens_as_ids=req.return_tokens_as_token_ids,
            added_bos=prompts[i // req.n].added_bos,
        )
        for i in range(len(requests))
    ]
    sent_prompt_ids: set[int] = set()

    def render(i: int, event: TokenEvent) -> str | None:
        text, lp = choices[i].delta(event)
        if not text and lp is None and event.finish_reason is None and not req.return_token_ids:
            return None  # text held back (a possible stop string): nothing to tell yet
        prompt_ids = token_ids = None
        if req.return_token_ids:
            token_ids = list(event.token_ids)
            if i not in sent_prompt_ids:
                sent_prompt_ids.add(i)
                prompt_ids = choices[i].prompt_token_ids
        choice = CompletionChoice(
            index=i,
            text=text,
            logprobs=lp,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
            prompt_token_ids=prompt_ids,
            token_ids=token_ids,
        )
        return sse(_dump(Completion(id=job.id, created=job.created, model=model, choices=[choice])))

    async def body() -> Completion:
        async with aclosing(job.run.events()) as events:
            async for i, event in events:
                choices[i].delta(event)
        out = [c.choice() for c in choices]
        return Completion(id=job.id, created=job.created, model=model, choices=out, usage=job.usage())

    return await respond(request, job, stream_events(job, render) if req.stream else None, body)


async def _echo_text(state: ServerState, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else await state.tokenizer.decode(prompt.token_ids)


# ---- /v1/chat/completions ---------------------------------------------------------------------


async def chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The rendered template's token ids (no BOS added: the template writes its own)."""
    if state.template is None:
        raise no_template_error()
    template = state.template
    text = await state.tokenizer.call(lambda: template.render(messages, add_generation_prompt))
    check_text_lengths([text], state.info, "the rendered chat")
    (ids,) = await state.tokenizer.encode([text], add_special_tokens=False)
    check_token_ids(ids, state.info, "the rendered chat", param="messages")
    return ids


async def chat_completions(request: Request, state: ServerState) -> Response:
    arrival, trace = state.trace(request)
    req = await parse_body(request, ChatCompletionRequest)
    if trace is not None:
        trace.mark("parsed")
    check_serving(state)
    model = check_model(state, req.model)
    top = req.top_logprobs if req.top_logprobs is not None else 0
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    check_logprobs(top, state.info, "top_logprobs")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_max_tokens(req.max_new_tokens, False, param)
    state.admission.check_size(req.n)
    ids = await chat_prompt(state, req.messages, req.add_generation_prompt)
    if trace is not None:
        trace.mark("tokenized")
    prompt = Prompt(ids, None, resolve_max_tokens(len(ids), req.max_new_tokens, state.info, param))
    stop = tuple(dict.fromkeys((*req.stop, *state.info.chat_stop)))  # the answer ends with the model's turn
    sampling = Sampling(req.temperature, req.top_p, req.seed, stop, top if req.logprobs else None, None, req.ignore_eos)
    requests = fan_out(cid := f"chatcmpl-{uuid.uuid4().hex}", [prompt], req.n, sampling)
    job = admit(state, arrival, cid, model, [prompt], requests, req.include_usage, trace)
    choices = [ChatChoiceState(i, req.logprobs) for i in range(len(requests))]

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(_dump(ChatCompletionChunk(id=job.id, created=job.created, model=model, choices=[choice])))

    def opening() -> list[str]:  # OpenAI sends the role first, once per choice
        role = ChatDelta(role="assistant", content="")
        return [chunk(ChatChunkChoice(index=i, delta=role)) for i in range(len(choices))]

    def render(i: int, event: TokenEvent) -> str | None:
        text, lp = choices[i].delta(event)
        if not text and lp is None and event.finish_reason is None:
            return None
        return chunk(
            ChatChunkChoice(
                index=i,
                delta=ChatDelta(content=text),
                logprobs=lp,
                finish_reason=event.finish_reason,
                stop_reason=event.stop_reason,
            )
        )

    async def body() -> ChatCompletion:
        async with aclosing(job.run.events()) as events:
            async for i, event in events:
                choices[i].delta(event)
        out = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content="".join(c.text)),
                logprobs=chat_logprobs(c.logprobs) if c.want_logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in choices
        ]
        return ChatCompletion(id=job.id, created=job.created, model=model, choices=out, usage=job.usage())

    return await respond(request, job, stream_events(job, render, opening) if req.stream else None, body)
