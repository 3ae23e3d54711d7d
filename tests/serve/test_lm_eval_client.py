"""lm-eval 0.4.13's own `local-completions` model against the server: remote tokenizer
(/tokenizer_info, /tokenize), loglikelihood (echo + logprobs) and generate_until (stop strings),
as a user's `lm_eval --model local-completions --model_args base_url=.../v1/completions` runs it."""

from __future__ import annotations

import pytest
from serve_fake_engine import encode, greedy_text, logprob_of
from serve_harness import Server


@pytest.fixture
def lm(server: Server):  # type: ignore[no-untyped-def]
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model="fake-plamo",
        tokenizer_backend="auto",
        max_length=200,
        max_retries=1,
        timeout=30,
    )


def test_lm_eval_detects_the_remote_tokenizer(lm) -> None:  # type: ignore[no-untyped-def]
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode("hello abc") == encode("hello abc", add_special_tokens=False)


def test_loglikelihood(lm, fake_only: None) -> None:  # type: ignore[no-untyped-def]
    from lm_eval.api.instance import Instance

    pairs = [("hello", " world"), ("abc", "aaa"), ("xy", "x")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (logprob, greedy) in zip(pairs, got, strict=True):
        c, k = encode(ctx, False), encode(cont, False)
        seq = c + k
        guess = seq[0]  # the fake predicts the prefix's first token
        assert logprob == pytest.approx(sum(logprob_of(t, guess) for t in k))
        assert greedy == all(t == guess for t in k)


def test_generate_until(lm, fake_only: None) -> None:  # type: ignore[no-untyped-def]
    from lm_eval.api.instance import Instance

    reqs = [
        Instance("generate_until", {}, ("hello world", {"until": ["ld"], "max_gen_toks": 20}), 0),
        Instance("generate_until", {}, ("abc", {"until": ["\n\n"], "max_gen_toks": 7}), 1),
    ]
    got = lm.generate_until(reqs, disable_tqdm=True)
    full = greedy_text(encode("hello world", False), 20)
    assert got == [full[: full.find("ld")], greedy_text(encode("abc", False), 7)]
