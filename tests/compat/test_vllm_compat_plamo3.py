"""Opt-in: vLLM 0.26.0's own Plamo3ForCausalLM loads our PLaMo 3 shards bit for bit (bench/vllm_compat.py).

Runs only where the vLLM venv exists ($PLAMO2_VLLM_VENV, else ~/.cache/plamo2-tools/vllm-0.26.0; create it with
`bench/vllm_compat.sh --install-only`, ~8 GB). Select or deselect with `-m vllm` / `-m "not vllm"`.
vLLM cannot resolve a plamo3 config without PFN's remote code; the harness registers its own labelled stand-in
(`_plamo3_config_standin`, reports/vllm/README.md "PLaMo 3 shards through vLLM's own loaders").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.26.0"
VENV = Path(os.environ.get("PLAMO2_VLLM_VENV", Path.home() / ".cache" / "plamo2-tools" / f"vllm-{VLLM_VERSION}"))
# bench/vllm_compat.sh writes the stamp only after a complete install and an import check.
READY = (VENV / ".plamo2-vllm-ready").is_file() and (VENV / "bin" / "python").exists()
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not READY,
        reason=f"no vLLM {VLLM_VERSION} venv at {VENV} (bench/vllm_compat.sh --install-only creates it; "
        "PLAMO2_VLLM_VENV overrides the path)",
    ),
]


def _harness(tmp_path: Path, presets: str, tps: str, *extra: str) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    out = tmp_path / "result.json"
    cli = Path(sys.executable).with_name("plamo2-tools")  # this venv's entry point: the code under test
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), str(REPO / "bench" / "vllm_compat.py"), "--plamo2-tools", str(cli)]
        + ["--presets", presets, "--tp", tps, "--work", str(tmp_path / "work"), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), f"no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["kind"] == "plamo2-vllm-compat" and result["vllm_version"] == VLLM_VERSION
    return result, proc


def _problems(cases: list[dict[str, Any]]) -> str:
    return json.dumps([(c["preset"], c["tp"], c.get("problems"), c.get("error")) for c in cases], indent=1)[:4000]


def test_vllm_plamo3_sharded_state_loads_our_shards_bit_for_bit(tmp_path: Path) -> None:
    # tiny3 at TP 2: tied embedding (stored as lm_head.weight only), 2 KV heads split over 2 ranks;
    # tiny3-mqa at TP 2: one KV head replicated, untied head with V = 515 rows in HF (vLLM's ParallelLMHead(528,
    # org 515)), head_dim * heads != hidden; tiny3-yarn at TP 4: 2 KV heads replicated 2x, YaRN on the full layers,
    # the transformers-v5 config form.
    result, proc = _harness(tmp_path, "tiny3,tiny3-mqa,tiny3-yarn", "2,4")
    ran = {(c["preset"], c["tp"]): c for c in result["cases"] if c["status"] != "skipped"}
    assert set(ran) == {(p, t) for p in ("tiny3", "tiny3-mqa", "tiny3-yarn") for t in (2, 4)}, proc.stdout
    failed = [c for c in ran.values() if c["status"] != "pass"]
    assert not failed, proc.stdout + "\n" + _problems(failed)
    assert proc.returncode == 0, proc.stdout
    for c in ran.values():
        assert c["architectures"] == ["Plamo3ForCausalLM"]
        for r in c["ranks"]:
            built = r["vllm_built"]
            # vLLM's registry picked the class the config names, from the harness's labelled config stand-in.
            assert built["model_class"] == "vllm.model_executor.models.plamo3.Plamo3ForCausalLM"
            assert built["config_class"].endswith("HarnessStandinPlamo3Config")
            assert "hf_fixes" not in r and r["hf_load"]["ok"]  # vLLM's own HF loader needs no input fix here
    # The v5 config form reached vLLM: YaRN on the full layers (1, 3), plain RoPE base 50 on the sliding ones.
    layers = ran["tiny3-yarn", 4]["ranks"][0]["vllm_built"]["attention_layers"]
    assert [(a["rope"], a["base"], a["sliding_window"]) for a in layers] == [
        ("RotaryEmbedding", 50.0, 4),
        ("YaRNScalingRotaryEmbedding", 10000.0, None),
        ("RotaryEmbedding", 50.0, 4),
        ("YaRNScalingRotaryEmbedding", 10000.0, None),
        ("RotaryEmbedding", 50.0, 4),
    ]
    extras = {e["key"].rsplit(".", 1)[1]: (e["dtype"], e["shape"], e["value"]) for e in result["vllm_required_extras"]}
    assert extras == {s: ("float32", [], 1.0) for s in SCALES}


def test_vllm_plamo3_bf16_equals_vllm_on_cuda(tmp_path: Path) -> None:
    # convert --dtype bfloat16 from the fp32 checkpoint, vLLM in bf16: vLLM's plamo3.py copies a norm weight into its
    # bf16 parameter, then adds the offset; the converter does the same in CUDA's arithmetic (cast first, float32
    # offset, one more rounding). vLLM here runs on the CPU, where torch also rounds the offset to bf16 first, so
    # norms may differ by one bf16 step, and only where the CPU's extra rounding explains it (pass-cuda-rounding);
    # everything else must be bit-identical and sharded_state must load.
    result, proc = _harness(tmp_path, "tiny3-mqa", "2", "--dtype", "bfloat16")
    (case,) = [c for c in result["cases"] if c["status"] != "skipped"]
    assert case["dtype"] == "bfloat16"
    assert all(r["sharded_load"]["ok"] for r in case["ranks"]), _problems([case])
    assert case["status"] in ("pass", "pass-cuda-rounding"), proc.stdout + "\n" + _problems([case])
    if case["status"] == "pass-cuda-rounding":
        rounding = case["offset_rounding_only"]
        assert rounding["max_ulps"] == 1
        assert all(k.endswith("norm.weight") for k in rounding["by_norm"]), rounding["by_norm"]
