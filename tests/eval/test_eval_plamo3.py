"""PLaMo 3 shards through lm-eval's gsm8k exactly like PLaMo 2's: the same per-sample responses at
TP1xPP1 and TP2xPP2, and the window convention reaching the runtime (and lm-eval's record)."""

from __future__ import annotations

from pathlib import Path

from plamo2_tools.eval.harness import EvalRequest, run_eval


def _responses(shards_dir: Path, mini_data, tmp_path: Path, **options: str) -> tuple[list[str], dict]:
    request = EvalRequest(shards=str(shards_dir), data=mini_data.to_dict(), num_fewshot=2, limit=3, max_gen_toks=24,
                          bootstrap_iters=0, output_path=None, forward_options=dict(options))  # fmt: skip
    outcome = run_eval(request)
    assert outcome is not None
    rows = outcome.samples["gsm8k"]
    return [r["resps"][0][0] for r in rows if r["filter"] == "strict-match"], outcome.results["config"]


def test_plamo3_layouts_give_identical_answers(shards, mini_data, tmp_path: Path) -> None:
    one, cfg = _responses(shards("tiny3-yarn", 1, 1, seed=5), mini_data, tmp_path)
    split, _ = _responses(shards("tiny3-yarn", 2, 2, seed=5), mini_data, tmp_path)
    assert one == split and len(one) == 3
    assert cfg["forward_options"] == {"window_convention": "hf"}  # recorded beside the scores


def test_the_window_convention_reaches_the_runtime(shards, mini_data, tmp_path: Path) -> None:
    path = shards("tiny3", 2, 1, seed=5)
    hf, _ = _responses(path, mini_data, tmp_path)
    vllm, cfg = _responses(path, mini_data, tmp_path, window_convention="vllm")
    assert cfg["forward_options"] == {"window_convention": "vllm"}
    assert hf != vllm  # 2-shot prompts are far longer than the window of 5: the conventions must differ
