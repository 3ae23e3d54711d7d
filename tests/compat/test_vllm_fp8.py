"""Opt-in: vLLM's own compressed-tensors loader on our FP8 exports (bench/vllm_compat.py --fp8), and our TP rule for
channel scales (`model.layout.channel_scale_pieces`) against what that loader puts on every rank.

For each vLLM venv present (the newest, 0.34.0, and 0.26.0, the last with PLaMo 2; bench/vllm_compat.sh
--install-only creates them), on CPU with forked gloo ranks:
1. the harness: vLLM loads the export (CompressedTensorsW8A8Fp8) and, separately, the export dequantized into
   a plain checkpoint; each rank's FP8 weight times its scale equals the plain load bit for bit (vLLM splits
   weights and scales alike);
2. here: each rank's FP8 weight is the rank's pieces of the exported weight (the layout engine's rule for the
   unquantized tensor) and its scale is `channel_scale_pieces` of the exported scale (rows of a column-parallel
   weight, all of them for a row-parallel one), in the float32 vLLM holds scales in.

Shown to fail (check_rank_files on kept harness runs of both versions, the rule mutated, then restored):
`channel_scale_pieces` giving row-parallel linears their weight's column split -> "0.34.0 tiny3 tp2 rank 1:
...o_proj.weight_scale", "0.26.0 tiny tp2 rank 1: ...down_proj.weight_scale"; giving column-parallel linears all
rows -> "0.34.0 tiny3 tp2 rank 0: ...qkv_proj.weight_scale", and already at TP 1 "0.26.0 tiny: ...in_proj.
weight_scale" (PLaMo 2's in_proj rows are regrouped [z; x], the scale's with them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plamo2_tools import numerics
from plamo2_tools.dtypes import FLOAT8_E4M3
from plamo2_tools.model.layout import Piece, channel_scale_pieces, kind_of
from plamo2_tools.model.registry import family_of, load_config
from plamo2_tools.safetensors_io import read_array, read_header

REPO = Path(__file__).resolve().parents[2]
ROOT = Path.home() / ".cache" / "plamo2-tools"
# (vLLM version, presets): the newest for PLaMo 3; 0.26.0 (the last with Plamo2ForCausalLM) for PLaMo 2 as well.
RUNS = [("0.34.0", "tiny3-mqa,tiny3-yarn"), ("0.26.0", "tiny3-yarn,tiny-gqa")]


def venv(version: str) -> Path:
    return Path(os.environ.get(f"PLAMO2_VLLM_VENV_{version.replace('.', '_')}", ROOT / f"vllm-{version}"))


def ready(version: str) -> bool:
    return (venv(version) / ".plamo2-vllm-ready").is_file() and (venv(version) / "bin" / "python").exists()


def cut(x: np.ndarray, pieces: tuple[Piece, ...]) -> np.ndarray:
    """Concatenate the pieces of x (rows, columns or zero rows): an independent reading of `Piece`."""
    parts = []
    for p in pieces:
        if p.source is None:
            parts.append(np.zeros((p.length, *x.shape[1:]), x.dtype))
        elif p.dim == 0:
            parts.append(x[p.start : p.start + p.length])
        else:
            parts.append(x[:, p.start : p.start + p.length])
    return np.concatenate(parts, axis=pieces[0].dim if pieces[0].source is not None else 0)


def tensors(path: Path) -> dict[str, tuple[np.ndarray, object]]:
    """Every tensor of a safetensors file, or of a directory's files, as (storage array, dtype)."""
    out = {}
    for f in [path] if path.is_file() else sorted(path.glob("*.safetensors")):
        header = read_header(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            for name, info in header.tensors.items():
                out[name] = (read_array(fd, info, 0, info.rows, f).reshape(info.shape), info.dtype)
        finally:
            os.close(fd)
    return out


def check_rank_files(work: Path, cases: list[dict], version: str) -> int:
    """Each rank's FP8 weights and scales as vLLM loaded them (the harness keeps them) against our layout rule
    applied to the export's tensors; returns how many linears were checked."""
    checked = 0
    for case in cases:
        src = work / f"src-{case['preset']}"
        cfg = load_config(src)
        family = family_of(cfg)
        export = tensors(src.with_name(src.name + "-fp8"))
        for rank in range(case["tp"]):
            got = tensors(work / "results" / f"{case['preset']}-tp{case['tp']}" / f"rank{rank}-fp8.safetensors")
            where = f"{version} {case['preset']} tp{case['tp']} rank {rank}"
            for key, (value, dtype) in got.items():
                if dtype != FLOAT8_E4M3:
                    continue
                module = key.removesuffix(".weight")
                kind = kind_of(family, key)
                weight = cut(export[key][0], kind.rule(key, cfg, case["tp"], rank))
                assert weight.tobytes() == value.tobytes(), f"{where}: {key}"
                ours, scale_dtype = export[module + ".weight_scale"]
                pieces = channel_scale_pieces(kind, key, cfg, case["tp"], rank)
                expected = numerics.to_float32(cut(ours, pieces), scale_dtype)
                theirs = got[module + ".weight_scale"][0]
                assert expected.shape == theirs.shape and expected.tobytes() == theirs.tobytes(), (
                    f"{where}: {module}.weight_scale"
                )
                checked += 1
    return checked


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("version", "presets"), RUNS)
def test_vllm_loads_our_fp8_export_and_splits_scales_by_our_rule(version: str, presets: str, tmp_path: Path) -> None:
    if not ready(version):
        pytest.skip(
            f"no vLLM {version} venv at {venv(version)} (bench/vllm_compat.sh --vllm-version {version} "
            "--install-only creates it)"
        )
    out, work = tmp_path / "result.json", tmp_path / "work"
    cli = Path(sys.executable).with_name("plamo2-tools")
    proc = subprocess.run(
        [
            str(venv(version) / "bin" / "python"),
            str(REPO / "bench" / "vllm_compat.py"),
            "--plamo2-tools",
            str(cli),
            "--fp8",
            "--presets",
            presets,
            "--tp",
            "1,2,4",
            "--work",
            str(work),
            "--keep",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), f"no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["vllm_version"] == version
    ran = [c for c in result["cases"] if c["status"] != "skipped"]
    assert {c["preset"] for c in ran} == set(presets.split(",")), proc.stdout
    failed = [c for c in ran if c["status"] != "pass"]
    assert not failed, proc.stdout + json.dumps([c.get("problems") or c.get("error") for c in failed])[:4000]
    assert check_rank_files(work, ran, version) > 0
