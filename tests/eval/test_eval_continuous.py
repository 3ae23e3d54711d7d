"""lm-eval through the plamo2 model with continuous batching (slots refilled, tokens looked at
every few steps, sampling streams keyed per request) gives exactly the results of lm-eval's
fixed batches of one: scores, per-document responses, greedy and sampled."""

from __future__ import annotations

from pathlib import Path

from eval_helpers import SpyRuntime
from lm_eval.api.instance import Instance

from plamo2_tools.eval.harness import EvalRequest, evaluate_model


def gsm8k_rows(lm, mini_data, tmp_path: Path, name: str) -> tuple[list, dict]:
    request = EvalRequest(shards=name, data=mini_data.to_dict(), num_fewshot=2, bootstrap_iters=0)
    outcome = evaluate_model(lm, request, tmp_path / "hf")
    rows = [(s["doc_id"], s["filter"], s["resps"], s["filtered_resps"]) for s in outcome.samples["gsm8k"]]
    return rows, outcome.results["results"]


def test_gsm8k_identical_with_and_without_continuous_batching(make_lm, mini_data, tmp_path: Path) -> None:
    static = make_lm(batch_size=1, continuous_batching=False, max_gen_toks=40)
    continuous = make_lm(batch_size=3, continuous_batching="true", max_gen_toks=40)  # lm-eval passes strings
    assert (static.continuous_batching, continuous.continuous_batching) == (False, True)
    rows_static, results_static = gsm8k_rows(static, mini_data, tmp_path, "static")
    rows_cont, results_cont = gsm8k_rows(continuous, mini_data, tmp_path, "continuous")
    assert rows_cont == rows_static
    assert results_cont == results_static
    assert len({r[2][0][0] for r in rows_static}) > 1  # the answers differ: a real comparison


def gen(context: str, idx: int, **kwargs) -> Instance:
    return Instance("generate_until", {}, (context, kwargs), idx)


def test_generate_until_ragged_stops_and_sampling_match_static_batches(make_lm, runtime) -> None:
    greedy = {"until": ["w9", "\n\n"], "max_gen_toks": 18}
    sampled = {"until": ["Question:"], "max_gen_toks": 12, "do_sample": True, "temperature": 0.8, "top_p": 0.95}
    requests = [gen(f"Question: {'y' * n} {n}?\nAnswer:", i, **(sampled if i % 3 == 0 else greedy))
                for i, n in enumerate((3, 61, 17, 120, 0, 33, 88, 9, 40))]  # fmt: skip
    one = make_lm(batch_size=1, continuous_batching=False).generate_until(requests)
    spy = SpyRuntime(runtime)
    many = make_lm(runtime=spy, batch_size=2).generate_until(requests)
    assert many == one
    # One runtime call per gen_kwargs group, two sequences decoding at a time, keys = request index.
    assert sorted(len(c[0]) for c in spy.calls) == [3, 6]
    assert all(c[2]["max_batch"] == 2 for c in spy.calls)
    assert sorted(k for c in spy.calls for k in c[2]["request_keys"]) == list(range(9))
    assert len(set(one)) > 4
