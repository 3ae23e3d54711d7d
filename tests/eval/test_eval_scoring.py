"""loglikelihood / loglikelihood_rolling of the plamo2 lm-eval model against direct forward passes
(log_softmax of `Runtime.prompt_logits`), with the checkpoint's own tokenizer doing the encoding."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

BOS = 1


def ll(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


def rolling(text: str) -> Instance:
    return Instance("loglikelihood_rolling", {}, (text,), 0)


def direct(runtime, ids: list[int], start: int) -> tuple[float, bool]:
    """Sum of log p(ids[p] | ids[:p]) for p >= start, and whether each ids[p] is the argmax."""
    logp = runtime.prompt_logits([ids])[0].log_softmax(-1)
    rows = logp[start - 1 : len(ids) - 1]
    target = torch.tensor(ids[start:])
    total = rows.gather(-1, target[:, None]).double().sum().item()
    return total, bool((rows.argmax(-1) == target).all())


def test_loglikelihood_equals_direct_forward(make_lm, runtime) -> None:
    lm = make_lm(batch_size=3)
    tok = lm.tokenizer
    cases = [
        ("Question: what is 2+2?\nAnswer:", " 4"),
        ("Numbers: 1, 2, 3,", " 4, 5, 6"),
        ("The context ends in spaces  ", "and moves them"),  # TemplateLM moves them to the continuation
        ("", "An empty context is conditioned on BOS"),
        ("x", "y"),
    ]
    got = lm.loglikelihood([ll(c, x) for c, x in cases])
    for (context, continuation), (logprob, greedy) in zip(cases, got, strict=True):
        if context:
            n = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - n], context[len(context) - n :] + continuation
            ids = tok(context + continuation).input_ids
            start = len(tok(context).input_ids)
        else:
            ids = [BOS] + tok(continuation, add_special_tokens=False).input_ids
            start = 1
        assert ids[0] == BOS and ids[1] != BOS  # BOS from the tokenizer config, exactly once
        want_logprob, want_greedy = direct(runtime, ids, start)
        assert logprob == pytest.approx(want_logprob, rel=1e-6, abs=1e-5)
        assert greedy == want_greedy


def test_is_greedy_on_the_model_s_own_continuation(make_lm, runtime) -> None:
    lm = make_lm()
    context = lm.tok_encode("Question: how many?\nAnswer:")
    greedy = runtime.generate([context], 5).tokens[0]
    other = greedy[:-1] + [(greedy[-1] + 1) % runtime.config.vocab_size]
    (lp_greedy, is_greedy), (lp_other, is_other) = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, other)]
    )
    assert is_greedy and not is_other
    assert lp_greedy > lp_other
    assert lp_greedy == pytest.approx(direct(runtime, context + greedy, len(context))[0], rel=1e-6, abs=1e-5)


def test_rolling_equals_full_sequence_sum(make_lm, runtime) -> None:
    lm = make_lm()
    texts = ["The quick brown fox jumps over the lazy dog. " * 2, "short", ""]
    got = lm.loglikelihood_rolling([rolling(t) for t in texts])
    for text, total in zip(texts[:2], got, strict=False):
        ids = [BOS] + lm.tokenizer(text, add_special_tokens=False).input_ids  # BOS once, as the prefix
        assert total == pytest.approx(direct(runtime, ids, 1)[0], rel=1e-6, abs=1e-5)
    assert got[2] == 0.0


def test_rolling_windows_when_longer_than_max_length(make_lm, runtime) -> None:
    """Beyond max_length the text is scored in lm-eval's disjoint windows; every token once."""
    lm = make_lm(max_length=24, max_gen_toks=4, batch_size=2)
    text = "Rolling windows cover every token exactly once, whatever the length. " * 2
    tokens = lm.tokenizer(text, add_special_tokens=False).input_ids
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, BOS, 23, 1)]
    assert len(windows) > 3 and sum(len(c) for _, c in windows) == len(tokens)
    want = sum(direct(runtime, ctx + cont, len(ctx))[0] for ctx, cont in windows)
    assert all(len(ctx + cont) <= 24 for ctx, cont in windows)
    assert lm.loglikelihood_rolling([rolling(text)])[0] == pytest.approx(want, rel=1e-6, abs=1e-5)


def test_loglikelihood_batch_size_invariance(make_lm) -> None:
    """Ragged requests: batch 4 (sorted, packed, restored) gives batch 1's answers in input order."""
    requests = [ll("Q" * n, " answer " * (1 + n % 3)) for n in (3, 40, 11, 70, 1, 25, 52)]
    one = make_lm(batch_size=1).loglikelihood(requests)
    four = make_lm(batch_size=4).loglikelihood(requests)
    assert [g for _, g in one] == [g for _, g in four]
    assert [lp for lp, _ in four] == pytest.approx([lp for lp, _ in one], rel=1e-6, abs=1e-5)
    assert len({round(lp, 3) for lp, _ in one}) == len(requests)  # distinct, so order is really checked


def test_bos_is_never_added_twice(make_lm) -> None:
    lm = make_lm()
    assert lm.tok_encode("Question") == [BOS] + lm.tokenizer("Question", add_special_tokens=False).input_ids
    assert lm.tok_encode("<|plamo:bos|>Question") == lm.tok_encode("Question")
    assert make_lm(add_bos_token=False).tok_encode("Question")[0] != BOS
    assert lm.prefix_token_id == BOS
