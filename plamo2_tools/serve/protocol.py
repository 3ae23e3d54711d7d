"""OpenAI's wire format (and vLLM's tokenizer endpoints) as pydantic v2 models, plus the error shape.

Requests are validated strictly (``strict=True``: no "5" for 5, no true for 1) straight from the
JSON bytes, so a field of the wrong type is a 400 naming the field, as OpenAI answers.  Unknown
fields are ignored, as vLLM and OpenAI do (clients such as lm-eval pass extra generation kwargs),
except the OpenAI parameters this server cannot honour: those are refused unless they hold their
neutral value, so a request never silently means something else than it says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

MAX_N = 64  # choices per prompt
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM any number)
MAX_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs; engines may allow fewer (ModelInfo.max_logprobs)
INT64 = 2**63


class ApiError(Exception):
    """A refusal: its HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def unsupported(self) -> str | None:
        """The first OpenAI parameter given with a value this server cannot honour, or None."""
        extra = self.model_extra or {}
        return next((k for k, neutral in _UNSUPPORTED.items() if k in extra and not neutral(extra[k], self)), None)


def _is_neutral_best_of(v: Any, req: Any) -> bool:
    return v is None or (type(v) is int and v == getattr(req, "n", 1))


# OpenAI parameters this server cannot honour -> whether a value is the neutral one.  Neutral values
# pass, because clients send them whatever they mean (SDK defaults, lm-eval's payloads).
_UNSUPPORTED: dict[str, Callable[[Any, Any], bool]] = {
    "presence_penalty": lambda v, _: v in (None, 0),
    "frequency_penalty": lambda v, _: v in (None, 0),
    "repetition_penalty": lambda v, _: v in (None, 1),
    "logit_bias": lambda v, _: v in (None, {}),
    "best_of": _is_neutral_best_of,
    "suffix": lambda v, _: v in (None, ""),
    "tools": lambda v, _: v in (None, []),
    "tool_choice": lambda v, _: v in (None, "none"),
    "functions": lambda v, _: v in (None, []),
    "function_call": lambda v, _: v in (None, "none"),
    "response_format": lambda v, _: v is None or v == {"type": "text"},
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


def _check_stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return tuple(stops)


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)  # bool is not a token id


PromptInput = str | list[int]
PROMPT_SHAPES = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"


class _Sampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: tuple[str, ...] = ()
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # a label for abuse monitoring: accepted, unused
    ignore_eos: bool = False  # vLLM's extension: the checkpoint's EOS ids do not end the sequence

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        return _check_stop(v)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: list[PromptInput]  # normalised: one entry per prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and token_ids in each choice
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens "token_id:N"

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> list[PromptInput]:
        """str | list[str] | list[int] | list[list[int]] -> a list of prompts (each str or ids)."""
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list):
            raise ValueError(PROMPT_SHAPES)
        if not v:
            raise ValueError("prompt must not be empty")
        if _is_token_list(v):
            return [v]
        if all(isinstance(p, str) for p in v) or all(_is_token_list(p) for p in v):
            return list(v)
        raise ValueError(PROMPT_SHAPES)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read e.g. `name`
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """Content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension: False continues the last message

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """POST /tokenize, vLLM's shape: a prompt, or chat messages when the model has a template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize, vLLM's shape."""

    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    """The legacy completions logprobs object (one entry per token, echoed prompt first)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None  # vLLM's extension: which stop string / EOS id ended it
    prompt_token_ids: list[int] | None = None  # with return_token_ids (the first chunk of a stream)
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids (EOS included)

    @model_serializer(mode="wrap")
    def _without_unasked_ids(self, handler: Any) -> Any:
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids"):  # only with return_token_ids, as in vLLM
            if isinstance(data, dict) and data.get(key) is None:
                data.pop(key, None)
        return data


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "plamo2-tools"
    root: str
    max_model_len: int  # vLLM's extension


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One readable line and the offending parameter from pydantic's errors (the first one: it is
    the one a user fixes first)."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    msg = str(err.get("msg", "invalid request"))
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", None
    if err.get("type") == "model_type" and not loc:
        return "the request body must be a JSON object", None
    where = ".".join(loc)
    if not where or msg.startswith(f"{where} "):  # our own validators name the field already
        return msg, param
    return f"{where}: {msg}", param
