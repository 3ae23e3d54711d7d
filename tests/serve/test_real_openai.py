"""`plamo2-tools serve` on the runtime (tiny synthetic PLaMo 2, TP1, ranks as threads), with the
official openai client and raw httpx on loopback.  Every answer is compared with the in-process
runtime running that request alone (real_serve.Oracle), never with the server itself."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from real_serve import CliServer, Oracle

PROMPTS = ["Hello world", "The cat sat on", "日本語のテキスト", "1 2 3 4 5"]
KEY = "sekret-key-for-tests"


@pytest.fixture(scope="module")
def shard_dir(shards):  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=5)  # seed 5: its translate answers below reach <|plamo:op|>


@pytest.fixture(scope="module")
def oracle(shard_dir) -> Iterator[Oracle]:  # type: ignore[no-untyped-def]
    o = Oracle(shard_dir)
    yield o
    o.close()


@pytest.fixture(scope="module")
def server(shard_dir) -> Iterator[CliServer]:  # type: ignore[no-untyped-def]
    s = CliServer(shard_dir, "--max-batch", "16", "--max-context", "512", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0, s.output


@pytest.fixture(scope="module")
def strict_server(shard_dir) -> Iterator[CliServer]:  # type: ignore[no-untyped-def]
    """One decode slot, no queue, small bodies and contexts, and an API key from the environment."""
    s = CliServer(
        shard_dir,
        "--max-batch",
        "1",
        "--max-queue",
        "0",
        "--max-body-bytes",
        "4096",
        "--max-context",
        "2048",
        env={"PLAMO2_API_KEY": KEY},
    )
    yield s
    assert s.stop() == 0, s.output


def test_text_batch_and_token_id_prompts_equal_the_runtime_alone(server: CliServer, oracle: Oracle) -> None:
    client = server.client()
    one = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    text, finish = oracle.complete(PROMPTS[0], 20)
    assert (one.choices[0].text, one.choices[0].finish_reason) == (text, finish)
    assert one.usage.prompt_tokens == len(oracle.ids(PROMPTS[0])) and one.usage.completion_tokens == 20
    assert one.model == "tiny"

    batch = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [(c.text, c.finish_reason) for c in batch.choices] == [oracle.complete(p, 12) for p in PROMPTS]

    ids = [1, 17, 200, 33, 999, 5]
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=9, temperature=0, extra_body={"return_token_ids": True}
    )
    want = oracle.tokens(ids, 9)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == oracle.text(want)[0]
    lists = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [c.text for c in lists.choices] == [oracle.complete(ids, 5)[0], oracle.complete(ids[:3], 5)[0]]


def test_streamed_chunks_concatenate_to_the_whole_answer(server: CliServer, oracle: Oracle) -> None:
    client = server.client()
    chunk_counts = []
    for prompt in PROMPTS:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        texts = [c.choices[0].text for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert "".join(texts) == whole.choices[0].text == oracle.complete(prompt, 40)[0]
        assert finishes == [whole.choices[0].finish_reason]
        chunk_counts.append(len(texts))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # 40 tokens drained every 8 steps come in several chunks (fewer only when the HTTP thread lags
    # and merges what waits: so not every stream must show it)
    assert max(chunk_counts) > 1, chunk_counts


def test_stop_strings_cut_exactly(server: CliServer, oracle: Oracle) -> None:
    client = server.client()
    full, _ = oracle.complete(PROMPTS[1], 40)
    for stop in {full[5:8], full[12:13], full[-4:]}:  # cut inside, one character, at the very end
        assert stop
        want = full[: full.find(stop)]
        for stream in (False, True):
            r = client.completions.create(
                model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop, stream=stream
            )
            chunks = list(r) if stream else [r]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == want, (stop, text, want)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    never = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=["\x00never\x00"]
    )
    assert never.choices[0].text == full and never.choices[0].finish_reason == "length"


# plamo-2-translate's prompt (its model card's, as LM Studio and llama.cpp users send it): the
# answer ends where the model writes the next <|plamo:op|>, a special token whose text the
# server keeps visible precisely so that this stop string can match it.
TRANSLATE = "<|plamo:op|>dataset\ntranslation\n<|plamo:op|>input lang=English\n{}\n<|plamo:op|>output lang=Japanese\n"
OP = "<|plamo:op|>"


def test_the_translate_prompt_stops_at_its_op_token(server: CliServer, oracle: Oracle) -> None:
    prompt = TRANSLATE.format("Hello.")
    ids = oracle.ids(prompt)
    assert ids.count(oracle.tok.convert_tokens_to_ids(OP)) == 3  # the text's markers are the special token
    full = oracle.text(oracle.tokens(ids, 64))[0]
    assert OP in full and not full.startswith(OP), "the tiny model (seed 5) writes the marker mid-answer"
    for stream in (False, True):
        r = server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=64, temperature=0, stop=[OP], stream=stream
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == full[: full.find(OP)]
        last = chunks[-1].choices[0]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == OP


def test_seeded_sampling_reproduces_and_is_the_runtimes(server: CliServer, oracle: Oracle) -> None:
    client = server.client()

    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, top_p=0.9, seed=seed, n=n
        )
        return [c.text for c in r.choices]

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b and a != c
    ids = oracle.ids(PROMPTS[0])
    assert a[0] == oracle.text(oracle.tokens(ids, 16, temperature=1.0, top_p=0.9, seed=7, key=0))[0]
    two = sample(7, n=2)  # choice k draws from stream k: choice 0 is the n=1 answer, choice 1 differs
    assert two[0] == a[0] and two[1] != a[0]
    assert two[1] == oracle.text(oracle.tokens(ids, 16, temperature=1.0, top_p=0.9, seed=7, key=1))[0]


def test_models_health_tokenize_detokenize(server: CliServer, oracle: Oracle) -> None:
    with server.http() as h:
        models = h.get("/v1/models").json()
        assert [m["id"] for m in models["data"]][:1] == [server.model] and models["data"][0]["max_model_len"] == 512
        assert h.get("/health").json() == {"status": "ok"}
        tok = h.post("/tokenize", json={"prompt": PROMPTS[2]}).json()
        assert tok["tokens"] == oracle.ids(PROMPTS[2]) and tok["count"] == len(tok["tokens"])
        assert h.post("/detokenize", json={"tokens": tok["tokens"][1:]}).json()["prompt"] == PROMPTS[2]


def test_chat_is_refused_without_a_template(server: CliServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400
    assert e.value.body["code"] == "chat_template_missing" and e.value.body["type"] == "invalid_request_error"


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


REFUSED = [  # (body, param): each a 400 of OpenAI's shape on the real server
    (b'{"prompt": "x",', None),  # malformed JSON
    ({"prompt": 5}, "prompt"),  # wrong type
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),  # empty prompt
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 1000]}, "prompt"),  # the tiny vocabulary is 0..999
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),  # --max-context 512
    ({"prompt": [1] * 520}, "prompt"),  # the prompt alone fills the context
    ({"prompt": "x", "n": 0}, "n"),  # out of range
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[f"r{i}" for i in range(len(REFUSED))])
def test_refusals_are_400_in_openais_shape(server: CliServer, body: Any, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_the_openai_client_sees_the_refusal(server: CliServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_auth_body_limit_and_full_queue(strict_server: CliServer) -> None:
    s = strict_server
    # auth on: /health and /metrics open, the API needs the key (from PLAMO2_API_KEY)
    assert httpx.get(f"{s.url}/health").status_code == 200 and httpx.get(f"{s.url}/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert error_of(r, 401) and r.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").completions.create(model=s.model, prompt="x", max_tokens=2)
    ok = s.client(api_key=KEY).completions.create(model=s.model, prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2
    auth = {"Authorization": f"Bearer {KEY}"}

    # a body over --max-body-bytes: 413
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    error_of(httpx.post(f"{s.url}/v1/completions", json=big, headers=auth), 413)

    # one slot, no queue: while a stream holds it, the next request is 429 with Retry-After;
    # the stream's client leaves, its sequence is cancelled, and the slot serves again
    first = threading.Event()
    leave = threading.Event()

    def hold() -> None:
        body = {"prompt": [1, 5], "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, headers=auth, timeout=60) as r:
            for _ in r.iter_lines():
                first.set()
                if leave.wait(0):
                    break

    t = threading.Thread(target=hold)
    t.start()
    assert first.wait(60)
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth)
    err = error_of(r, 429)
    assert err["type"] == "rate_limit_error" and float(r.headers["retry-after"]) > 0
    leave.set()
    t.join(60)
    for _ in range(200):  # the server sees the disconnect within moments, not at once
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth, timeout=60)
        if ok.status_code != 429:
            break
        time.sleep(0.05)
    assert ok.status_code == 200, ok.text
    m = s.metrics()
    assert m['plamo2_sequences_finished_total{reason="cancelled"}'] >= 1
    assert m["plamo2_running_sequences"] == 0 and m["plamo2_admitted_sequences"] == 0


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|plamo:op|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|plamo:op|>assistant\n{% endif %}"
)


def test_chat_with_a_template_in_the_checkpoint(cli, checkpoint, oracle: Oracle, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint whose tokenizer_config.json carries a chat template serves /v1/chat/completions:
    the answer is the completion of the rendered conversation (tokenized without a second BOS).
    The template goes into the HF checkpoint before converting (a side file edited in a shard
    directory is refused: it is under the manifest's digests)."""
    import shutil

    root = tmp_path_factory.mktemp("chat")
    src = root / "ckpt"
    shutil.copytree(checkpoint("tiny", seed=5), src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    cli("convert", src, root / "shards", "--tp", 1, "--pp", 1, "--json")
    s = CliServer(root / "shards", "--max-batch", "4", "--max-context", "256")
    try:
        assert "chat on" in s.output
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
        r = s.client().chat.completions.create(model=s.model, messages=messages, max_tokens=16, temperature=0)
        rendered = "<|plamo:bos|><|plamo:op|>system\nBe brief.\n<|plamo:op|>user\nHello?\n<|plamo:op|>assistant\n"
        ids = list(oracle.tok(rendered, add_special_tokens=False)["input_ids"])
        assert r.choices[0].message.role == "assistant"
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == oracle.text(oracle.tokens(ids, 16))
        assert r.usage.prompt_tokens == len(ids)
        chunks = list(
            s.client().chat.completions.create(
                model=s.model, messages=messages, max_tokens=16, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    finally:
        assert s.stop() == 0, s.output


def test_logprobs_of_generated_and_echoed_tokens_are_the_runtimes(server: CliServer, oracle: Oracle) -> None:
    import torch

    ids = oracle.ids(PROMPTS[1])
    r = server.client().completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    gen = r.choices[0].model_extra["token_ids"]
    seq = ids + gen
    (logits,) = oracle.rt.prompt_logits([seq])
    lp = torch.log_softmax(logits.double(), dim=-1)
    got = r.choices[0].logprobs
    assert len(got.token_logprobs) == len(seq) and got.token_logprobs[0] is None  # echo: the prompt's too
    for p in range(1, len(seq)):
        assert got.token_logprobs[p] == pytest.approx(float(lp[p - 1, seq[p]]), abs=1e-4), p
        top = got.top_logprobs[p]
        assert 3 <= len(top) <= 4  # OpenAI: the top 3, and the chosen token always
        assert max(top.values()) == pytest.approx(float(lp[p - 1].max()), abs=1e-4)
    for p in range(len(ids), len(seq)):  # greedy: each generated token is its position's best
        assert got.token_logprobs[p] == max(got.top_logprobs[p].values())
    assert r.choices[0].text.startswith(oracle.decode(ids))  # echo puts the prompt's text first
