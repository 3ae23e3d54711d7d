"""`verify URL`: our own `plamo2-tools serve` (a real subprocess on loopback, the CLI a user runs)
as the deployment under test, and the servers it must also cope with (tests/deploy/odd_servers.py).

How each test was seen failing (break, red, restore):
* passes / bit for bit: `ServerTarget._score_one` reading the echo one position late
  (`steps.logprobs[j + 1]`) fails both; the server's logprobs rounded to 6 digits fails the
  bit-for-bit test alone.
* window convention: `Reference.logprobs` ignoring its options (every convention the same
  reference) fails it (both pass, nothing is "followed" alone, and the pinned run passes).
* no echo: `_echo_refusal` not recognising llama-server's message makes the run exit 2 instead of
  falling back.
* refusals: each line's words are asserted; `Http._call` without its timeout clause words the slow
  server as a failed connection and fails.
"""

from __future__ import annotations

import json
import socket

import pytest
from odd_servers import OddServer
from real_serve import CliServer

from plamo2_tools.deploy.server import ServerTarget
from plamo2_tools.model.synth import preset_config
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.verify import random_prompts

KEY = "sesame-verify"
SEED = 11


@pytest.fixture(scope="module")
def tiny(shards, checkpoint):
    """fp32 tiny shards served with an API key: (server, shards, reference checkpoint)."""
    path = shards("tiny", 1, 1, seed=SEED)
    server = CliServer(path, "--api-key", KEY)
    yield server, path, checkpoint("tiny", seed=SEED)
    server.stop()


@pytest.fixture(scope="module")
def tiny3_vllm(shards, checkpoint):
    """PLaMo 3 tiny (window 5) served under vLLM's window convention (W keys, not W + 1)."""
    path = shards("tiny3", 1, 1, seed=SEED)
    server = CliServer(path, "--option", "window_convention=vllm")
    yield server, path, checkpoint("tiny3", seed=SEED)
    server.stop()


@pytest.fixture(scope="module")
def odd(tiny):
    server = OddServer(tiny[0].url, KEY)
    url = server.start()
    yield url
    server.stop()


def _verify(cli, url, ref, *args, expect=0):
    return cli("verify", url, "--reference", ref, "--random", "2", "--max-new-tokens", "6", *args, expect=expect)


def test_our_server_passes(cli, tiny, monkeypatch) -> None:
    """Teacher-forced over echo + prompt logprobs and greedy with logprobs, token ids through
    vLLM's return_tokens_as_token_ids, the key from PLAMO2_API_KEY, fp32 thresholds."""
    server, _, ref = tiny
    monkeypatch.setenv("PLAMO2_API_KEY", KEY)
    result = json.loads(_verify(cli, server.url + "/v1", ref, "--target-precision", "float32", "--json").stdout)
    (t,) = result["targets"]
    assert result["passed"] and t["passed"], t["failures"]
    assert (t["kind"], t["mode"], t["kl_kind"], t["top_k"], t["precision"]) == (
        "server",
        "teacher-forced + greedy",
        "top-k",
        20,
        "float32",
    )
    assert t["tokenizer"]["checked"] and t["tokenizer"]["equal"]
    r = t["conventions"]["default"]
    assert r["teacher_forced"]["positions"] == sum(result["prompts"]["lengths"]) + 2 * 6 - 2
    assert r["greedy"]["match_tokens"] == [6, 6] and r["teacher_forced"]["max_kl"] < 1e-9
    assert t["info"]["unresolved_token_texts"] == 0  # every id came as "token_id:N"


def test_server_scoring_is_the_runtimes_bit_for_bit(tiny) -> None:
    """What the server returns for echo + logprobs equals `Runtime.token_scores` in this process on
    the same sequence (prompt + the one greedy token the server generated), float for float: the
    HTTP path adds nothing and loses nothing."""
    server, path, _ = tiny
    cfg = preset_config("tiny")
    seqs = random_prompts(3, cfg.vocab_size, seed=777, lengths=(6, 30))
    target = ServerTarget(server.url, cfg.vocab_size, api_key=KEY)
    got = target.score(seqs, 0)
    with Runtime(path, mode="local") as rt:
        for seq, sc in zip(seqs, got, strict=True):
            nxt = int(rt.prompt_logits([seq])[0][-1].argmax())
            (want,) = rt.token_scores([seq + [nxt]], [1], 20)
            n = len(seq) - 1
            assert sc.token_logprobs.tolist() == want.logprobs[:n].tolist()
            for j in range(n):
                ids, vals = want.top_ids[j].tolist(), want.top_logprobs[j].tolist()
                assert sc.top[j] == dict(zip(ids, vals, strict=True)), j


def test_the_other_window_convention_is_followed_and_pinning_fails_past_the_window(
    cli, one_line_error, tiny3_vllm
) -> None:
    """Unpinned: compared under both conventions, the server follows vllm (a property, not an
    error); under hf it first diverges at position W, the first query that sees W + 1 keys in PFN's
    code.  Pinned to hf: exit 1, one line naming that position."""
    server, _, ref = tiny3_vllm
    window = preset_config("tiny3").window_size
    result = json.loads(_verify(cli, server.url, ref, "--target-precision", "float32", "--json").stdout)
    (t,) = result["targets"]
    assert result["conventions"] == ["window_convention=hf", "window_convention=vllm"]
    assert t["passed"] and t["follows"] == ["window_convention=vllm"] and not t["indistinguishable"]
    hf = t["conventions"]["window_convention=hf"]
    assert not hf["passed"]
    assert (hf["first_divergence"]["prompt"], hf["first_divergence"]["position"]) == (0, window)
    pinned = _verify(
        cli, server.url, ref, "--target-precision", "float32", "--option", "window_convention=hf", "--json", expect=1
    )
    line = one_line_error(pinned, 1)  # --json: no progress bar on stderr, the verdict's line alone
    assert f"at prompt 0, position {window} (teacher-forced)" in line and server.url in line


def test_a_server_that_cannot_echo_is_checked_by_greedy_alone(cli, odd, tiny) -> None:
    """llama-server's refusal of echo: no teacher-forced scores, the greedy continuation with its
    top-K logprobs (ids from llama.cpp's `content` shape) judged along its own path; passes."""
    _, _, ref = tiny
    result = json.loads(_verify(cli, odd + "/llama", ref, "--target-precision", "float32", "--json").stdout)
    (t,) = result["targets"]
    assert t["passed"], t["failures"]
    assert t["mode"] == "greedy only" and t["info"]["prompt_logprobs"] is False
    assert "Only no echo is supported" in t["info"]["prompt_logprobs_detail"]
    r = t["conventions"]["default"]
    assert r["teacher_forced"] is None and r["greedy"]["match_tokens"] == [6, 6]
    assert r["greedy"]["max_kl"] < 1e-9


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_refusals_are_one_line_each(cli, one_line_error, tiny, odd) -> None:
    server, _, ref = tiny
    cases = [
        (f"http://127.0.0.1:{_closed_port()}", (), 3, "/v1/models: cannot reach the server (connection refused)"),
        (server.url, (), 2, "the server refused the request (HTTP 401"),
        (server.url, ("--api-key", "wrong"), 2, "pass its key with --api-key or PLAMO2_API_KEY"),
        (odd + "/garbage", (), 2, "/garbage/v1/models: the answer: not valid JSON"),
        (odd + "/deep", (), 2, "nested too deeply"),
        (odd + "/types", (), 2, "/types/v1/models: data is not an array"),
        (odd + "/slow", ("--timeout", "0.5"), 3, "/slow/v1/models: no answer within 0.5 s (--timeout)"),
        (server.url, ("--api-key", KEY, "--server-model", "other"), 2, "the server does not serve 'other'"),
    ]
    for url, args, code, words in cases:
        line = one_line_error(_verify(cli, url, ref, *args, expect=code), code)
        assert words in line, (url, line)


def test_base_urls_as_users_type_them() -> None:
    """The root of the server whatever the user pasted (lm-eval's base_url ends in /v1/completions)."""
    from plamo2_tools.deploy.server import root_url
    from plamo2_tools.errors import UserError

    for typed in (
        "http://h:8000",
        "http://h:8000/",
        "http://h:8000/v1",
        "http://h:8000/v1/",
        "http://h:8000/v1/completions",
    ):
        assert root_url(typed) == "http://h:8000", typed
    assert root_url("https://gw/team/v1") == "https://gw/team"
    for bad in ("http://", "http://h/v1?key=1"):
        with pytest.raises(UserError):
            root_url(bad)
