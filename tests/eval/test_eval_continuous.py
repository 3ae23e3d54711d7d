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
    requests = [
        gen(f"Question: {'y' * n} {n}?\nAnswer:", i, **(sampled if i % 3 == 0 else greedy))
        for i, n in enumerate((3, 61, 17, 120, 0, 33, 88, 9, 40))
    ]
    one = make_lm(batch_size=1, continuous_batching=False).generate_until(requests)
    spy = SpyRuntime(runtime)
    many = make_lm(runtime=spy, batch_size=2).generate_until(requests)
    assert many == one
    # One runtime call per gen_kwargs group, two sequences decoding at a time, keys = request index.
    assert sorted(len(c[0]) for c in spy.calls) == [3, 6]
    assert all(c[2]["max_batch"] == 2 for c in spy.calls)
    assert sorted(k for c in spy.calls for k in c[2]["request_keys"]) == list(range(9))
    assert len(set(one)) > 4


class InCallBar:
    """tqdm stand-in: records, for every update, whether the runtime's generate call was still running."""

    def __init__(self, spy: CallFlagRuntime) -> None:
        self.spy, self.updates = spy, []

    def __call__(self, *args, **kwargs):  # the tqdm(...) call
        return self

    def update(self, n: int = 1) -> None:
        self.updates.append((n, self.spy.running))

    def close(self) -> None:
        pass


class CallFlagRuntime(SpyRuntime):
    running = False

    def generate(self, prompts, max_new_tokens, **kwargs):
        self.running = True
        try:
            return super().generate(prompts, max_new_tokens, **kwargs)
        finally:
            self.running = False


def test_generate_until_bar_advances_as_requests_finish(make_lm, runtime, monkeypatch) -> None:
    """One runtime call per gen_kwargs group, but the bar moves inside it, one step per request."""
    from plamo2_tools.eval import plamo2_lm as module

    spy = CallFlagRuntime(runtime)
    bar = InCallBar(spy)
    monkeypatch.setattr(module, "tqdm", bar)
    requests = [
        gen(f"Question: {'z' * n}?\nAnswer:", i, until=["Question:"], max_gen_toks=12)
        for i, n in enumerate((4, 40, 11, 25, 2, 18))
    ]
    make_lm(runtime=spy, batch_size=2).generate_until(requests)
    assert len(spy.calls) == 1
    assert bar.updates == [(1, True)] * len(requests)


def test_auto_batch_size_is_the_default_and_is_reported(make_lm, mini_data, tmp_path: Path) -> None:
    lm = make_lm(max_gen_toks=24)
    assert lm.batch_size == "auto"
    request = EvalRequest(shards="auto", data=mini_data.to_dict(), num_fewshot=2, bootstrap_iters=0)
    outcome = evaluate_model(lm, request, tmp_path / "hf")
    config = outcome.results["config"]
    plan = config["auto_batch"]
    assert plan["slots"] >= 1 and plan["capacity"] > 24 and plan["limit"] in ("memory", "cap")
    assert config["batch_sizes_run"]["generate_until"] == min(plan["slots"], 4)  # 4 test documents
    fixed = make_lm(max_gen_toks=24, batch_size=2)
    rows_fixed, _ = gsm8k_rows(fixed, mini_data, tmp_path, "fixed")
    rows_auto = [(s["doc_id"], s["filter"], s["resps"], s["filtered_resps"]) for s in outcome.samples["gsm8k"]]
    assert rows_auto == rows_fixed
