"""Chat templates (the Jinja dialect of Hugging Face's ``apply_chat_template``), rendered here so
that the server needs no HF tokenizer object: the engine hands over the template text only.

The template comes with a checkpoint, so it runs in Jinja's immutable sandbox, as transformers
runs it, with the same environment settings (trim_blocks, lstrip_blocks, loop controls) and the
same helpers (``raise_exception``, ``strftime_now``) so that templates written for HF render alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .engine_api import ModelInfo
from .protocol import ApiError, ChatMessage, bad_request


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """The template compiled in the sandbox HF's `apply_chat_template` uses (raises TemplateError)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, source: str, info: ModelInfo) -> None:
        self.template = compile_template(source)  # a broken template fails at start-up, not per request
        self.special = {
            "bos_token": info.bos_token or "",
            "eos_token": info.eos_token or "",
            "pad_token": info.pad_token or "",
        }

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(
                messages=[message_dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except TemplateError as e:  # the template's own refusals (raise_exception) are the user's error
            raise bad_request(f"the chat template refused these messages: {e}", param="messages") from None


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as templates expect it: content flattened to one string, extra keys kept."""
    return {**(m.model_extra or {}), "role": m.role, "content": m.text()}


def no_template_error() -> ApiError:
    return bad_request(
        "this model has no chat template, so /v1/chat/completions is not available; "
        "send the prompt as text to /v1/completions",
        param="messages",
        code="chat_template_missing",
    )
