"""The API details of issue 32 on a real `plamo2-tools serve` (tiny synthetic PLaMo 2, its HTTP in a
process of its own), each with its status and body: what a new user, lm-eval or a hostile client
trips on.  Answers are compared with the in-process runtime (real_serve.Oracle), never with the
server itself.  Each test says how it was seen failing before its fix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from real_serve import CliServer, Oracle

PROMPT = "Hello world, the cat"


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=5)


@pytest.fixture(scope="module")
def oracle(shard_dir: Path) -> Iterator[Oracle]:
    o = Oracle(shard_dir)
    yield o
    o.close()


@pytest.fixture(scope="module")
def server(shard_dir: Path) -> Iterator[CliServer]:
    s = CliServer(shard_dir, "--max-batch", "8", "--max-queue", "8", "--max-context", "512")
    yield s
    assert s.stop() == 0, s.output


def post(server: CliServer, body: dict, timeout: float = 120) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def thread_server(shard_dir: Path) -> Iterator[CliServer]:
    """HTTP on a thread of the model's process (PLAMO2_SERVE_HTTP_PROCESS=0), where the gauges are the loop's own."""
    s = CliServer(shard_dir, "--max-batch", "2", "--max-context", "64", env={"PLAMO2_SERVE_HTTP_PROCESS": "0"})
    yield s
    assert s.stop() == 0, s.output


@pytest.mark.parametrize("design", ["process", "thread"])
def test_an_idle_server_reads_zero_in_its_queue_gauges(request: pytest.FixtureRequest, design: str) -> None:
    """The warm-up request was counted as waiting and the gauge was never published again while the loop
    slept: `plamo2_queue_length 1` on a fresh, idle server (seen on the thread design before the fix;
    the HTTP process starts from its own zeros, so only "thread" guards it)."""
    server = request.getfixturevalue("server" if design == "process" else "thread_server")
    m = server.metrics()
    assert (m["plamo2_queue_length"], m["plamo2_running_sequences"]) == (0, 0), m
    assert post(server, {"prompt": [1, 5, 6], "max_tokens": 3, "temperature": 0}).status_code == 200
    m = server.metrics()  # and again once a request has come and gone
    assert (m["plamo2_queue_length"], m["plamo2_running_sequences"]) == (0, 0), m


def test_a_million_prompts_are_counted_and_refused(server: CliServer) -> None:
    """400 naming the count (the server holds 16 sequences); tokenizing never starts
    (tests/serve/test_tokenizer_fairness.py checks that with a counting engine).  Before, the whole
    list was tokenized first: 23-62 s in which every text request waited."""
    r = post(server, {"prompt": ["a"] * 10**6, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "needs 1000000 sequences" in r.json()["error"]["message"]
    r = post(server, {"prompt": "x" * 2_000_000, "max_tokens": 1})  # far more characters than 512 tokens cover
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "characters" in err["message"]


def test_echo_offsets_skip_the_bos_and_stay_monotonic(server: CliServer, oracle: Oracle) -> None:
    """`text_offset` indexes the returned text: the BOS the tokenizer added is not in it (before: every
    prompt offset after it was shifted by len('<|plamo:bos|>') = 13, past the generated tokens' first)."""
    r = post(server, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True})
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    ids = oracle.ids(PROMPT)
    assert ids[0] == oracle.tok.bos_token_id and len(lp["tokens"]) == len(ids) + 4
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == offsets[1] == 0, offsets
    for token, at in zip(lp["tokens"][1 : len(ids)], offsets[1 : len(ids)], strict=True):  # ASCII: exact
        assert text[at : at + len(token)] == token
    assert offsets[len(ids)] == len(PROMPT)  # the first generated token starts where the prompt ends


def test_max_tokens_0_with_echo_scores_the_prompt_only(server: CliServer, oracle: Oracle) -> None:
    """vLLM's way to score a prompt; refused before (max_tokens >= 1), and still refused without echo."""
    r = post(server, {"prompt": PROMPT, "max_tokens": 0, "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    ids = oracle.ids(PROMPT)
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    got = choice["logprobs"]["token_logprobs"]
    (logits,) = oracle.rt.prompt_logits([ids])
    want = torch.log_softmax(logits.double(), dim=-1)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert got[p] == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-4), p
    r = post(server, {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_max_tokens_defaults_to_16(server: CliServer) -> None:
    """OpenAI's and vLLM's default for completions; before: the whole remaining context (497 here)."""
    r = post(server, {"prompt": PROMPT, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


UNDERFLOWING = [{"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}]


@pytest.mark.parametrize("settings", UNDERFLOWING)
def test_underflowing_temperature_or_top_p_is_greedy(server: CliServer, oracle: Oracle, settings: dict) -> None:  # type: ignore[type-arg]
    """A temperature below 1e-5 or a top_p that is 0 in float32 samples like temperature 0 (docs/serve.md);
    before, 1e-40 scaled every logit to +-inf and 1e-300 masked every token: token 0 over and over."""
    ids = oracle.ids(PROMPT)
    r = post(server, {"prompt": ids, "max_tokens": 12, "seed": 3, "return_token_ids": True, **settings})
    assert r.json()["choices"][0]["token_ids"] == oracle.tokens(ids, 12)


def test_chat_template_from_a_file(shard_dir: Path, oracle: Oracle, tmp_path: Path) -> None:
    """`--chat-template FILE` serves chat for a checkpoint without a template (vLLM's option); a file
    that is not a template is refused with one line before the model loads."""
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<|plamo:op|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|plamo:op|>assistant\n{% endif %}"
    )
    s = CliServer(shard_dir, "--max-batch", "2", "--max-context", "128", "--chat-template", str(template))
    try:
        assert "chat on" in s.output
        r = s.client().chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": "Hi?"}], max_tokens=8, temperature=0
        )
        ids = list(oracle.tok("<|plamo:op|>user\nHi?\n<|plamo:op|>assistant\n", add_special_tokens=False)["input_ids"])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == oracle.text(oracle.tokens(ids, 8))
    finally:
        assert s.stop() == 0, s.output
