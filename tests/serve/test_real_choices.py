"""Per-choice bookkeeping of /v1/completions (issue 34, class 1): with several prompts of different lengths and
n > 1 choices each, with echo, logprobs and vLLM's return_token_ids, streamed and not, every choice index
i = prompt * n + choice must carry its own prompt's echo, prompt token ids and prompt logprobs, and the tokens of
its own sampling stream.

Real `plamo2-tools serve` on loopback (the CLI as a user runs it, the official openai client), compared with the
in-process runtime running each (prompt, choice) alone (real_serve.Oracle: one `generate` call per sequence, the
choice's stream as its request key) and scoring prompt + answer alone (`prompt_logits`, log-softmax in float64),
never with the server itself.  Sampled (temperature 1, a seed) so that the choices of one prompt differ and a
swapped choice is seen, prompts of distinct lengths so that a swapped prompt is seen in every field.

Seen red on bench/mutants.py's `choice-*` mutants: the echo and the prompt ids taken by `i % n` instead of
`i // n`, the fan-out's loops swapped (choice-major order), every choice on stream 0, the streamed chunk's index
shifted, the prompt token ids sent once per request instead of once per choice, usage counting each prompt n times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from real_serve import CliServer, Oracle

TEXTS = ["Hi", "The cat sat on the mat and then it", "日本語のテキストです。"]
IDS = [[1, 17, 200], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 400, 401, 402, 403, 404, 405]]
SEED, MAX_TOKENS, TOP = 7, 8, 2


@pytest.fixture(scope="module")
def shard_dir(shards):  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=5)


@pytest.fixture(scope="module")
def oracle(shard_dir) -> Iterator[Oracle]:  # type: ignore[no-untyped-def]
    o = Oracle(shard_dir)
    yield o
    o.close()


@pytest.fixture(scope="module")
def server(shard_dir) -> Iterator[CliServer]:  # type: ignore[no-untyped-def]
    s = CliServer(shard_dir, "--max-batch", "8", "--max-context", "256", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0, s.output


def expected(oracle: Oracle, prompt: str | list[int], choice: int) -> dict[str, Any]:
    """What choice `choice` of `prompt` must hold, from the runtime alone."""
    ids = oracle.ids(prompt) if isinstance(prompt, str) else list(prompt)
    tokens = oracle.tokens(ids, MAX_TOKENS, temperature=1.0, seed=SEED, key=choice)
    text, finish = oracle.text(tokens)
    echo = prompt if isinstance(prompt, str) else oracle.decode(ids)
    seq = ids + tokens
    (logits,) = oracle.rt.prompt_logits([seq])
    lp = torch.log_softmax(logits.double(), dim=-1)
    logprobs = [None] + [float(lp[p - 1, seq[p]]) for p in range(1, len(seq))]
    return {
        "ids": ids,
        "tokens": tokens,
        "text": echo + text,
        "finish": finish,
        "echo": echo,
        "logprobs": logprobs,
        "best": [None] + [float(lp[p - 1].max()) for p in range(1, len(seq))],
    }


def merged_stream(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice index: the concatenation of its chunks' fields (and how many chunks named prompt ids)."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            m = out.setdefault(
                c.index,
                {
                    "text": "",
                    "tokens": [],
                    "token_ids": [],
                    "logprobs": [],
                    "offsets": [],
                    "top": [],
                    "prompt_ids": [],
                    "finish": None,
                },
            )
            m["text"] += c.text
            extra = c.model_extra or {}
            m["token_ids"] += extra.get("token_ids") or []
            if extra.get("prompt_token_ids") is not None:
                m["prompt_ids"].append(extra["prompt_token_ids"])
            if c.logprobs is not None:
                m["tokens"] += c.logprobs.tokens
                m["logprobs"] += c.logprobs.token_logprobs
                m["offsets"] += c.logprobs.text_offset
                m["top"] += c.logprobs.top_logprobs
            if c.finish_reason is not None:
                m["finish"] = c.finish_reason
    return out


def whole(r: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for c in r.choices:
        extra = c.model_extra or {}
        out[c.index] = {
            "text": c.text,
            "tokens": c.logprobs.tokens,
            "token_ids": extra["token_ids"],
            "logprobs": c.logprobs.token_logprobs,
            "offsets": c.logprobs.text_offset,
            "top": c.logprobs.top_logprobs,
            "prompt_ids": [extra["prompt_token_ids"]],
            "finish": c.finish_reason,
        }
    return out


def check_choices(got: dict[int, dict[str, Any]], prompts: list[Any], n: int, oracle: Oracle) -> None:
    assert sorted(got) == list(range(len(prompts) * n))
    for p, prompt in enumerate(prompts):
        for j in range(n):
            i, want, c = p * n + j, expected(oracle, prompt, j), got[p * n + j]
            where = f"choice {i} (prompt {p}, choice {j})"
            assert c["prompt_ids"] == [want["ids"]], where  # its own prompt's ids, once
            assert c["token_ids"] == want["tokens"], where  # its own stream's tokens
            assert c["text"] == want["text"], where  # its own prompt's echo, then its answer
            assert c["finish"] == want["finish"], where
            seq = want["ids"] + want["tokens"]
            assert len(c["tokens"]) == len(c["logprobs"]) == len(seq), where  # echo: the prompt's logprobs too
            assert c["logprobs"][0] is None and c["top"][0] is None, where
            assert c["logprobs"][1:] == pytest.approx(want["logprobs"][1:], abs=1e-4), where
            assert [max(t.values()) for t in c["top"][1:]] == pytest.approx(want["best"][1:], abs=1e-4), where
            assert all(2 <= len(t) <= 3 for t in c["top"][1:]), where
            # text offsets: the echo's from 0, the answer's after the echoed text
            assert c["offsets"][0] == 0, where
            assert c["offsets"][len(want["ids"])] == len(want["echo"]), where
    # the choices of one prompt really differ (a swapped stream would be seen) and so do the prompts
    for p in range(len(prompts)):
        assert len({tuple(got[p * n + j]["token_ids"]) for j in range(n)}) == n, f"prompt {p}'s choices coincide"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("prompts", "n"), [(TEXTS, 2), (IDS, 3)], ids=["texts-n2", "ids-n3"])
def test_each_choice_carries_its_own_prompt_and_stream(
    server: CliServer, oracle: Oracle, prompts: list[Any], n: int, stream: bool
) -> None:
    lengths = [len(oracle.ids(p)) if isinstance(p, str) else len(p) for p in prompts]
    assert len(set(lengths)) == len(lengths), lengths  # distinct: a prompt swap changes every length
    r = server.client().completions.create(
        model="tiny",
        prompt=prompts,
        n=n,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=SEED,
        echo=True,
        logprobs=TOP,
        stream=stream,
        extra_body={"return_token_ids": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    chunks = list(r) if stream else [r]
    got = merged_stream(chunks) if stream else whole(r)
    check_choices(got, prompts, n, oracle)
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == sum(lengths)  # each prompt once, however many choices it has
    assert usage.completion_tokens == sum(len(c["token_ids"]) for c in got.values())
