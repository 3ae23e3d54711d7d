"""The HF checkpoint reader: inventory errors, single file and HF index layouts, and every way a
file can be broken.  Checkpoints here are written with `safetensors.torch.save_file` (not our
writer), so the reader is checked against the library's idea of the format."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from model_helpers import preset_raw
from safetensors.torch import save_file

from plamo2_tools.errors import CheckpointError, ConfigError
from plamo2_tools.model import hf_tensor_shapes
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.model.plamo2.config import Plamo2Config

Tensors = dict[str, torch.Tensor]


@pytest.fixture
def cfg() -> Plamo2Config:
    return Plamo2Config.from_dict(preset_raw("tiny-edge"))  # untied: has lm_head too


@pytest.fixture
def tensors(cfg: Plamo2Config) -> Tensors:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(s, generator=g) for n, s in hf_tensor_shapes(cfg).items()}


def write_dir(path: Path, cfg: Plamo2Config, files: dict[str, Tensors], index: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    for name, ts in files.items():
        save_file(ts, str(path / name), metadata={"format": "pt"})
    if index is not None:
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def split(tensors: Tensors, n: int) -> tuple[dict[str, Tensors], dict]:
    """n files plus the matching HF index."""
    names = list(tensors)
    files = {f"model-{i + 1:05d}-of-{n:05d}.safetensors": {k: tensors[k] for k in names[i::n]} for i in range(n)}
    weight_map = {k: f for f, ts in files.items() for k in ts}
    return files, {"metadata": {"total_size": 0}, "weight_map": weight_map}


def open_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).close()
    return str(e.value)


# ---- good checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize("n_files", [1, 3])
def test_reads_every_tensor(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors, n_files: int) -> None:
    if n_files == 1:
        path = write_dir(tmp_path, cfg, {"model.safetensors": tensors})
    else:
        path = write_dir(tmp_path, cfg, *split(tensors, n_files))
    with HFCheckpoint(path) as ckpt:
        assert ckpt.config == cfg
        assert len(ckpt.files) == n_files
        assert ckpt.inventory_problems() == []
        ckpt.check_inventory()
        for name, t in tensors.items():
            assert torch.equal(ckpt.get(name), t), name
        name = "model.embed_tokens.weight"
        assert torch.equal(ckpt.read_rows(name, 7, 19), tensors[name][7:19])


def test_single_file_under_another_name(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    with HFCheckpoint(write_dir(tmp_path, cfg, {"weights.safetensors": tensors})) as ckpt:
        assert ckpt.inventory_problems() == []


# ---- inventory ------------------------------------------------------------------------------
def test_one_error_lists_every_inventory_problem(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    # The issue: ONE CheckpointError naming EVERY missing, unexpected and misshapen tensor (the
    # layout of the message, one line or several, is free).
    missing = ["model.layers.layers.0.mixer.A_log", "lm_head.weight"]
    for name in missing:
        del tensors[name]
    tensors["model.layers.layers.0.mixer.rotary_emb.inv_freq"] = torch.zeros(4)
    tensors["model.layers.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
    tensors["model.layers.layers.1.mixer.qkv_proj.weight"] = torch.zeros(5, 48)
    tensors["model.layers.layers.0.mixer.conv1d.weight"] = torch.zeros(32, 4)  # lost its middle dim
    tensors["model.norm.weight"] = torch.zeros(48, dtype=torch.int32)
    path = write_dir(tmp_path, cfg, {"model.safetensors": tensors})
    with HFCheckpoint(path) as ckpt:
        assert len(ckpt.inventory_problems()) == 7
        with pytest.raises(CheckpointError) as e:
            ckpt.check_inventory()
    msg = str(e.value)
    assert "7 problem(s)" in msg
    for name in missing:
        assert f"missing tensor {name}" in msg
    assert "unexpected tensor model.layers.layers.0.mixer.rotary_emb.inv_freq" in msg
    assert "unexpected tensor model.layers.layers.9.mlp.down_proj.weight" in msg
    assert "wrong shape for model.layers.layers.1.mixer.qkv_proj.weight: [5, 48], expected [32, 48]" in msg
    assert "wrong shape for model.layers.layers.0.mixer.conv1d.weight: [32, 4], expected [32, 1, 4]" in msg
    assert "wrong dtype for model.norm.weight" in msg


def test_tied_checkpoint_with_lm_head_is_unexpected(tmp_path: Path, tensors: Tensors) -> None:
    tied = Plamo2Config.from_dict(preset_raw("tiny-edge", tie_word_embeddings=True))
    with HFCheckpoint(write_dir(tmp_path, tied, {"model.safetensors": tensors})) as ckpt:
        assert ckpt.inventory_problems() == ["unexpected tensor lm_head.weight [304, 48]"]


# ---- HF index -------------------------------------------------------------------------------
def test_index_pointing_to_missing_file(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    files, index = split(tensors, 3)
    path = write_dir(tmp_path, cfg, files, index)
    (path / "model-00002-of-00003.safetensors").unlink()
    msg = open_error(path)
    assert "missing file" in msg and "model-00002-of-00003.safetensors" in msg


def test_index_disagreeing_with_files(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    files, index = split(tensors, 2)
    wm = index["weight_map"]
    moved = "model.norm.weight"
    wm[moved] = next(f for f in files if f != wm[moved])  # index names the wrong file
    dropped = "model.embed_tokens.weight"
    del wm[dropped]  # in a file, but not in the index
    wm["model.ghost.weight"] = wm[moved]  # in the index, in no file
    msg = open_error(write_dir(tmp_path, cfg, files, index))
    assert moved in msg and dropped in msg and "model.ghost.weight" in msg


def test_duplicate_tensor_in_two_files(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    files, index = split(tensors, 2)
    first, second = list(files)
    dup = next(iter(files[first]))
    files[second][dup] = files[first][dup]
    msg = open_error(write_dir(tmp_path, cfg, files, index))
    assert dup in msg and "also appears" in msg


@pytest.mark.parametrize("text", ["{nope", "[]", '{"metadata": {}}', '{"weight_map": [1]}'])
def test_corrupt_index(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors, text: str) -> None:
    path = write_dir(tmp_path, cfg, {"model.safetensors": tensors})
    (path / "model.safetensors.index.json").write_text(text)
    assert "index" in open_error(path)


def test_several_files_without_index(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    files, _ = split(tensors, 2)
    assert "no model.safetensors" in open_error(write_dir(tmp_path, cfg, files))


def test_no_weights_at_all(tmp_path: Path, cfg: Plamo2Config) -> None:
    assert "no model.safetensors" in open_error(write_dir(tmp_path, cfg, {}))


def test_not_a_directory(tmp_path: Path) -> None:
    assert "not a directory" in open_error(tmp_path / "nowhere")


def test_missing_config_is_a_config_error(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> None:
    path = write_dir(tmp_path, cfg, {"model.safetensors": tensors})
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="not found"):
        HFCheckpoint(path)


# ---- broken files ---------------------------------------------------------------------------
@pytest.fixture
def good(tmp_path: Path, cfg: Plamo2Config, tensors: Tensors) -> Path:
    return write_dir(tmp_path / "good", cfg, {"model.safetensors": tensors})


def header_of(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def rewrite_header(path: Path, header: dict, pad_to: int | None = None) -> None:
    """Replace the header, keeping the payload bytes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(header).encode()
    text += b" " * ((pad_to or len(text)) - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -1, -100])
def test_truncated_file(good: Path, keep: int) -> None:
    f = good / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    assert "truncated" in open_error(good)


def test_trailing_garbage(good: Path) -> None:
    with open(good / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    assert "corrupt" in open_error(good)


@pytest.mark.parametrize(
    "damage",
    [
        "not_json",
        "huge_length",
        "not_object",
        "no_dtype",
        "unknown_dtype",
        "bad_shape",
        "offsets_mismatch",
        "overlap",
        "hole",
    ],
)
def test_corrupt_header(good: Path, damage: str) -> None:
    f = good / "model.safetensors"
    n, header = header_of(f)
    name = next(k for k in header if k != "__metadata__")
    entry = header[name]
    if damage == "not_json":
        data = bytearray(f.read_bytes())
        data[8 : 8 + n] = b"{" + b"\xff" * (n - 1)
        f.write_bytes(bytes(data))
    elif damage == "huge_length":
        data = bytearray(f.read_bytes())
        data[:8] = struct.pack("<Q", 2**62)
        f.write_bytes(bytes(data))
    elif damage == "not_object":
        data = bytearray(f.read_bytes())
        data[8 : 8 + n] = b"[" + b" " * (n - 2) + b"]"
        f.write_bytes(bytes(data))
    else:
        if damage == "no_dtype":
            del entry["dtype"]
        elif damage == "unknown_dtype":
            entry["dtype"] = "F7"
        elif damage == "bad_shape":
            entry["shape"] = "big"
        elif damage == "offsets_mismatch":
            entry["data_offsets"][1] += 4
        else:
            others = sorted((v["data_offsets"] for k, v in header.items() if k != "__metadata__"))
            shift = -4 if damage == "overlap" else 4
            # Move the last tensor's payload window: it now overlaps its neighbour or leaves a hole.
            last = next(v for k, v in header.items() if k != "__metadata__" and v["data_offsets"] == others[-1])
            last["data_offsets"] = [o + shift for o in last["data_offsets"]]
        rewrite_header(f, header, pad_to=n)
    assert "corrupt" in open_error(good)


@pytest.mark.parametrize("seed", range(40))
def test_random_header_damage_never_escapes(good: Path, seed: int) -> None:
    """Whatever a flipped byte does to the header, the result is a clean read or a CheckpointError,
    never another exception (which the CLI would show as a traceback)."""
    f = good / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    rng = random.Random(seed)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(0, 8 + n)
        data[pos] = rng.choice([rng.randrange(256), ord("9"), ord("-"), ord('"'), ord("]")])
    f.write_bytes(bytes(data))
    try:
        with HFCheckpoint(good) as ckpt:
            ckpt.inventory_problems()
    except CheckpointError:
        pass
