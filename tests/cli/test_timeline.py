"""The in-process split of a command run from the shell (plamo2_tools/timeline.py, issue 33): with
$PLAMO2_TIMELINE_DIR set a command writes its phases there as it exits, in the order they happen;
`eval --json` carries them with the model's generate time.  Seen failing: without
`record_at_exit` in the one error path no file is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MINI_GSM8K = Path(__file__).parents[1] / "eval" / "data" / "gsm8k_mini"


def test_a_shell_run_writes_its_phases(shards, tmp_path: Path) -> None:
    env = {**os.environ, "PLAMO2_TIMELINE_DIR": str(tmp_path / "tl")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "plamo2_tools.cli",
            "generate",
            shards("tiny", 1, 1, seed=11),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "tl").iterdir()]
    marks = record["marks"]
    assert record["command"] == "generate" and list(marks) == ["command", "load_start", "load_end", "tokens_start"]
    assert 0 < marks["command"] <= marks["load_start"] <= marks["load_end"] <= marks["tokens_start"] <= record["now"]


def test_eval_json_carries_the_split(cli, shards, tmp_path: Path) -> None:
    r = cli(
        "eval",
        shards("tiny", 1, 1, seed=11),
        "--gsm8k-dir",
        MINI_GSM8K,
        "--allow-unverified-data",
        "--limit",
        "2",
        "--num-fewshot",
        "0",
        "--max-gen-toks",
        "3",
        "--bootstrap-iters",
        "0",
        "--json",
    )
    t = json.loads(r.stdout)["timeline"]
    order = ["load_start", "load_end", "lm_eval_start", "lm_eval_end"]
    assert [m for m in t["marks"] if m in order] == order
    assert t["sums"]["generate"] > 0
