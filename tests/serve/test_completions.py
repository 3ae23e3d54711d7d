"""/v1/completions through the official openai client and raw httpx, on a real uvicorn server.

Tests marked by the `fake_only` fixture compare with the fake engine's exact outputs; the others
check relations that any engine must keep (streamed == not streamed, stop strings cut exactly,
seeds reproduce), so they stay valid once the runtime's engine is plugged in.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serve_fake_engine import BOS, EOS, VOCAB_SIZE, encode, greedy_text, logprob_of
from serve_harness import Server

MODEL = "fake-plamo"


def complete(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Server, **body: Any) -> tuple[dict[int, str], dict[int, str | None], list[dict[str, Any]]]:
    """Texts and finish reasons per choice index, concatenated from the SSE chunks; all chunks."""
    chunks: list[dict[str, Any]] = []
    body = {"model": MODEL, "temperature": 0, **body, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    import json

    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == MODEL
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                assert ch["index"] not in finish, "one finish_reason per choice"
                finish[ch["index"]] = ch["finish_reason"]
    return texts, finish, chunks


def test_text_prompt_with_the_openai_client(server: Server, fake_only: None) -> None:
    r = server.client().completions.create(model=MODEL, prompt="hello abc", max_tokens=12, temperature=0)
    prompt = encode("hello abc")
    assert r.choices[0].text == greedy_text(prompt, 12) == "hello abchello abchello "
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt),
        12,
        len(prompt) + 12,
    )


@pytest.mark.parametrize(
    "prompt",
    [["abc", "hello", "xy"], [BOS, 70, 71], [[BOS, 70, 71], [80], [BOS, 90, 91, 92]]],
    ids=["texts", "token-ids", "lists-of-token-ids"],
)
def test_batches_and_token_ids(server: Server, fake_only: None, prompt: Any) -> None:
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, n=2)
    prompts = [prompt] if isinstance(prompt[0], int) else prompt
    ids = [encode(p) if isinstance(p, str) else p for p in prompts]
    assert [c.index for c in r.choices] == list(range(2 * len(ids)))
    assert [c.text for c in r.choices] == [greedy_text(p, 7) for p in ids for _ in range(2)]
    assert r.usage.prompt_tokens == sum(map(len, ids))  # each prompt once, whatever n
    assert r.usage.completion_tokens == 7 * 2 * len(ids)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hello world the end", "max_tokens": 30},
        {"prompt": ["abc", "hello"], "max_tokens": 9, "n": 3},
        {"prompt": [[BOS, 70, 71, 72], [BOS, 80, 81]], "max_tokens": 11},
        {"prompt": "hello world", "max_tokens": 40, "stop": ["o w", "ld h"]},
        {"prompt": "hello world", "max_tokens": 20, "logprobs": 2, "echo": True},
        {"prompt": "abc", "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2},
    ],
    ids=["text", "batch-n3", "token-ids", "stop", "echo-logprobs", "seeded"],
)
def test_streamed_chunks_concatenate_to_the_non_streamed_text(server: Server, body: dict[str, Any]) -> None:
    whole = complete(server, **body)
    texts, finish, chunks = stream(server, **body, stream_options={"include_usage": True})
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    if body.get("logprobs") is not None:
        tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        assert tokens == whole["choices"][0]["logprobs"]["tokens"]


def test_the_openai_client_reads_the_stream(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="hello abc", max_tokens=15, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="hello abc", max_tokens=15, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


@pytest.mark.parametrize("chunk", [1, 3], ids=["token-events", "3-token-events"])
def test_stop_strings_cut_exactly(serve: Any, chunk: int) -> None:
    """Any stop string taken from the free-running text: the text ends right before its first
    occurrence, finish_reason is stop, and the stop string is reported."""
    server = serve(chunk=chunk)
    base = complete(server, prompt="hello world, the end", max_tokens=40)["choices"][0]["text"]
    assert len(base) > 20
    for start, length in [(0, 1), (3, 4), (5, 3), (9, 6), (len(base) - 3, 3), (14, 1)]:
        stop = base[start : start + length]
        for body in ({"stop": stop}, {"stop": [stop, "\x00never"]}):
            got = complete(server, prompt="hello world, the end", max_tokens=40, **body)["choices"][0]
            assert got["text"] == base[: base.find(stop)], stop
            assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
            texts, finish, _ = stream(server, prompt="hello world, the end", max_tokens=40, **body)
            assert texts[0] == got["text"] and finish[0] == "stop"


def test_the_earliest_of_several_stop_strings_wins(server: Server) -> None:
    base = complete(server, prompt="hello world, the end", max_tokens=40)["choices"][0]["text"]
    a, b = base[10:13], base[4:6]
    got = complete(server, prompt="hello world, the end", max_tokens=40, stop=[a, b])["choices"][0]
    assert got["text"] == base[: min(base.find(a), base.find(b))]


def test_eos_ends_with_stop_and_shows_no_text(server: Server, fake_only: None) -> None:
    got = complete(server, prompt="ab<eos>", max_tokens=10)
    c = got["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("ab", "stop", EOS)
    assert got["usage"]["completion_tokens"] == 3  # the EOS token counts


def test_max_tokens_defaults_to_16_within_the_room_left(server: Server) -> None:
    """OpenAI's and vLLM's default for completions (README); before, no max_tokens meant the whole
    remaining context (a first curl on a real model seemed to hang): seen failing with 253 tokens."""
    info = server.engine.info
    got = complete(server, prompt=[[BOS, 70, 71]], ignore_eos=True)
    assert (got["usage"]["completion_tokens"], got["choices"][0]["finish_reason"]) == (16, "length")
    near = [BOS] + [70] * (info.max_context - 6)  # 5 tokens of room: the default shrinks to fit
    got = complete(server, prompt=[near], ignore_eos=True)
    assert (got["usage"]["completion_tokens"], got["choices"][0]["finish_reason"]) == (5, "length")


def test_seeded_sampling_is_reproducible_and_choices_differ(server: Server) -> None:
    body = {"prompt": "hello world abc", "max_tokens": 24, "temperature": 1.0, "seed": 1234, "n": 3}
    first, again = complete(server, **body), complete(server, **body)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1, "n choices under one seed must be distinct samples"
    other = [c["text"] for c in complete(server, **{**body, "seed": 99})["choices"]]
    assert other != texts


def test_the_app_passes_sampling_settings_through(server: Server, fake_only: None) -> None:
    before = len(server.engine.submitted)
    complete(
        server, prompt=["ab", "cd"], max_tokens=5, temperature=0.7, top_p=0.9, seed=-42, n=2, stop=["zz"], logprobs=3
    )
    sent = server.engine.submitted[before:]
    assert sorted((r.prompt_token_ids, r.stream) for r in sent) == sorted(
        (tuple(encode(p)), j) for p in ("ab", "cd") for j in range(2)
    )
    for r in sent:
        assert (r.temperature, r.top_p, r.seed, r.stop, r.logprobs, r.prompt_logprobs, r.max_tokens) == (
            0.7,
            0.9,
            -42,
            ("zz",),
            3,
            None,
            5,
        )
    assert len({r.request_id for r in sent}) == 4


def test_generated_logprobs(server: Server, fake_only: None) -> None:
    c = complete(server, prompt="abc", max_tokens=5, logprobs=2)["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == list("abcab") and len(lp["token_logprobs"]) == 5
    assert all(v == pytest.approx(logprob_of(0, 0)) for v in lp["token_logprobs"])
    assert all(
        len(top) == 2 and max(top.values()) == v
        for top, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )
    assert lp["text_offset"] == [0, 1, 2, 3, 4]


def test_echo_with_logprobs_is_what_lm_eval_scores(server: Server, fake_only: None) -> None:
    """lm-eval's local-completions loglikelihood request, parsed by lm-eval's own parser."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    seqs = [[70, 71, 70, 70, 72], [80, 80, 80], [90, 91]]
    ctxlens = [2, 1, 1]
    out = complete(server, prompt=seqs, max_tokens=1, logprobs=1, echo=True, seed=1234)
    for seq, choice in zip(seqs, out["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(seq) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    parsed = LocalCompletionsAPI.parse_logprobs(outputs=out, tokens=seqs, ctxlens=ctxlens)
    for seq, ctxlen, (logprob, greedy) in zip(seqs, ctxlens, parsed, strict=True):
        guess = [t for t in seq if t != BOS][0]  # the fake predicts a prefix's first token
        want = sum(logprob_of(seq[p], guess) for p in range(ctxlen, len(seq)))
        assert logprob == pytest.approx(want)
        assert greedy == all(seq[p] == guess for p in range(ctxlen, len(seq)))


def test_echo_without_logprobs_prepends_the_prompt(server: Server) -> None:
    c = complete(server, prompt="hello", max_tokens=3, echo=True)["choices"][0]
    plain = complete(server, prompt="hello", max_tokens=3)["choices"][0]
    assert c["text"] == "hello" + plain["text"] and c["logprobs"] is None


def test_model_name_is_optional_and_aliases_work(serve: Any) -> None:
    from plamo2_tools.serve.app import ServerConfig

    server = serve(ServerConfig(served_model_names=("plamo-2-translate",)))
    for model in (None, MODEL, "plamo-2-translate"):
        body = {"prompt": "ab", "max_tokens": 2} | ({"model": model} if model else {})
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == (model or MODEL)
    ids = [m.id for m in server.client().models.list().data]
    assert ids == [MODEL, "plamo-2-translate"]


def test_tokenize_detokenize_and_tokenizer_info(server: Server, fake_only: None) -> None:
    http = server.http()
    r = http.post("/tokenize", json={"prompt": "hello é"}).json()
    assert r == {
        "count": 4,
        "max_model_len": server.engine.info.max_context,
        "tokens": encode("hello é"),
        "token_strs": None,
    }
    r = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == encode("hello", False) and r["token_strs"] == ["hello"]
    assert http.post("/detokenize", json={"tokens": encode("hello é")}).json() == {"prompt": "<bos>hello é"}
    assert http.post("/detokenize", json={"tokens": [VOCAB_SIZE]}).status_code == 400
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>" and info["model_max_length"] == 256
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").status_code == 200
