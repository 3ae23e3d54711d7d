"""/v1/chat/completions: refused (400) when the engine has no chat template; with one, rendered
in Jinja's sandbox and generated like a completion, streamed or not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from serve_fake_engine import CHAT_TEMPLATE, decode, encode, greedy_ids, greedy_text
from serve_harness import Server

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
RENDERED = "<bos><|system|>be brief<|plamo:op|><|user|>hello<|plamo:op|><|assistant|>"


@pytest.fixture(scope="module")
def chat_server() -> Any:
    from serve_harness import make_engine, running_server

    with running_server(make_engine(chat_template=CHAT_TEMPLATE)) as s:
        yield s


def test_chat_is_refused_without_a_template(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "fake-plamo", "messages": MESSAGES})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "chat_template_missing"
    assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="fake-plamo", messages=MESSAGES)  # type: ignore[arg-type]


def test_chat_renders_the_template_and_generates(chat_server: Server, fake_only: None) -> None:
    r = chat_server.client().chat.completions.create(
        model="fake-plamo",
        messages=MESSAGES,
        max_tokens=9,
        temperature=0,  # type: ignore[arg-type]
    )
    ids = encode(RENDERED, add_special_tokens=False)
    assert r.choices[0].message.content == greedy_text(ids, 9) and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage is not None and r.usage.prompt_tokens == len(ids)
    tok = httpx.post(f"{chat_server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert tok["tokens"] == ids


def test_chat_stream_equals_the_whole_answer(chat_server: Server) -> None:
    body = {
        "model": "fake-plamo",
        "messages": MESSAGES,
        "max_tokens": 20,
        "temperature": 0,
        "n": 2,
        "stop": ["|>"],
        "stream_options": {"include_usage": True},
    }
    whole = httpx.post(f"{chat_server.url}/v1/chat/completions", json=body).json()
    with httpx.stream("POST", f"{chat_server.url}/v1/chat/completions", json=body | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


def test_chat_logprobs(chat_server: Server, fake_only: None) -> None:
    r = chat_server.client().chat.completions.create(
        model="fake-plamo",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    want = [decode([t]) for t in greedy_ids(encode(RENDERED, add_special_tokens=False), 4)]
    assert [t.token for t in content] == want == ["<", "|", "s", "y"]
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_chat_refusals(chat_server: Server) -> None:
    url = f"{chat_server.url}/v1/chat/completions"
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MESSAGES, "max_completion_tokens": 10_000}, "max_completion_tokens"),
    ]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
