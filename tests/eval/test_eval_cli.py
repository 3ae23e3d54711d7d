"""`plamo2-tools eval` and `plamo2-tools lm-eval` end to end (in-process CLI)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from eval_helpers import MINI_GSM8K
from lm_eval.utils import sanitize_model_name

from plamo2_tools.eval import harness
from plamo2_tools.eval.harness import EVAL_KIND, EVAL_SCHEMA_VERSION


def test_eval_command_on_the_fixture(cli, shard_dirs, tmp_path: Path) -> None:
    shards = shard_dirs["tp2pp2"]
    common = [
        shards,
        "--tasks",
        "gsm8k",
        "--gsm8k-dir",
        MINI_GSM8K,
        "--allow-unverified-data",
        "--bootstrap-iters",
        "0",
    ]
    result = cli("eval", *common, "--limit", "2", "--batch-size", "2", "--output-path", tmp_path / "out")
    assert "|Tasks|Version|" in result.stdout and "strict-match" in result.stdout
    assert "not the official GSM8K files" in result.stderr
    directory = tmp_path / "out" / sanitize_model_name(str(shards))
    saved = json.loads((directory / "results.json").read_text())
    assert (saved["kind"], saved["schema_version"]) == (EVAL_KIND, EVAL_SCHEMA_VERSION)
    assert saved["n-shot"]["gsm8k"] == 5  # no --num-fewshot: the task's own 5 shots, as the reference runs
    assert saved["n-samples"]["gsm8k"] == {"original": 4, "effective": 2}
    assert saved["config"]["tp"] == 2 and saved["config"]["pp"] == 2 and saved["config"]["limit"] == 2
    assert len(list(directory.glob("results_*.json"))) == 1 and len(list(directory.glob("samples_gsm8k_*.jsonl"))) == 1

    # --json: a machine-readable summary on stdout only (a cheap 1-shot, 8-token run)
    result = cli("eval", *common, "--limit", "1", "--num-fewshot", "1", "--max-gen-toks", "8", "--json")
    summary = json.loads(result.stdout)
    assert (summary["kind"], summary["schema_version"]) == (EVAL_KIND, EVAL_SCHEMA_VERSION)
    assert summary["n-shot"]["gsm8k"] == 1 and summary["files"] == {}
    assert 0.0 <= summary["results"]["gsm8k"]["exact_match,strict-match"] <= 1.0


def test_num_fewshot_default_is_the_tasks_own(cli, shard_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --num-fewshot the CLI leaves the count to the task (gsm8k v3: 5 shots, the published
    reference's setting); a default of its own (say 3) would silently change every score."""
    seen: list[harness.EvalRequest] = []

    def fake_run_eval(request: harness.EvalRequest, launch: bool = False) -> None:
        seen.append(request)
        raise SystemExit(0)  # stop before any model runs

    monkeypatch.setattr(harness, "run_eval", fake_run_eval)
    cli("eval", shard_dirs["tp1pp1"], "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data")
    cli("eval", shard_dirs["tp1pp1"], "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data", "--num-fewshot", "2")
    assert [r.num_fewshot for r in seen] == [None, 2]


def test_batch_size_defaults_to_auto_and_takes_a_number_or_auto(cli, shard_dirs, one_line_error, monkeypatch) -> None:
    seen: list[harness.EvalRequest] = []

    def fake_run_eval(request: harness.EvalRequest, launch: bool = False) -> None:
        seen.append(request)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run_eval", fake_run_eval)
    base = [shard_dirs["tp1pp1"], "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data"]
    cli("eval", *base)
    cli("eval", *base, "--batch-size", "auto")
    cli("eval", *base, "--batch-size", "12")
    assert [r.batch_size for r in seen] == ["auto", "auto", 12]
    for bad in ("many", "0", "-3"):
        line = one_line_error(cli("eval", *base, "--batch-size", bad, expect=2), 2)
        assert "--batch-size" in line
    assert harness.EvalRequest(shards="s", data={}).num_fewshot is None


def test_eval_command_errors(cli, shard_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAMO2_GSM8K_DIR", raising=False)
    shards = shard_dirs["tp1pp1"]
    assert "--gsm8k-dir" in cli("eval", shards, expect=2).stderr
    assert "official" in cli("eval", shards, "--gsm8k-dir", MINI_GSM8K, expect=2).stderr
    assert "unsupported task" in cli("eval", shards, "--tasks", "mmlu", "--gsm8k-dir", MINI_GSM8K, expect=2).stderr


@pytest.mark.slow
def test_lm_eval_passthrough_runs_the_plamo2_model(cli, mini_data, shard_dirs, tmp_path: Path, monkeypatch) -> None:
    """lm-eval's own CLI (it indexes all built-in task YAMLs: ~15-35 s) with --model plamo2."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    tasks = tmp_path / "tasks"  # written by the command the README names for this
    cli("gsm8k-task", tasks, "--gsm8k-dir", mini_data.files["test"].parent, "--allow-unverified-data")
    shards = shard_dirs["tp1pp1"]
    cli(
        "lm-eval",
        "run",
        "--model",
        "plamo2",
        "--model_args",
        f"pretrained={shards},max_gen_toks=8",
        "--tasks",
        "gsm8k",
        "--include_path",
        tasks,
        "--num_fewshot",
        "1",
        "--limit",
        "1",
        "--batch_size",
        "2",
        "--device",
        "cpu",
        "--output_path",
        tmp_path / "out",
        "--log_samples",
    )
    directory = tmp_path / "out" / sanitize_model_name(str(shards))
    saved = json.loads(next(directory.glob("results_*.json")).read_text())
    assert saved["config"]["model"] == "plamo2" and saved["config"]["shards"] == str(shards)
    assert saved["versions"]["gsm8k"] == 3.0 and saved["n-samples"]["gsm8k"]["effective"] == 1
    assert len(list(directory.glob("samples_gsm8k_*.jsonl"))) == 1


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_eval_is_quiet_outside_a_git_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    """lm-eval asks `git describe` for the working directory's commit and lets git print
    "fatal: not a git repository" there; eval runs lm-eval with that lookup silenced."""
    import lm_eval.evaluator

    from plamo2_tools.eval import harness

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    lm_eval.evaluator.get_git_commit_hash()
    assert "fatal: not a git repository" in capfd.readouterr().err  # lm-eval's own lookup, unsilenced
    with harness._quiet_git_hash():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err
