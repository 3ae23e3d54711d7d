"""Event -> response assembly, without a server: echo offsets, logprob dicts, non-finite values."""

from __future__ import annotations

import json

from plamo2_tools.serve.engine_api import Candidate, TokenEvent, TokenLogprob
from plamo2_tools.serve.protocol import Completion, CompletionChoice
from plamo2_tools.serve.responses import LOGPROB_FLOOR, CompletionChoiceState, chat_logprobs, legacy_logprobs


def tl(token: str, logprob: float | None, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(0, token, logprob, tuple(Candidate(0, t, lp) for t, lp in top))


def test_echo_then_generated_offsets_and_the_chosen_token_in_top() -> None:
    state = CompletionChoiceState(0, echo_text="ab", want_logprobs=True)
    first = TokenEvent((1,), "x", (tl("x", -2.0, ("y", -0.5)),), (tl("a", None), tl("b", -1.0, ("b", -1.0))))
    text, lp = state.delta(first)
    assert text == "abx" and lp is not None
    assert lp.tokens == ["a", "b", "x"] and lp.token_logprobs == [None, -1.0, -2.0]
    assert lp.top_logprobs == [None, {"b": -1.0}, {"y": -0.5, "x": -2.0}]
    assert lp.text_offset == [0, 1, 2]
    text, lp = state.delta(TokenEvent((2,), "zz", (tl("zz", -0.1),), finish_reason="length"))
    assert text == "zz" and lp is not None and lp.text_offset == [3] and state.finish_reason == "length"


def test_non_finite_logprobs_become_json_numbers() -> None:
    lp, _ = legacy_logprobs([tl("q", float("-inf"), ("q", float("-inf")), ("r", float("nan")))], 0)
    assert lp.token_logprobs == [LOGPROB_FLOOR] and lp.top_logprobs == [{"q": LOGPROB_FLOOR, "r": LOGPROB_FLOOR}]
    body = Completion(id="c", created=0, model="m", choices=[CompletionChoice(index=0, text="", logprobs=lp)])
    json.loads(body.model_dump_json())  # strict JSON: no Infinity / NaN
    chat = chat_logprobs([tl("q", float("-inf"), ("r", float("-inf")))])
    assert chat.content is not None and chat.content[0].logprob == LOGPROB_FLOOR
