"""lm-eval 0.4.13's own `local-completions` model against `plamo2-tools serve` on the tiny preset:
GSM8K's responses equal in-process `plamo2-tools eval` (the same harness, task and data), and a
loglikelihood request gives the numbers of the runtime's own logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from real_serve import CliServer

from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
from plamo2_tools.eval.harness import EvalRequest, evaluate_model, run_eval
from plamo2_tools.runtime.batching.engine import Runtime

pytestmark = pytest.mark.slow
MINI_GSM8K = Path(__file__).parents[1] / "eval" / "data" / "gsm8k_mini"  # self-written, GSM8K's schema


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=5)


@pytest.fixture(scope="module")
def server(shard_dir: Path) -> Iterator[CliServer]:
    s = CliServer(shard_dir, "--max-batch", "8")
    yield s
    assert s.stop() == 0, s.output


def test_gsm8k_responses_equal_in_process_eval(server: CliServer, shard_dir: Path, tmp_path: Path) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    data = load_gsm8k_data(MINI_GSM8K, allow_unverified=True).to_dict()
    request = EvalRequest(shards=str(shard_dir), data=data, limit=8, num_fewshot=2, max_gen_toks=48, bootstrap_iters=0)
    local = run_eval(request)  # what `plamo2-tools eval SHARDS --limit 8 ...` runs
    # Text prompts (tokenized_requests=False): the server tokenizes them with the checkpoint's BOS
    # rule, as in-process eval does; lm-eval's remote tokenizer would send ids without BOS.
    lm = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model=server.model,
        tokenizer_backend="none",
        tokenized_requests=False,
        max_gen_toks=48,
        num_concurrent=4,
        max_retries=1,
        timeout=120,
    )
    remote = evaluate_model(lm, request, tmp_path / "hf")
    assert local is not None and remote is not None
    rows = {r["doc_id"]: r for r in local.samples["gsm8k"]}
    served = {r["doc_id"]: r for r in remote.samples["gsm8k"]}
    assert sorted(rows) == sorted(served) == list(range(4))  # the mini fixture has 4 test problems
    for doc, row in rows.items():
        assert served[doc]["arguments"] == row["arguments"]  # the same prompts and stop strings
        assert served[doc]["resps"] == row["resps"], doc
        assert served[doc]["filtered_resps"] == row["filtered_resps"], doc
    assert any(r["resps"][0][0] for r in rows.values()), "some response is non-empty"


def test_loglikelihood_equals_the_runtimes_logits(server: CliServer, shard_dir: Path) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model=server.model,
        tokenizer_backend="auto",
        max_retries=1,
        timeout=120,
    )
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and tokenizes through /tokenize
    pairs = [("Question: 1 + 1 =", " 2"), ("The cat sat on the", " mat."), ("日本語", "のテキスト")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)

    rt = Runtime(shard_dir, mode="local")
    try:
        tok = rt.tokenizer
        for (ctx, cont), (logprob, greedy) in zip(pairs, got, strict=True):
            # lm-eval's split: the whole text's ids, the context's ids (no BOS from the remote tokenizer)
            whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            n_ctx = len(tok(ctx, add_special_tokens=False)["input_ids"])
            (logits,) = rt.prompt_logits([whole])
            lp = torch.log_softmax(logits.double(), dim=-1)
            want = sum(float(lp[p - 1, whole[p]]) for p in range(n_ctx, len(whole)))
            argmax = all(int(lp[p - 1].argmax()) == whole[p] for p in range(n_ctx, len(whole)))
            assert logprob == pytest.approx(want, abs=1e-4), (ctx, cont)
            assert greedy == argmax
    finally:
        rt.close()
