"""Every refusal: its status, OpenAI's error shape {"error": {"message", "type", "param", "code"}},
and the headers that go with it (Retry-After, WWW-Authenticate)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serve_fake_engine import BOS, VOCAB_SIZE
from serve_harness import Server, wait_until

from plamo2_tools.serve.app import ServerConfig


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


LONG = [BOS] + [70] * 250  # the fake's context is 256 tokens

BAD_BODIES = [
    # malformed or not an object
    (b'{"prompt": "x",', None, "malformed-json"),
    (b"[1, 2]", None, "not-an-object"),
    (b"", None, "empty-body"),
    # wrong types
    ({"prompt": 5}, "prompt", "prompt-int"),
    ({"prompt": [1, "a"]}, "prompt", "prompt-mixed"),
    ({"prompt": [[1], "a"]}, "prompt", "prompt-mixed-lists"),
    ({"prompt": [True, 2]}, "prompt", "prompt-bools"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "max-tokens-str"),
    ({"prompt": "x", "max_tokens": 5.5}, "max_tokens", "max-tokens-float"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "temperature-str"),
    ({"prompt": "x", "n": True}, "n", "n-bool"),
    ({"prompt": "x", "stop": 5}, "stop", "stop-int"),
    ({"prompt": "x", "stream": "yes"}, "stream", "stream-str"),
    ({"prompt": "x", "seed": "1"}, "seed", "seed-str"),
    ({"prompt": "x", "logprobs": 1.5}, "logprobs", "logprobs-float"),
    ({"max_tokens": 3}, "prompt", "prompt-missing"),
    # out of range
    ({"prompt": "x", "n": 0}, "n", "n-0"),
    ({"prompt": "x", "n": 65}, "n", "n-65"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max-tokens-0"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "max-tokens-neg"),
    ({"prompt": "x", "temperature": -0.1}, "temperature", "temperature-neg"),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "temperature-big"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top-p-0"),
    ({"prompt": "x", "top_p": 1.01}, "top_p", "top-p-big"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs-21"),
    ({"prompt": "x", "seed": 2**63}, "seed", "seed-big"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "stop-empty"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "stop-17"),
    # empty prompts
    ({"prompt": ""}, "prompt", "empty-text"),
    ({"prompt": []}, "prompt", "empty-list"),
    ({"prompt": [[]]}, "prompt", "empty-ids"),
    ({"prompt": ["a", ""]}, "prompt", "one-empty"),
    # token ids outside the vocabulary
    ({"prompt": [BOS, VOCAB_SIZE]}, "prompt", "id-too-big"),
    ({"prompt": [[BOS], [-1]]}, "prompt", "id-negative"),
    # the context
    ({"prompt": [BOS, 70], "max_tokens": 255}, "max_tokens", "prompt-plus-max-tokens"),
    ({"prompt": LONG + [70] * 10}, "prompt", "prompt-fills-context"),
    # parameters this server cannot honour
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "presence-penalty"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias", "logit-bias"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best-of"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "suffix"),
]


@pytest.mark.parametrize(("body", "param"), [(b, p) for b, p, _ in BAD_BODIES], ids=[i for _, _, i in BAD_BODIES])
def test_bad_requests_are_400_with_the_error_shape(server: Server, body: Any, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_context_refusal_says_how_long(server: Server) -> None:
    err = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": [BOS, 70], "max_tokens": 300}), 400)
    assert err["code"] == "context_length_exceeded" and "256" in err["message"] and "302" in err["message"]


def test_the_openai_client_raises_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="fake-plamo", prompt="x", max_tokens=0)
    assert e.value.status_code == 400


def test_unknown_model_route_and_method(server: Server) -> None:
    err = error_of(httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    error_of(httpx.get(f"{server.url}/v1/nothing"), 404)
    error_of(httpx.get(f"{server.url}/v1/completions"), 405)


def test_bodies_over_the_limit_are_413(serve: Any) -> None:
    server = serve(ServerConfig(max_body_bytes=1024))
    big = json.dumps({"prompt": "x" * 2000}).encode()
    err = error_of(httpx.post(f"{server.url}/v1/completions", content=big), 413)
    assert err["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is counted while reading
        for i in range(0, len(big), 100):
            yield big[i : i + 100]

    error_of(httpx.post(f"{server.url}/v1/completions", content=chunked()), 413)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2})
    assert ok.status_code == 200


def test_a_full_queue_is_429_with_retry_after(serve: Any) -> None:
    server = serve(ServerConfig(max_queue=1, retry_after_s=3), max_batch=1, delay=0.02)
    body = {"prompt": "abc", "max_tokens": 60, "stream": True}
    results: list[int] = []

    def hold() -> None:  # a streaming client that reads its whole answer
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            results.append(r.status_code)
            r.read()

    held = [threading.Thread(target=hold) for _ in range(2)]
    for t in held:
        t.start()
    wait_until(lambda: server.app.state.serve.admission.admitted == 2)  # one running, one waiting
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    err = error_of(r, 429)
    assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        server.client().completions.create(model="fake-plamo", prompt="x", max_tokens=2)
    # A request that could never fit is a 400, not a 429 to retry forever.
    error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 3}), 400)
    for t in held:
        t.join()
    assert results == [200, 200]
    assert server.app.state.serve.admission.admitted == 0
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key(serve: Any) -> None:
    server = serve(ServerConfig(api_key="s3cret"))
    url = f"{server.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 2}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret"},
        {"Authorization": "Bearer s3cre"},
    ):
        r = httpx.post(url, json=body, headers=headers)
        err = error_of(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    for path in ("/v1/models", "/tokenizer_info"):
        error_of(httpx.get(f"{server.url}{path}"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes carry no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert server.client(api_key="s3cret").completions.create(model="fake-plamo", prompt="x", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").completions.create(model="fake-plamo", prompt="x", max_tokens=2)


def test_no_api_key_means_open(server: Server) -> None:
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusals_keep_their_status(server: Server, stream: bool) -> None:
    url = f"{server.url}/v1/completions"
    err = error_of(httpx.post(url, json={"prompt": "REJECT me", "stream": stream}), 400)
    assert err["code"] == "rejected_by_engine"
    r = httpx.post(url, json={"prompt": "BUSY", "stream": stream})
    assert error_of(r, 503)["code"] == "engine_busy" and r.headers["retry-after"] == "2"
    assert error_of(httpx.post(url, json={"prompt": "FAIL0", "stream": stream}), 500)["type"] == "server_error"


def test_engine_failure_mid_stream_is_an_error_event(server: Server) -> None:
    body = {"prompt": "FAIL3 abc", "max_tokens": 10, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "FAI"
    assert events[-1]["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError):
        list(server.client().completions.create(model="fake-plamo", prompt="FAIL3 abc", max_tokens=10, stream=True))


def test_draining_server_refuses_new_work_with_503(serve: Any) -> None:
    server = serve()
    server.app.state.serve.draining = True
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert error_of(r, 503)["code"] == "shutting_down" and "retry-after" in r.headers
    error_of(httpx.get(f"{server.url}/health"), 503)


def test_unhealthy_engine_is_503(serve: Any) -> None:
    server = serve()
    server.engine.healthy = False
    assert "unhealthy" in error_of(httpx.get(f"{server.url}/health"), 503)["message"]


def test_concurrent_refusals_do_not_leak_admission(serve: Any) -> None:
    """Refused and failed requests give their slots back (else the server would fill up)."""
    server = serve(ServerConfig(max_queue=0), max_batch=2)
    bodies = [{"prompt": p, "max_tokens": 3} for p in ("REJECT", "BUSY", "FAIL0", "FAIL1", "ok")] * 4

    def post(body: dict[str, Any]) -> None:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: server.app.state.serve.admission.admitted == 0)
