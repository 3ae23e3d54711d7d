"""`bench/kill_resume.py` on a tiny preset: convert killed at random points of its work (and some
resumes killed again), every resume byte-identical to a clean run.  The plamo-2-1b-sized run of
the same script is committed under reports/convert/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "kill_resume.py"


@pytest.mark.slow
def test_every_resume_after_a_kill_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(BENCH),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--preset",
        "tiny-gqa",
        "--tp",
        "2",
        "--pp",
        "2",
        "--max-part-size",
        "64kB",
        "--kills",
        "2",
        "--seed",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["all_identical"], [t["differences"] for t in result["trials"]]
    assert result["shard_files"] > 20  # many files: kills land between, inside and after them
    assert result["interrupted_mid_way"] >= 1, "no kill landed inside the work: the test proved nothing"
    for t in result["trials"]:
        last = t["kills"][-1]["left"]
        if not last["manifest"] and last["journaled_files"] > 1:  # finished files were there: kept, not redone
            assert t["resume_status"] == "resumed" and t["files_reused"] >= 1, t
