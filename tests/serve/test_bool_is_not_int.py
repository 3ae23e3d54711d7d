"""JSON's `true` is not the number 1, and 1 is not `true` (issue 34, class 4: Python's `bool` is an `int`, so a
check written `isinstance(v, int)` lets `true` through as a count, a token id or a max_tokens).  Every integer
field of every request the server and batch files take is refused as 400 naming the field when it holds a
boolean, every boolean field when it holds 0 or 1; a token id `true` likewise.  Real server on loopback (the
fake engine: only the refusal is under test); batch lines through `serve.batch.parse_line`, the code the
`generate --input` command runs.

Seen red by turning the models' strict mode off (bench/mutants.py `valid-serve-not-strict`) and dropping the
bool check of token-id prompts (`valid-serve-token-bool`).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serve_harness import Server

from plamo2_tools.serve.batch import Defaults, parse_line

# (endpoint, a valid body, field, a value of the wrong kind)
INTS = [
    ("/v1/completions", {"prompt": "x"}, "max_tokens", True),
    ("/v1/completions", {"prompt": "x"}, "n", True),
    ("/v1/completions", {"prompt": "x"}, "logprobs", True),
    ("/v1/completions", {"prompt": "x"}, "seed", True),
    ("/v1/completions", {"prompt": "x"}, "seed", False),
    ("/v1/completions", {"prompt": "x"}, "temperature", True),
    ("/v1/completions", {"prompt": "x"}, "top_p", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "max_completion_tokens", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "top_logprobs", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "n", True),
]
BOOLS = [
    ("/v1/completions", {"prompt": "x"}, "echo", 1),
    ("/v1/completions", {"prompt": "x"}, "stream", 0),
    ("/v1/completions", {"prompt": "x"}, "ignore_eos", 1),
    ("/v1/completions", {"prompt": "x"}, "return_token_ids", 1),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "logprobs", 1),
    ("/tokenize", {"prompt": "x"}, "add_special_tokens", 1),
]
CASES = INTS + BOOLS


@pytest.mark.parametrize(
    ("endpoint", "body", "field", "value"), CASES, ids=[f"{e.rsplit('/', 1)[1]}-{f}={v}" for e, _, f, v in CASES]
)
def test_a_value_of_the_other_kind_is_400_naming_the_field(
    server: Server, endpoint: str, body: dict[str, Any], field: str, value: Any
) -> None:
    r = httpx.post(f"{server.url}{endpoint}", json={**body, field: value})
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/v1/completions", {"prompt": [[5], [6, False]]}, "prompt"),
        ("/detokenize", {"tokens": [5, True]}, "tokens"),
    ],
)
def test_a_boolean_is_no_token_id(server: Server, endpoint: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{endpoint}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_same_bodies_with_numbers_pass(server: Server) -> None:
    """The refusals above are about the kind, not the field: the right kind is served."""
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": [5, 6], "max_tokens": 1, "n": 1, "logprobs": 1, "seed": 1, "echo": False, "temperature": 1},
    )
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [5, 6]}).status_code == 200


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": "x", "max_tokens": true}',
        '{"prompt": "x", "n": true}',
        '{"prompt": [1, true]}',
        '{"prompt": "x", "logprobs": true}',
        '{"prompt": "x", "seed": true}',
        '{"prompt": "x", "echo": 1}',
    ],
)
def test_batch_lines_refuse_the_other_kind(line: str) -> None:
    parsed = parse_line(line, 0, Defaults())
    assert parsed.error is not None and parsed.request is None, (line, parsed)


def test_batch_lines_with_numbers_parse() -> None:
    parsed = parse_line('{"prompt": [1, 2], "max_tokens": 3, "n": 2, "seed": 4}', 0, Defaults())
    assert parsed.error is None and parsed.request is not None
    assert (parsed.request.max_tokens, parsed.request.n, parsed.request.seed) == (3, 2, 4)
