"""`plamo2-tools check` passes on what convert wrote and names each kind of damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from convert_expect import flip_byte

from plamo2_tools.safetensors_io import read_header
from plamo2_tools.shards.check import check_shards


@pytest.fixture
def converted(shards, private_copy) -> Path:
    """A private copy of what convert wrote for tiny-gqa at tp=2 x pp=2: ranks 2 and 3 hold the
    padded lm_head (V=515 -> 576 rows)."""
    return private_copy(shards("tiny-gqa", 2, 2, values="watermark"))


def _failed(cli, path: Path) -> dict[str, list[str]]:
    """Run the CLI check, expect exit 1 and one error line, return the problems per check."""
    r = cli("check", path, "--json", expect=1)
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:"), r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is False
    return {name: found for name, found in report["checks"].items() if found}


def test_good_output_passes(cli, converted: Path) -> None:
    r = cli("check", converted)
    assert "ok" in r.stdout
    report = json.loads(cli("check", converted, "--json").stdout)
    assert report["ok"] is True and set(report["checks"]) == {
        "config",
        "side_files",
        "files",
        "headers",
        "tensors",
        "replicas",
        "padding",
        "coverage",
    }


def test_flipped_byte_in_a_tensor(cli, converted: Path) -> None:
    path = converted / "model-rank-1-part-0.safetensors"
    info = read_header(path).tensors["model.layers.layers.0.mixer.in_proj.weight"]
    flip_byte(path, info.offset + info.nbytes // 2)
    failed = _failed(cli, converted)
    assert set(failed) == {"files", "tensors"}
    key = "model.layers.layers.0.mixer.in_proj.weight"
    assert failed["tensors"] == [f"rank 1: {key}: xxh3-128 digest differs from the manifest"]


def test_flipped_byte_in_a_replica(cli, converted: Path) -> None:
    """A replicated norm changed on one rank only: its digest and the replica comparison both see it."""
    path = converted / "model-rank-0-part-0.safetensors"
    info = read_header(path).tensors["model.layers.layers.1.pre_mlp_norm.weight"]
    flip_byte(path, info.offset)
    failed = _failed(cli, converted)
    assert "model.layers.layers.1.pre_mlp_norm.weight" in " ".join(failed["tensors"])


def test_truncated_file(cli, converted: Path) -> None:
    path = converted / "model-rank-3-part-0.safetensors"  # holds the padded lm_head
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    failed = _failed(cli, converted)
    assert any("model-rank-3-part-0.safetensors" in p and "size" in p for p in failed["files"])


def test_missing_file(cli, converted: Path) -> None:
    (converted / "model-rank-3-part-0.safetensors").unlink()
    failed = _failed(cli, converted)
    assert "model-rank-3-part-0.safetensors: missing" in failed["files"]


def test_modified_config(cli, converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    config["rope_theta"] = 10000.0  # still a valid config, just not the one converted
    (converted / "config.json").write_text(json.dumps(config))
    failed = _failed(cli, converted)
    assert set(failed) == {"config", "side_files"}  # format 3 also records config.json's digest


def test_modified_config_that_changes_shapes(cli, converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    config["intermediate_size"] = 128
    (converted / "config.json").write_text(json.dumps(config))
    failed = _failed(cli, converted)
    assert {"config", "headers"} <= set(failed)


def test_nonzero_padding_rows(cli, converted: Path) -> None:
    """lm_head rows 288..575 on tp rank 1 (rank 3): 515 - 288 = 227 real, then 61 padding rows."""
    path = converted / "model-rank-3-part-0.safetensors"
    info = read_header(path).tensors["lm_head.weight"]
    assert info.shape == (288, 96)
    flip_byte(path, info.offset + 230 * info.row_bytes + 4)  # inside padding row 230
    report = check_shards(converted)
    assert report.checks["padding"] == ["rank 3: lm_head.weight: vocab padding rows 227..287 are not zero"]
    assert _failed(cli, converted)["padding"]


def test_check_on_a_directory_without_manifest(cli, checkpoint) -> None:
    r = cli("check", checkpoint("tiny", values="watermark"), expect=2)
    assert "plamo2_shards.json" in r.stderr
