"""`plamo2-tools check OUT --source SRC` on `export mlx` and `export fp8` directories, through the real command:
a sound export passes (re-derived byte for byte, and independently by MLX's and compressed-tensors' own
dequantization); one byte changed in a quantized weight, in a scale or in a passthrough tensor, a missing tensor,
an extra tensor and an edited config are each found (exit 1, the first problem named); refusals are one line.

Shown to fail (each broken on purpose in export/check.py, seen red, restored):
* `_compare` returning None (no byte comparison): the three tamper cases of both formats went red (exit 0);
* `_inventory` returning []: the missing and the extra tensor went red (both formats);
* `_first_config_difference` returning None: the config edit went red;
* the comparison of `_mlx_independent`, then of `_fp8_independent`, finding nothing: each time
  test_the_independent_checks_see_a_wrong_scale went red.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from plamo2_tools.export.check import check_export


def tensor_at(path: Path, name: str) -> int:
    """The file offset of the first byte of tensor `name` in a safetensors file."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return 8 + n + json.loads(data[8 : 8 + n])[name]["data_offsets"][0]


def flip(path: Path, name: str, byte: int = 0, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[tensor_at(path, name) + byte] ^= mask
    path.write_bytes(bytes(data))


def rewrite(path: Path, drop: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}  # noqa: SIM118
    save_file(tensors, str(path), metadata=meta)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """{"mlx": (4-bit MLX export, source), "fp8": (FP8 export, source)}, both from bfloat16 tiny3, unverified
    (the check is what is tested), written once; every test works on a copy."""
    from plamo2_tools.convert.sources import open_source, source_side_files
    from plamo2_tools.dtypes import BFLOAT16
    from plamo2_tools.export.fp8 import export_fp8
    from plamo2_tools.export.mlx import Recipe, export_mlx
    from plamo2_tools.model.registry import config_from_dict, family_of_preset
    from plamo2_tools.model.synth import random_tensor, write_checkpoint

    root = tmp_path_factory.mktemp("export-check")
    cfg = config_from_dict({**family_of_preset("tiny3").preset_raw("tiny3"), "torch_dtype": "bfloat16"})
    src = root / "src"
    write_checkpoint(src, cfg, lambda n, s: random_tensor(cfg, n, s, 0), BFLOAT16)
    source = open_source(src)
    try:
        export_mlx(source, source_side_files(source), root / "mlx", Recipe(bits=4, group_size=32))
    finally:
        source.close()
    export_fp8(src, root / "fp8", verify=False)
    return {"mlx": (root / "mlx", src), "fp8": (root / "fp8", src)}


def copy_of(exports: dict, fmt: str, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    out, src = exports[fmt]
    dst = tmp_path / fmt
    shutil.copytree(out, dst)
    return dst, src


# what each case changes: (format, tensor, byte, mask); scales and norms are bfloat16 (little end first)
TAMPERS = [
    ("mlx", "model.layers.layers.0.mlp.gate_up_proj.weight", 3, 0x10),  # packed 4-bit codes
    ("mlx", "model.layers.layers.1.mixer.o_proj.scales", 0, 0x01),
    ("mlx", "model.layers.layers.0.pre_mixer_norm.weight", 0, 0x01),  # passthrough
    ("fp8", "model.layers.layers.0.mlp.down_proj.weight", 5, 0x01),  # e4m3 codes
    ("fp8", "model.layers.layers.1.mixer.o_proj.weight_scale", 0, 0x01),
    ("fp8", "model.layers.layers.0.pre_mixer_norm.weight", 0, 0x01),  # passthrough
]


@pytest.mark.parametrize("fmt", ["mlx", "fp8"])
def test_a_sound_export_passes(fmt: str, exports, cli, tmp_path: Path) -> None:  # noqa: ANN001
    out, src = exports[fmt]
    report = json.loads(cli("check", out, "--source", src, "--json").stdout)
    assert report["ok"] and report["format"] == fmt and report["tensors_compared"] > 0, report
    if fmt == "mlx" and importlib.util.find_spec("mlx") is None:
        assert report["independent"].startswith("skipped: mlx is not installed")
    elif fmt == "mlx":
        assert report["independent"].startswith("mlx.core.dequantize") and " 0 quantized" not in report["independent"]
    else:
        assert report["independent"].startswith("compressed-tensors") and " 0 FP8" not in report["independent"]
    assert "match" in cli("check", out, "--source", src).stdout


@pytest.mark.parametrize(("fmt", "name", "byte", "mask"), TAMPERS)
def test_one_changed_byte_is_found(
    fmt: str, name: str, byte: int, mask: int, exports, cli, one_line_error, tmp_path: Path
) -> None:  # noqa: ANN001
    out, src = copy_of(exports, fmt, tmp_path)
    flip(out / "model.safetensors", name, byte, mask)
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert f"first: {name}: differs from the source re-derived" in line, line


@pytest.mark.parametrize("fmt", ["mlx", "fp8"])
def test_a_missing_and_an_extra_tensor_are_found(fmt: str, exports, cli, one_line_error, tmp_path: Path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    out, src = copy_of(exports, fmt, tmp_path)
    gone = "model.layers.layers.2.post_mlp_norm.weight"
    rewrite(out / "model.safetensors", gone)
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert f"missing tensor {gone}" in line, line
    out, src = copy_of(exports, fmt, tmp_path / "extra")
    import torch

    save_file({"model.layers.layers.0.mixer.extra": torch.zeros(4)}, str(out / "model-extra.safetensors"))
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert "unexpected tensor model.layers.layers.0.mixer.extra" in line, line


@pytest.mark.parametrize("fmt", ["mlx", "fp8"])
def test_an_edited_config_is_found(fmt: str, exports, cli, one_line_error, tmp_path: Path) -> None:  # noqa: ANN001
    out, src = copy_of(exports, fmt, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["window_size"] = config["window_size"] + 1
    (out / "config.json").write_text(json.dumps(config))
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert "config.json 'window_size'" in line, line


def test_the_independent_checks_see_a_wrong_scale(exports, tmp_path: Path) -> None:
    """A scale's exponent changed: besides the byte comparison, MLX's own dequantize and compressed-tensors' own
    dequantize each put the weight more than one quantization step from the source."""
    pytest.importorskip("mlx.core")
    for fmt, scale in (
        ("mlx", "model.layers.layers.1.mixer.o_proj.scales"),
        ("fp8", "model.layers.layers.1.mixer.o_proj.weight_scale"),
    ):
        out, src = copy_of(exports, fmt, tmp_path / fmt)
        flip(out / "model.safetensors", scale, 1, 0x04)  # bfloat16's high byte: an exponent bit
        report = check_export(out, src)
        by = "mlx.core.dequantize" if fmt == "mlx" else "compressed-tensors dequantizes"
        assert any(by in p for p in report.problems), report.problems


def test_without_mlx_the_independent_half_is_skipped(exports, monkeypatch: pytest.MonkeyPatch) -> None:
    out, src = exports["mlx"]
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # import mlx.core -> ImportError
    monkeypatch.setitem(sys.modules, "mlx", None)
    report = check_export(out, src)
    assert report.ok and report.independent.startswith("skipped: mlx is not installed")


def test_refusals_are_one_line(exports, cli, one_line_error, checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    out, src = exports["fp8"]
    assert "needs --source" in one_line_error(cli("check", out, expect=2), 2)
    mlx, _ = copy_of(exports, "mlx", tmp_path)
    record = json.loads((mlx / "plamo2_export.json").read_text())
    (mlx / "plamo2_export.json").write_text(json.dumps({**record, "dtype": "float7"}))
    one_line_error(cli("check", mlx, "--source", src, expect=2), 2)
