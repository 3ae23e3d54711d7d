"""The FastAPI app factory: `create_app(engine, config)`.

Routes are thin: parsing, checks and response assembly live in `handlers.py`, the wire format in
`protocol.py`, the engine contract in `engine_api.py`.  FastAPI (on Starlette, served by uvicorn,
with pydantic v2 models) is the stack vLLM's OpenAI server uses, so its behaviour at the edges
(disconnects, streaming, error handlers) is the one clients of local OpenAI-style servers
already meet.  Bodies are parsed by the handlers themselves (`parse_body`) rather than by
FastAPI's signature magic, so that every refusal is OpenAI's error JSON with status 400, not
FastAPI's 422 shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..version import __version__
from . import handlers
from .chat_template import ChatTemplate
from .engine_api import Engine, EngineStats
from .gate import Gate
from .handlers import ServerState, check_model, parse_body
from .metrics import CONTENT_TYPE, ServerMetrics
from .prompts import TokenizerThread, check_token_ids
from .protocol import ApiError, DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, error_body
from .streams import Admission
from .trace import tracer_from_env

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None  # when set, every route but /health and /metrics needs `Authorization: Bearer KEY`
    served_model_names: tuple[str, ...] = ()  # names accepted besides the engine's model id
    max_queue: int = 256  # sequences admitted beyond the engine's max_batch before 429
    max_body_bytes: int = 16 * 2**20  # bigger bodies: 413 (a 2048-token batch of 64 prompts is ~1 MiB)
    retry_after_s: int = 1  # the Retry-After of 429 and 503


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    info = engine.info
    names = tuple(dict.fromkeys((info.model_id, *config.served_model_names)))
    admission = Admission(info.max_batch + config.max_queue, config.retry_after_s)
    stats = _StatsReader(engine)
    metrics = ServerMetrics(
        waiting=lambda: stats().waiting, running=lambda: stats().running, admitted=lambda: admission.admitted
    )
    template = ChatTemplate(info.chat_template, info) if info.chat_template else None
    state = ServerState(
        engine,
        info,
        names,
        admission,
        metrics,
        TokenizerThread(engine),
        template,
        config.retry_after_s,
        tracer=tracer_from_env(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await engine.start()
        except BaseException as e:
            state.startup_error = e  # for the caller: uvicorn only logs it
            raise
        try:
            yield
        finally:
            state.draining = True
            await engine.stop()
            state.tokenizer.close()
            if state.tracer is not None:
                state.tracer.close()

    app = FastAPI(
        title="plamo2-tools", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.serve = state
    _routes(app, state)
    _error_handlers(app)
    app.add_middleware(Gate, metrics=metrics, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    return app


class _StatsReader:
    """engine.stats() at most once per scrape: three gauges read it, and it may take a lock."""

    def __init__(self, engine: Engine, max_age_s: float = 0.05) -> None:
        self.engine, self.max_age_s = engine, max_age_s
        self.at = -1.0
        self.stats = EngineStats(0, 0)

    def __call__(self) -> EngineStats:
        now = time.monotonic()
        if self.at < 0 or now - self.at > self.max_age_s:
            self.at, self.stats = now, self.engine.stats()
        return self.stats


def _routes(app: FastAPI, state: ServerState) -> None:
    info = state.info

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handlers.completions(request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handlers.chat_completions(request, state)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [
            ModelCard(id=n, created=info.created, root=info.model_id, max_model_len=info.max_context)
            for n in state.model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        try:
            h = await asyncio.wait_for(state.engine.health(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine did not answer the health check", type="service_unavailable") from None
        if not h.ok:
            raise ApiError(503, f"the engine is unhealthy: {h.detail}", type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        check_model(state, req.model)
        if req.messages is not None:
            ids = await handlers.chat_prompt(state, req.messages, req.add_generation_prompt)
            if req.add_special_tokens:  # vLLM lets a client ask for BOS on top of the template
                text = await state.tokenizer.decode(ids)
                (ids,) = await state.tokenizer.encode([text], add_special_tokens=True)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            (ids,) = await state.tokenizer.encode([req.prompt or ""], add_special_tokens=add)
        strs = await state.tokenizer.pieces(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": info.max_context, "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        check_model(state, req.model)
        if req.tokens:
            check_token_ids(req.tokens, info, "tokens", param="tokens")
        return JSONResponse({"prompt": await state.tokenizer.decode(req.tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        """vLLM's endpoint, which lm-eval's `tokenizer_backend=remote` (and `auto`) reads."""
        return JSONResponse(
            {
                "tokenizer_class": "plamo2-tools",
                "eos_token": info.eos_token,
                "bos_token": info.bos_token,
                "pad_token": info.pad_token,
                "eos_token_ids": list(info.eos_token_ids),
                "chat_template": info.chat_template,
                "model_max_length": info.max_context,
                "vocab_size": info.vocab_size,
            }
        )


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        """Starlette's own refusals (unknown route 404, wrong method 405) in OpenAI's shape."""
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(
            error_body(message, "invalid_request_error", None, None),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> Response:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"), status_code=500)
