"""Opt-in: the newest vLLM (0.34.0 when written; PLaMo 3 users are on it, not 0.26) loads our PLaMo 3 shards with
its own `sharded_state` loader, bit for bit what its HF loader makes of the checkpoint (bench/vllm_compat.py, as
tests/compat/test_vllm_compat_plamo3.py does for 0.26.0).  Runs where `bench/vllm_compat.sh --vllm-version 0.34.0
--skip-dep flashinfer-python --install-only` made its venv (~8.5 GB; $PLAMO2_VLLM_VENV_0_34_0 overrides the path).

Shown to fail: with the converter's attention scale buffers left out (`VLLM_EXTRAS = ()` in
model/plamo3/tensors.py) vLLM 0.34.0 refuses every case ("Missing keys ...mixer.attn._k_scale"), as 0.26 did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.34.0"
VENV = Path(os.environ.get("PLAMO2_VLLM_VENV_0_34_0", Path.home() / ".cache" / "plamo2-tools" / f"vllm-{VERSION}"))
READY = (VENV / ".plamo2-vllm-ready").is_file() and (VENV / "bin" / "python").exists()

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not READY,
        reason=f"no vLLM {VERSION} venv at {VENV} (bench/vllm_compat.sh --vllm-version "
        f"{VERSION} --skip-dep flashinfer-python --install-only creates it)",
    ),
]


def test_the_newest_vllm_loads_our_plamo3_shards_bit_for_bit(tmp_path: Path) -> None:
    # tiny3-mqa: one KV head replicated, an untied head; tiny3-yarn: 2 KV heads split (TP 2), replicated (TP 4), YaRN.
    out = tmp_path / "result.json"
    cli = Path(sys.executable).with_name("plamo2-tools")
    proc = subprocess.run(
        [
            str(VENV / "bin" / "python"),
            str(REPO / "bench" / "vllm_compat.py"),
            "--plamo2-tools",
            str(cli),
            "--presets",
            "tiny3-mqa,tiny3-yarn",
            "--tp",
            "2,4",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), f"no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["vllm_version"] == VERSION
    ran = {(c["preset"], c["tp"]): c["status"] for c in result["cases"]}
    assert ran == {(p, tp): "pass" for p in ("tiny3-mqa", "tiny3-yarn") for tp in (2, 4)}, proc.stdout
    assert proc.returncode == 0, proc.stdout
