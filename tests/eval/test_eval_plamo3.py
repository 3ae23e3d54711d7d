"""PLaMo 3 shards through lm-eval's gsm8k exactly like PLaMo 2's: the same per-sample responses at
TP1xPP1 and TP2xPP2, and the window convention reaching the runtime (and lm-eval's record)."""

from __future__ import annotations

from pathlib import Path

from plamo2_tools.eval.harness import EvalRequest, run_eval


def _responses(shards_dir: Path, mini_data, tmp_path: Path, **options: str) -> tuple[list[str], dict]:
    request = EvalRequest(
        shards=str(shards_dir),
        data=mini_data.to_dict(),
        num_fewshot=2,
        limit=3,
        max_gen_toks=24,
        bootstrap_iters=0,
        output_path=None,
        forward_options=dict(options),
    )
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


def test_the_command_carries_the_family_option_into_the_answers(cli, shards, mini_data, tmp_path: Path) -> None:
    """Issue 34 class 7: `plamo2-tools eval --option window_convention=vllm`, the real command, answers
    what the library answers under that option and not what it answers under the default: the option
    travels from the command line through the eval job into the runtime.  Seen failing with
    `forward_options=forward_options(option)` dropped from cli/evaluate.py (the command's answers then
    equal the default's) and with the option not recorded in the results' config."""
    import json

    from eval_helpers import MINI_GSM8K
    from lm_eval.utils import sanitize_model_name

    path = shards("tiny3", 2, 1, seed=5)
    args = [
        path,
        "--tasks",
        "gsm8k",
        "--gsm8k-dir",
        MINI_GSM8K,
        "--allow-unverified-data",
        "--num-fewshot",
        2,
        "--limit",
        3,
        "--max-gen-toks",
        24,
        "--bootstrap-iters",
        0,
    ]

    def command(*extra: object) -> tuple[list[str], dict]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        cli("eval", *args, *extra, "--output-path", out)
        directory = out / sanitize_model_name(str(path))
        rows = [
            json.loads(line) for f in directory.glob("samples_gsm8k_*.jsonl") for line in f.read_text().splitlines()
        ]
        saved = json.loads((directory / "results.json").read_text())
        return [
            r["resps"][0][0] for r in sorted(rows, key=lambda r: r["doc_id"]) if r["filter"] == "strict-match"
        ], saved

    vllm, saved = command("--option", "window_convention=vllm")
    default, _ = command()
    library_vllm, _ = _responses(path, mini_data, tmp_path, window_convention="vllm")
    library_hf, _ = _responses(path, mini_data, tmp_path)
    assert saved["config"]["forward_options"] == {"window_convention": "vllm"}
    assert vllm == library_vllm and default == library_hf
    assert vllm != default  # 2-shot prompts are far longer than the window of 5
