"""gsm8k through the real harness: lm-eval's own task (v3) on the mini fixture, oracle LMs that
pin the filters and metrics, TP/PP parity, outputs where lm-eval writes them, data checks, and
real torchrun ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import MINI_GSM8K
from lm_eval.api.model import LM
from lm_eval.models.utils import postprocess_generated_text
from lm_eval.utils import sanitize_model_name

from plamo2_tools.errors import UserError
from plamo2_tools.eval.gsm8k_task import ENV_VAR, OFFICIAL_SHA256, gsm8k_task_config, load_gsm8k_data
from plamo2_tools.eval.harness import EVAL_KIND, EVAL_SCHEMA_VERSION, EvalRequest, evaluate_model, run_eval

STRICT, FLEXIBLE = "exact_match,strict-match", "exact_match,flexible-extract"


class OracleLM(LM):
    """Answers every gsm8k prompt with the gold solution plus `suffix`, cut at the task's stops."""

    def __init__(self, answers: dict[str, str], suffix: str) -> None:
        super().__init__()
        self.answers, self.suffix = answers, suffix

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            question = context.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
            text = " " + self.answers[question] + self.suffix
            out.append(postprocess_generated_text(text, gen_kwargs["until"], None))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def oracle_scores(mini_data, suffix: str, tmp_path: Path) -> dict:
    rows = [json.loads(line) for line in (MINI_GSM8K / "test.jsonl").read_text().splitlines()]
    oracle = OracleLM({r["question"]: r["answer"] for r in rows}, suffix)
    request = EvalRequest(shards="oracle", data=mini_data.to_dict(), bootstrap_iters=0)
    return evaluate_model(oracle, request, tmp_path / "hf")


def test_oracle_scores_one_through_the_real_task(mini_data, tmp_path: Path) -> None:
    """Gold answers followed by a new question, which the 'Question:' stop cuts off: 1.0 / 1.0."""
    outcome = oracle_scores(mini_data, "\n\nQuestion: what is 1+1?\nAnswer: 2", tmp_path)
    res = outcome.results
    assert res["results"]["gsm8k"][STRICT] == 1.0 and res["results"]["gsm8k"][FLEXIBLE] == 1.0
    assert res["versions"]["gsm8k"] == 3.0 and res["n-shot"]["gsm8k"] == 5
    assert res["n-samples"]["gsm8k"] == {"original": 4, "effective": 4}
    assert res["configs"]["gsm8k"]["dataset_kwargs"]["data_files"]["test"] == str(MINI_GSM8K.resolve() / "test.jsonl")
    prompts = [s["arguments"][0][0] for s in outcome.samples["gsm8k"]]
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") and p.count("Question: ") == 6 for p in prompts)


def test_run_on_oracle_keeps_strict_and_loses_flexible(mini_data, tmp_path: Path) -> None:
    """docs/eval.md §6: an answer that runs on without a stop string keeps strict-match (first
    '#### N') and loses flexible-extract (last number anywhere)."""
    outcome = oracle_scores(mini_data, "<|plamo:bos|>Chapter 7 has 31 pages", tmp_path)
    assert outcome.results["results"]["gsm8k"][STRICT] == 1.0
    assert outcome.results["results"]["gsm8k"][FLEXIBLE] == 0.0


def test_task_config_changes_only_the_dataset(mini_data) -> None:
    import yaml

    from plamo2_tools.eval.gsm8k_task import installed_task_yaml

    stock = yaml.safe_load(installed_task_yaml().read_text())
    ours = gsm8k_task_config(mini_data)
    changed = {k for k in stock.keys() | ours.keys() if stock.get(k) != ours.get(k)}
    assert changed == {"dataset_path", "dataset_name", "dataset_kwargs"}
    assert ours["dataset_path"] == "json" and ours["dataset_name"] is None


def request_for(shards: Path, mini_data, out: Path | None, **kwargs) -> EvalRequest:
    return EvalRequest(
        shards=str(shards), data=mini_data.to_dict(), output_path=str(out) if out else None, bootstrap_iters=0, **kwargs
    )


def rows(outcome) -> list[tuple[int, str, list, list]]:
    return [(s["doc_id"], s["filter"], s["resps"], s["filtered_resps"]) for s in outcome.samples["gsm8k"]]


def test_tp1pp1_and_tp2pp2_give_identical_results(shard_dirs, mini_data, tmp_path: Path) -> None:
    """The stock 5-shot task with the default 256-token answers on all 4 fixture documents."""
    one = run_eval(request_for(shard_dirs["tp1pp1"], mini_data, tmp_path / "out", batch_size=4))
    four = run_eval(request_for(shard_dirs["tp2pp2"], mini_data, tmp_path / "out", batch_size=3))
    assert rows(one) == rows(four)
    assert one.results["results"] == four.results["results"]
    assert one.results["task_hashes"] == four.results["task_hashes"]  # identical prompts and targets
    assert (one.results["config"]["tp"], four.results["config"]["tp"], four.results["config"]["pp"]) == (1, 2, 2)
    assert all(len(r[2][0][0]) > 0 for r in rows(one))  # the random model does answer something

    # lm-eval's layout: <out>/<sanitized pretrained>/results_<date>.json + samples, plus results.json
    for outcome, shards in ((one, shard_dirs["tp1pp1"]), (four, shard_dirs["tp2pp2"])):
        directory = tmp_path / "out" / sanitize_model_name(str(shards))
        files = {k: Path(v) for k, v in outcome.files.items()}
        assert {p.parent for p in files.values()} == {directory}
        assert files["results"].name.startswith("results_") and files["samples_gsm8k"].name.startswith("samples_gsm8k_")
        saved = json.loads(files["results_stable"].read_text())  # lm-eval's file, tagged as ours
        tag = {"kind": EVAL_KIND, "schema_version": EVAL_SCHEMA_VERSION}
        assert saved == {**tag, **json.loads(files["results"].read_text())}
        assert saved["results"]["gsm8k"][STRICT] == outcome.results["results"]["gsm8k"][STRICT]
        assert saved["config"]["shards"] == str(shards) and saved["model_name"] == str(shards)
        assert len(files["samples_gsm8k"].read_text().splitlines()) == 2 * 4  # a row per (doc, filter)


def test_launch_on_four_gloo_ranks_matches_in_process(shard_dirs, mini_data, tmp_path: Path) -> None:
    request = request_for(
        shard_dirs["tp2pp2"], mini_data, tmp_path / "out", num_fewshot=2, limit=3, batch_size=2, max_gen_toks=48
    )
    launched = run_eval(request, launch=True)
    local = run_eval(request)
    assert launched.launched and not local.launched
    assert launched.results["plamo2_tools"]["runtime_mode"] == "dist"
    assert rows(launched) == rows(local)
    assert launched.results["results"] == local.results["results"]
    assert Path(launched.files["results_stable"]).exists()


def test_data_must_be_found_and_official(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(UserError, match="--gsm8k-dir"):
        load_gsm8k_data(None)
    with pytest.raises(UserError, match="does not exist"):
        load_gsm8k_data(tmp_path / "nowhere")
    (tmp_path / "test.jsonl").write_text((MINI_GSM8K / "test.jsonl").read_text())
    with pytest.raises(UserError, match="missing"):
        load_gsm8k_data(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(MINI_GSM8K))
    with pytest.raises(UserError, match="not hold the official GSM8K files"):
        load_gsm8k_data(None)
    data = load_gsm8k_data(None, allow_unverified=True)
    assert not data.verified and data.sha256["test"] != OFFICIAL_SHA256["test"]
