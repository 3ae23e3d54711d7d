"""The online loop (runtime/batching/online.py): requests arriving mid-run, per-request sampling,
stop strings and prompt logprobs, cancellation, and the same answers on thread ranks and torchrun
(gloo) ranks.  The oracle is `Runtime.generate` of each request alone: a request's tokens must not
depend on what shares the batch or when it arrived."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from online_script import request_of, scripted_session

from plamo2_tools.errors import UserError
from plamo2_tools.generation_request import GenerationRequest
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.online import OnlineLoop
from plamo2_tools.runtime.batching.text import StopStringWatcher, decode_kept_specials
from plamo2_tools.runtime.process.jobs import run_job
from plamo2_tools.runtime.rank.comm import LocalWorld

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def short_rank_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that waits for a collective the others never reach fails in 60 s, not 10 minutes."""
    monkeypatch.setattr(LocalWorld, "TIMEOUT", 60.0)


def ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def mixed_script(vocab: int) -> list[dict]:
    """Greedy and sampled requests (two streams of one seed, a nucleus, a hot temperature), four of
    them arriving mid-run at fixed points of the loop and one from a timer thread."""
    return [
        {"id": "a", "prompt": ids(vocab, 5, 1), "max_tokens": 12, "temperature": 0.0},
        {"id": "b", "prompt": ids(vocab, 30, 2), "max_tokens": 6, "temperature": 0.9, "top_p": 0.8, "seed": 3},
        {
            "id": "c",
            "prompt": ids(vocab, 9, 3),
            "max_tokens": 15,
            "temperature": 0.7,
            "seed": 3,
            "stream": 1,
            "after": ["a", 3],
        },
        {"id": "d", "prompt": ids(vocab, 17, 4), "max_tokens": 4, "temperature": 0.0, "after": ["b", 2]},
        {"id": "e", "prompt": ids(vocab, 1, 5), "max_tokens": 9, "temperature": 1.3, "seed": 5, "after": ["c", 1]},
        {"id": "f", "prompt": ids(vocab, 45, 6), "max_tokens": 10, "temperature": 0.0, "sleep": 0.05},
        {
            "id": "g",
            "prompt": ids(vocab, 13, 7),
            "max_tokens": 7,
            "temperature": 0.8,
            "top_p": 0.95,
            "seed": 9,
            "after": ["d", 4],
        },
    ]


def alone(rt: Runtime, step: dict) -> list[int]:
    """The request by itself, through Runtime.generate (one sequence, nothing else in the batch)."""
    r = request_of(step)
    return rt.generate(
        [list(r.prompt_token_ids)],
        r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=r.seed or 0,
        request_keys=[r.stream],
    ).tokens[0]


@pytest.fixture(scope="module")
def expected(shards) -> dict[str, list[int]]:
    with Runtime(shards("tiny-gqa", 1, 1, seed=11), backend="torch") as rt:
        script = mixed_script(rt.config.vocab_size)
        want = {s["id"]: alone(rt, s) for s in script}
    assert len({tuple(t) for t in want.values()}) == len(want)
    return want


@pytest.mark.parametrize(("tp", "pp", "max_batch"), [(1, 1, 2), (1, 1, 8), (2, 2, 3)])
def test_arrivals_mid_run_and_mixed_sampling_equal_each_request_alone(shards, expected, tp, pp, max_batch) -> None:
    with Runtime(shards("tiny-gqa", tp, pp, seed=11), backend="torch") as rt:
        out = scripted_session(rt, mixed_script(rt.config.vocab_size), max_batch=max_batch, max_context=64)
    assert out is not None
    stats = out.pop("_stats")
    assert {k: v["tokens"] for k, v in out.items()} == expected
    assert all(v["reason"] == "length" and v["error"] is None for v in out.values())
    assert stats["groups"] >= 3  # requests really were admitted while others ran


def test_torchrun_gloo_ranks_agree_with_thread_ranks(shards, expected) -> None:
    path = shards("tiny-gqa", 2, 2, seed=11)
    runtime = {"shards": str(path), "backend": "torch"}
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    args = {"script": mixed_script(515), "max_batch": 3, "max_context": 64}
    out = run_job(scripted_session, runtime, args, launch=True, extra_env=env)
    out.pop("_stats")
    assert {k: v["tokens"] for k, v in out.items()} == expected


def test_cancel_frees_the_slot_at_once_and_spares_the_others(shards) -> None:
    with Runtime(shards("tiny-gqa", 1, 1, seed=11), backend="torch") as rt:
        V = rt.config.vocab_size
        a = {"id": "a", "prompt": ids(V, 7, 11), "max_tokens": 40, "temperature": 0.0}
        b = {"id": "b", "prompt": ids(V, 12, 12), "max_tokens": 6, "temperature": 0.0}
        c = {"id": "c", "prompt": ids(V, 20, 13), "max_tokens": 20, "temperature": 0.8, "seed": 1}
        want = {s["id"]: alone(rt, s) for s in (a, b, c)}
        # One slot: b can only run once a's slot is given back.
        one = scripted_session(rt, [a, b, {"cancel": "a", "after": ["a", 3]}], max_batch=1, max_context=64)
        # Two slots: c decodes beside a while a is cancelled, then b takes a's slot.
        two = scripted_session(rt, [a, c, b, {"cancel": "a", "after": ["a", 2]}], max_batch=2, max_context=64)
    for out in (one, two):
        assert out is not None
        stats = out.pop("_stats")
        got = out["a"]["tokens"]
        assert out["a"]["reason"] == "cancelled" and 2 <= len(got) < 40 and got == want["a"][: len(got)]
        assert out["b"]["tokens"] == want["b"] and out["b"]["reason"] == "length"
        assert stats["decode_steps"] < 40  # b did not wait for a's 40 tokens
    assert two["c"]["tokens"] == want["c"]


def test_stop_strings_and_prompt_logprobs_per_request(shards) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        decode = decode_kept_specials(rt.tokenizer)
        prompt = rt.tokenizer("Question: how many apples?\nAnswer:")["input_ids"]
        free = rt.generate([prompt], 30).tokens[0]
        text = decode(free)
        stop = text[6:9]
        assert stop and stop in text
        want = rt.generate([prompt], 30, stop=StopStringWatcher(decode, [stop])).tokens[0]
        scores = rt.token_scores([prompt], [1], 3)[0]
        ref_logits = rt.prompt_logits([prompt])[0]
        with OnlineLoop(rt, max_batch=4, max_context=64, eos_token_ids=[]) as loop:
            plain = loop.submit(GenerationRequest("plain", tuple(prompt), 30, temperature=0.0))
            cut = loop.submit(GenerationRequest("cut", tuple(prompt), 30, temperature=0.0, stop=(stop, "never there")))
            echo = loop.submit(GenerationRequest("echo", tuple(prompt), 1, temperature=0.0, prompt_logprobs=3))
            events = list(echo)
            cut.result(60), plain.result(60)
            during = loop.token_scores([prompt], [1], 3)[0]  # the score path while the loop runs
    assert plain.tokens == free and plain.final.finish_reason == "length"
    assert cut.tokens == want and len(want) < 30
    assert cut.final.finish_reason == "stop" and cut.final.stop_reason == stop
    lp = events[0].prompt_logprobs
    assert lp is not None and events[0].token_ids == () and len(lp.logprobs) == len(prompt) - 1
    # Against the log-softmax of the prompt's logits, computed here from prompt_logits.
    ref = ref_logits[:-1].double().log_softmax(-1)
    want_lp = ref.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.logprobs, dtype=torch.float64), want_lp, atol=1e-5)
    top = ref.topk(3, dim=-1)
    assert [[i for i, _ in t] for t in lp.top] == top.indices.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in t] for t in lp.top], dtype=torch.float64), top.values, atol=1e-5)
    greedy = [p == t[0][0] for p, t in zip(prompt[1:], lp.top, strict=True)]
    assert [x == t[0][1] for x, t in zip(lp.logprobs, lp.top, strict=True)] == greedy  # lm-eval's greedy test
    assert echo.tokens == free[:1] and echo.final.finish_reason == "length"
    assert torch.equal(during.logprobs, scores.logprobs) and torch.equal(during.top_ids, scores.top_ids)


def test_submit_refuses_what_cannot_run_and_reports_load(shards) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        loop = OnlineLoop(rt, max_batch=1, max_context=32, eos_token_ids=[])
        with pytest.raises(UserError):
            loop.submit(GenerationRequest("early", (5, 6), 3))  # not started
        with loop:
            with pytest.raises(UserError, match="context"):
                loop.submit(GenerationRequest("long", tuple(range(3, 30)), 10))
            first = loop.submit(GenerationRequest("x", (5, 6, 7), 20, temperature=0.0))
            with pytest.raises(UserError, match="already"):
                loop.submit(GenerationRequest("x", (5, 6, 7), 2))
            second = loop.submit(GenerationRequest("y", (8, 9), 3, temperature=0.0))
            stats = loop.stats()
            assert stats.waiting + stats.running <= 2
            with pytest.raises(UserError, match="online loop"):
                rt.generate([[5, 6]], 2)
            first.result(60), second.result(60)
            loop.cancel("x")  # finished: a no-op
            loop.cancel("nobody")
        assert rt.online is None
        assert rt.generate([[5, 6, 7]], 20).tokens[0] == first.tokens  # the runtime works again after
