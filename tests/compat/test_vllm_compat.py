"""Opt-in: vLLM 0.26.0's own loaders accept our shards bit for bit (bench/vllm_compat.py, issue 9).

Runs only where the vLLM venv exists ($PLAMO2_VLLM_VENV, else ~/.cache/plamo2-tools/vllm-0.26.0; create it with
`bench/vllm_compat.sh --install-only`, ~8 GB). Select or deselect with `-m vllm` / `-m "not vllm"`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.26.0"
VENV = Path(os.environ.get("PLAMO2_VLLM_VENV", Path.home() / ".cache" / "plamo2-tools" / f"vllm-{VLLM_VERSION}"))
# bench/vllm_compat.sh writes the stamp only after a complete install and an import check.
READY = (VENV / ".plamo2-vllm-ready").is_file() and (VENV / "bin" / "python").exists()

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not READY,
        reason=f"no vLLM {VLLM_VERSION} venv at {VENV} (bench/vllm_compat.sh --install-only creates it; "
        "PLAMO2_VLLM_VENV overrides the path)",
    ),
]


def test_vllm_sharded_state_loads_our_shards_bit_for_bit(tmp_path: Path) -> None:
    # tiny-gqa at TP 2: two KV heads split across ranks, an untied LM head with padded rows (vLLM's HF loader needs
    # the lm_head input fix there), vocab padding; tiny at TP 2: the single KV head replicated, tied embeddings.
    out = tmp_path / "result.json"
    cli = Path(sys.executable).with_name("plamo2-tools")  # this venv's entry point: the code under test
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), str(REPO / "bench" / "vllm_compat.py"), "--plamo2-tools", str(cli)]
        + ["--presets", "tiny,tiny-gqa", "--tp", "2", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), f"no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["kind"] == "plamo2-vllm-compat" and result["vllm_version"] == VLLM_VERSION
    ran = [c for c in result["cases"] if c["status"] != "skipped"]
    assert [(c["preset"], c["tp"]) for c in ran] == [("tiny", 2), ("tiny-gqa", 2)], proc.stdout
    # pass-exp-rounding: every difference is PLaMo 2's A = -exp(A_log) within one ulp (torch's exp, which vLLM's
    # loader uses, is not correctly rounded; the converter's is): bench/vllm_compat.py:_exp_rounding.
    failed = [c for c in ran if c["status"] not in ("pass", "pass-vllm-hf-bug", "pass-exp-rounding")]
    assert all(c["exp_rounding_only"]["max_ulps"] <= 1 for c in ran if "exp_rounding_only" in c)
    assert not failed, proc.stdout + "\n" + json.dumps([c.get("problems") for c in failed], indent=1)[:4000]
    assert proc.returncode == 0, proc.stdout
    # What vLLM's state holds beyond the parameters: exactly the four attention scales, fp32 0-dim 1.0.
    extras = {e["key"].rsplit(".", 1)[1]: (e["dtype"], e["shape"], e["value"]) for e in result["vllm_required_extras"]}
    assert extras == {s: ("float32", [], 1.0) for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}
