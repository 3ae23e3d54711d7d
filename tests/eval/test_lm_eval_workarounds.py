"""lm-eval's own costs worked around without forking it (issue 33, harness.LM_EVAL_WORKAROUNDS and
eval_cache_root; bench/lm_eval_parts.py measures them):

* the environment report lm-eval writes into the results is torch's `collect_env` text, as before,
  but asked for when the run starts (on a thread), not after the evaluation;
* GSM8K's Arrow tables are built once into our cache and read back by the next run (nothing there
  is rewritten), and PLAMO2_EVAL_CACHE=0 keeps each run's caches temporary, as before.

Seen failing: with the thread started inside `add_env_info` (as lm-eval calls it, at the end), the
call comes after the model's generate; with the temporary cache root restored in `run_eval`, the
second run finds no tables.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.utils.collect_env as collect_env
from eval_helpers import MINI_GSM8K

from plamo2_tools.eval import harness
from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
from plamo2_tools.eval.harness import EvalRequest, evaluate_model, run_eval


def request_for(shards: Path) -> EvalRequest:
    data = load_gsm8k_data(MINI_GSM8K, allow_unverified=True)
    return EvalRequest(
        shards=str(shards),
        data=data.to_dict(),
        limit=2,
        num_fewshot=1,
        batch_size=2,
        max_gen_toks=3,
        bootstrap_iters=0,
        log_samples=False,
    )


def test_env_info_is_the_same_text_asked_for_at_the_start(
    make_lm, shard_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy on torch's function records when it is called; the model's generate records when it
    starts.  The text in the results is what the function returned."""
    events: list[tuple[str, float]] = []
    real = collect_env.get_pretty_env_info

    def spy() -> str:
        events.append(("env_info", time.perf_counter()))
        return "ENV " + real()[:40]

    monkeypatch.setattr(collect_env, "get_pretty_env_info", spy)
    lm = make_lm()
    generate = lm.generate_until

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("generate", time.perf_counter()))
        return generate(*args, **kwargs)

    monkeypatch.setattr(lm, "generate_until", timed)
    outcome = evaluate_model(lm, request_for(shard_dirs["tp1pp1"]), tmp_path / "hf")
    assert outcome is not None and outcome.results["pretty_env_info"].startswith("ENV ")
    assert [name for name, _ in sorted(events, key=lambda e: e[1])] == ["env_info", "generate"]
    assert collect_env.get_pretty_env_info is spy  # put back after the run


def _tables(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*.arrow")}


def test_the_data_tables_are_built_once(shard_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAMO2_CACHE_DIR", str(tmp_path / "cache"))
    run_eval(request_for(shard_dirs["tp1pp1"]))
    first = _tables(tmp_path / "cache" / "lm-eval")
    assert first, "no Arrow tables in the eval cache"
    run_eval(request_for(shard_dirs["tp1pp1"]))
    assert _tables(tmp_path / "cache" / "lm-eval") == first  # read back, not rebuilt
    monkeypatch.setenv("PLAMO2_EVAL_CACHE", "0")
    monkeypatch.setenv("PLAMO2_CACHE_DIR", str(tmp_path / "off"))
    run_eval(request_for(shard_dirs["tp1pp1"]))
    assert not (tmp_path / "off").exists()


def test_the_workarounds_are_listed() -> None:
    assert [w.__name__ for w in harness.LM_EVAL_WORKAROUNDS] == ["_compiled_templates", "_env_info_ahead"]
