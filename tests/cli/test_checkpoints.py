"""`plamo2-tools synth`, `inspect` and `logits` through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import Result

from plamo2_tools.inspect import INSPECT_KIND, INSPECT_SCHEMA_VERSION
from plamo2_tools.model import hf_tensor_shapes, num_parameters
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.model.plamo2.presets import TINY_PRESETS
from plamo2_tools.model.plamo2.reference import reference_logits
from plamo2_tools.model.synth import preset_config

Cli = Callable[..., Result]
Checkpoint = Callable[..., Path]  # the `checkpoint` fixture of tests/conftest.py
OneLineError = Callable[..., str]


# ---- synth + inspect + logits for every tiny preset ----------------------------------------------
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_synth_inspect_logits(tmp_path: Path, cli: Cli, preset: str) -> None:
    out = tmp_path / "ckpt"
    cfg = preset_config(preset)
    r = cli("synth", out, "--preset", preset, "--seed", "17", "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["parameters"] == num_parameters(cfg) and info["preset"] == preset and info["seed"] == 17

    r = cli("inspect", out, "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["kind"], info["schema_version"], info["format"]) == (INSPECT_KIND, INSPECT_SCHEMA_VERSION, "hf")
    assert info["parameters"] == info["expected_parameters"] == num_parameters(cfg)
    assert info["tensors"] == len(hf_tensor_shapes(cfg))
    assert info["inventory_problems"] == []
    assert [x["kind"] for x in info["layers"]] == list(cfg.layer_kinds)
    assert info["config"]["padded_vocab"] == cfg.padded_vocab and info["config"]["dt_rank"] == cfg.dt_rank

    r = cli("inspect", out)
    assert r.exit_code == 0, r.stderr
    assert f"parameters: {num_parameters(cfg):,}" in r.stdout
    assert "all tensors present" in r.stdout

    ids = [1, 0, cfg.vocab_size - 1, *range(5, 5 + 2 * cfg.attention_window_size)]
    npy = tmp_path / "logits.npy"
    r = cli("logits", out, "--input-ids", ",".join(map(str, ids)), "--out", npy)
    assert r.exit_code == 0, r.stderr
    got = np.load(npy)
    assert got.dtype == np.float32 and got.shape == (len(ids), cfg.vocab_size)
    with HFCheckpoint(out) as ckpt:
        expected = reference_logits(ckpt, [ids], torch.float64)[0].numpy()
    np.testing.assert_array_equal(got, expected)

    r = cli("logits", out, "--input-ids", "1,2,3", "--out", npy, "--precision", "float32")
    assert r.exit_code == 0, r.stderr
    assert np.load(npy).shape == (3, cfg.vocab_size)


def test_synth_is_deterministic_through_the_cli(tmp_path: Path, cli: Cli) -> None:
    def bytes_of(seed: int, name: str) -> bytes:
        out = tmp_path / name
        assert cli("synth", out, "--preset", "tiny-edge", "--seed", str(seed), "--json").exit_code == 0
        return (out / "model.safetensors").read_bytes()

    assert bytes_of(3, "a") == bytes_of(3, "b") != bytes_of(4, "c")


def test_synth_multi_file(tmp_path: Path, cli: Cli) -> None:
    out = tmp_path / "ckpt"
    r = cli("synth", out, "--preset", "tiny", "--files", "3", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["files"] == 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    info = json.loads(cli("inspect", out, "--json").stdout)
    assert len(info["files"]) == 3 and info["inventory_problems"] == []
    assert sum(f["tensors"] for f in info["files"]) == info["tensors"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--preset", "plamo-2-2b"], "unknown preset"),
        (["--dtype", "float8"], "unknown dtype"),
        (["--files", "0"], "files"),
        (["--files", "1000"], "files"),
    ],
)
def test_synth_bad_input(tmp_path: Path, cli: Cli, one_line_error: OneLineError, args: list[str], match: str) -> None:
    assert match in one_line_error(cli("synth", tmp_path / "x", *args, "--json", expect=2), 2)


def test_synth_refuses_existing_output(tmp_path: Path, cli: Cli, one_line_error: OneLineError) -> None:
    out = tmp_path / "ckpt"
    assert cli("synth", out, "--preset", "tiny-edge", "--json").exit_code == 0
    assert "--force" in one_line_error(cli("synth", out, "--preset", "tiny-edge", "--json", expect=2), 2)
    assert cli("synth", out, "--preset", "tiny-edge", "--force", "--json").exit_code == 0


# ---- inspect: TP/PP table and broken checkpoints -------------------------------------------------
def test_inspect_split_table(cli: Cli, checkpoint: Checkpoint) -> None:
    path = checkpoint("tiny", 0)  # Hq 4, Hkv 1, Hm 8, F 96, Vp 1024, L 4
    info = json.loads(cli("inspect", path, "--json").stdout)
    tp = {row["tp"]: row for row in info["splits"]["tp"]}
    assert tp[1]["ok"] and tp[2]["ok"] and tp[4]["ok"]
    assert not tp[3]["ok"]
    assert any("does not divide" in reason for reason in tp[3]["reasons"])
    assert not tp[8]["ok"] and "tp=8 does not divide 4 attention heads" in tp[8]["reasons"]
    pp = {row["pp"]: row for row in info["splits"]["pp"]}
    assert pp[2]["ok"] and pp[2]["layers"] == [2, 2]
    assert pp[3]["ok"] and pp[3]["layers"] == [1, 2, 1]  # vLLM: the extra layer goes before the last
    assert not pp[5]["ok"] and "more stages" in pp[5]["reasons"][0]

    text = cli("inspect", path).stdout
    assert "possible splits" in text
    row = next(line for line in text.splitlines() if "tp=3 " in line)
    assert "no" in row and "does not divide" in row


def test_inspect_reports_gqa_replication_note(cli: Cli, checkpoint: Checkpoint) -> None:
    info = json.loads(cli("inspect", checkpoint("tiny-gqa", 0), "--json").stdout)
    tp4 = next(row for row in info["splits"]["tp"] if row["tp"] == 4)
    assert tp4["ok"] and "replicated" in tp4["notes"][0]


@pytest.fixture
def broken(checkpoint: Checkpoint, private_copy: Callable[[Path], Path]) -> Path:
    """tiny with one tensor missing, one unexpected and one misshapen."""
    path = private_copy(checkpoint("tiny", 0))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.layers.2.mixer.dt_bias"]
    tensors["model.layers.layers.1.mixer.rotary_emb.inv_freq"] = torch.zeros(8)
    tensors["model.layers.layers.3.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_inspect_json_reports_inventory_problems(cli: Cli, broken: Path) -> None:
    r = cli("inspect", broken, "--json")
    assert r.exit_code == 0, r.stderr
    problems = json.loads(r.stdout)["inventory_problems"]
    assert sorted(problems) == sorted(
        [
            "missing tensor model.layers.layers.2.mixer.dt_bias [8]",
            "unexpected tensor model.layers.layers.1.mixer.rotary_emb.inv_freq [8]",
            "wrong shape for model.layers.layers.3.mlp.down_proj.weight: [64, 95], expected [64, 96]",
        ]
    )
    text = cli("inspect", broken).stdout
    assert "inventory problems (3)" in text


def test_logits_refuses_broken_checkpoint(tmp_path: Path, cli: Cli, broken: Path) -> None:
    r = cli("logits", broken, "--input-ids", "1,2", "--out", tmp_path / "x.npy", expect=2)  # no uncaught exception
    msg = r.stderr
    assert r.exit_code == 2 and "Traceback" not in msg
    assert "3 problem(s)" in msg
    for name in ("2.mixer.dt_bias", "1.mixer.rotary_emb.inv_freq", "3.mlp.down_proj.weight"):
        assert f"model.layers.layers.{name}" in msg
    assert not (tmp_path / "x.npy").exists()


def test_inspect_corrupt_file_is_one_line(
    cli: Cli, one_line_error: OneLineError, checkpoint: Checkpoint, private_copy: Callable[[Path], Path]
) -> None:
    path = private_copy(checkpoint("tiny", 0))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-10])
    assert "truncated" in one_line_error(cli("inspect", path, "--json", expect=2), 2)


# ---- logits: bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("ids", ["1,2,1000", "1000", "5,-1", "0,99999999"])
def test_logits_token_outside_vocabulary(
    tmp_path: Path, cli: Cli, one_line_error: OneLineError, checkpoint: Checkpoint, ids: str
) -> None:
    r = cli("logits", checkpoint("tiny", 0), "--input-ids", ids, "--out", tmp_path / "x.npy", expect=2)
    assert "outside the vocabulary" in one_line_error(r, 2)
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("what", ["no-dir", "empty-dir", "no-weights"])
def test_logits_missing_checkpoint(
    tmp_path: Path, cli: Cli, one_line_error: OneLineError, checkpoint: Checkpoint, what: str
) -> None:
    path = tmp_path / "ckpt"
    if what != "no-dir":
        path.mkdir()
    if what == "no-weights":
        (path / "config.json").write_bytes((checkpoint("tiny", 0) / "config.json").read_bytes())
    r = cli("logits", path, "--input-ids", "1,2", "--out", tmp_path / "x.npy", expect=2)
    one_line_error(r, 2)


def test_logits_errors_in_a_real_process(tmp_path: Path, checkpoint: Checkpoint) -> None:
    """The same contract outside CliRunner (real terminal handling, real exit): exit 2, one stderr
    line, no traceback.  One case only: a process start costs seconds."""
    args = [str(checkpoint("tiny", 0)), "--input-ids", "1,1000", "--out", str(tmp_path / "x.npy")]
    p = subprocess.run(
        [sys.executable, "-m", "plamo2_tools.cli", "logits", *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "outside the vocabulary" in p.stderr and p.stdout == ""


def test_help_shows_no_type_beside_plain_flags(cli) -> None:
    """Issue 21: `--force  --no-force  <bool>` read as if the flag took a value."""
    for command in ("convert", "merge", "check", "synth"):
        text = cli(command, "--help").stdout
        flags = [line for line in text.splitlines() if "--force" in line or "--json" in line]
        assert flags and not any("<bool>" in line for line in flags), (command, flags)
