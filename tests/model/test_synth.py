"""Synthetic checkpoints: determinism, the multi-file index, numerical health and the tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import independent as ind
import pytest
import torch
from model_helpers import Checkpoint
from safetensors import safe_open

from plamo2_tools.errors import OutputExistsError, UserError
from plamo2_tools.model import hf_tensor_shapes, num_parameters
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.model.plamo2.presets import TINY_PRESETS
from plamo2_tools.model.synth import preset_config, synth
from plamo2_tools.outputs import RECORD_NAME
from plamo2_tools.tokenizer import load_tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.jsonl",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    return ind.load(path, torch.float32).weights


# ---- determinism --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_same_seed_same_bytes(tmp_path: Path, checkpoint: Checkpoint, preset: str) -> None:
    again = tmp_path / "again"
    synth(again, preset, seed=0)
    assert file_bytes(again) == file_bytes(checkpoint(preset, 0))
    assert sorted(file_bytes(again)) == sorted((*FILES, RECORD_NAME))  # + the record of what synth wrote


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_other_seed_changes_every_tensor(checkpoint: Checkpoint, preset: str) -> None:
    a, b = checkpoint(preset, 0), checkpoint(preset, 1)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    ta, tb = all_tensors(a), all_tensors(b)
    assert ta.keys() == tb.keys()
    same = [n for n in ta if torch.equal(ta[n], tb[n])]
    assert same == []


def test_existing_output_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "x"
    synth(out, "tiny-edge", seed=0)
    before = file_bytes(out)
    with pytest.raises(OutputExistsError):
        synth(out, "tiny-edge", seed=1)
    assert file_bytes(out) == before  # refused without touching anything
    synth(out, "tiny-edge", seed=1, force=True)
    after = file_bytes(out)
    assert after.keys() == before.keys() and after["model.safetensors"] != before["model.safetensors"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "plamo-2-2b"}, "unknown preset"),
        ({"preset": "tiny", "dtype": "float8"}, "unknown dtype"),
        ({"preset": "tiny", "files": 0}, "files"),
        ({"preset": "tiny", "files": 57}, "files"),  # tiny has 56 tensors
    ],
)
def test_bad_requests(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        synth(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_unknown_dtype_rejected_by_preset_config() -> None:
    # The CLI calls preset_config() before synth(); a KeyError there used to escape as a traceback.
    with pytest.raises(UserError, match="unknown dtype"):
        preset_config("tiny", "float8")


# ---- multi-file checkpoints and dtypes ------------------------------------------------------
def test_multi_file_index(checkpoint: Checkpoint) -> None:
    path = checkpoint("tiny-gqa", 0, files=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    cfg = Plamo2Config.from_file(path)
    shapes = hf_tensor_shapes(cfg)
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in path.glob("*.safetensors")) == names
    assert set(index["weight_map"]) == set(shapes)
    assert set(index["weight_map"].values()) == set(names)
    total = 0
    for name in names:
        with safe_open(path / name, framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == name}
            total += sum(f.get_tensor(k).nbytes for k in keys)
    assert index["metadata"]["total_size"] == total == 4 * num_parameters(cfg)
    # The split changes the files, not the values.
    single = all_tensors(checkpoint("tiny-gqa", 0))
    split = all_tensors(path)
    assert single.keys() == split.keys() and all(torch.equal(single[k], split[k]) for k in single)
    with HFCheckpoint(path) as ckpt:
        assert ckpt.inventory_problems() == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_other_dtypes(checkpoint: Checkpoint, dtype: str) -> None:
    path = checkpoint("tiny", 0, dtype=dtype)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == dtype
    with HFCheckpoint(path) as ckpt:
        assert {str(info.dtype) for info in ckpt.tensors.values()} == {dtype}
        assert ckpt.inventory_problems() == []
        f32 = all_tensors(checkpoint("tiny", 0))
        for name in ("model.embed_tokens.weight", "model.layers.layers.0.mixer.A_log"):
            assert torch.equal(ckpt.get(name), f32[name].to(getattr(torch, dtype)))


# ---- numerical health -----------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_values_are_numerically_healthy(checkpoint: Checkpoint, preset: str) -> None:
    path = checkpoint(preset, 5)
    m = ind.load(path)
    V, window = m.raw["vocab_size"], m.get("attention_window_size")
    tokens = torch.randint(0, V, (2 * window + 6,), generator=torch.Generator().manual_seed(0)).tolist()
    hs = ind.hidden_states(m, tokens)
    logits = ind.logits(m, tokens)
    # Logits: finite, of ordinary size, not collapsed onto one token.
    assert torch.isfinite(logits).all()
    std = logits.std(-1)
    assert std.min() > 0.3 and std.max() < 3 and logits.abs().max() < 30
    assert len(set(logits.argmax(-1).tolist())) > 1
    # The residual stream stays at unit-ish scale through the layers.
    for h in hs:
        r = h.pow(2).mean(-1).sqrt()
        assert r.min() > 0.01 and r.max() < 10
    # Delta = softplus(dt + dt_bias): positive, neither frozen nor wiping the state every step.
    delta = torch.cat([d.flatten() for d in m.stats["delta"]])
    assert delta.min() > 1e-4 and delta.max() < 1.0
    # A = -exp(A_log) is negative, within Mamba2's init range [-16, -1].
    A = torch.cat(m.stats["A"])
    assert (A < 0).all() and A.min() >= -16 - 1e-9 and A.max() <= -1 + 1e-9
    # Attention is neither uniform nor one-hot: the mean normalised entropy over queries with at
    # least 4 keys is well inside (0, 1).
    for p in m.stats["attention_probs"]:
        n = (p > 0).sum(-1)
        ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
        ratio = (ent / n.double().log())[n >= 4]
        assert 0.3 < ratio.mean() < 0.95
        assert ratio.max() < 0.999


# ---- tokenizer ------------------------------------------------------------------------------
TEXTS = [
    "Hello, world!",
    "PLaMo 2 は日本語も扱えます。",
    "emoji 🎉🦀 and ünïcödé, 中文, 한국어",
    "  leading spaces, tabs\tand\nnewlines  ",
    "<|plamo:bos|> is just text here",
    "\x00\x7f control chars",
    "",
]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tokenizer_loads_without_remote_code(checkpoint: Checkpoint, preset: str) -> None:
    path = checkpoint(preset, 0)
    tok = load_tokenizer(path)  # PLaMo's tokenizer.jsonl, run natively
    assert type(tok).__name__ == "PlamoTokenizerNative"
    V = preset_config(preset).vocab_size
    assert len(tok) == V
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 3, 0)
    assert tok.convert_ids_to_tokens(4) == "<|plamo:op|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1  # BOS added, like add_bos_token = true
        assert all(0 <= i < V for i in ids)
        assert tok.decode(ids[1:]) == text  # special-token text encodes as the special token
    # Any id the model can sample decodes to something.
    assert all(isinstance(tok.decode([i]), str) for i in range(V))
    batch = tok(["a", "longer text"], padding=True)
    assert batch["input_ids"][0][-1] == 3 or batch["input_ids"][0][0] == 3  # padded with id 3


def test_tokenizer_needs_room_for_bytes(tmp_path: Path) -> None:
    from plamo2_tools.model.synth import write_tokenizer

    with pytest.raises(UserError, match="263"):
        write_tokenizer(tmp_path, 262)  # 7 control tokens + 256 byte tokens
    write_tokenizer(tmp_path, 263)
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("ok ✓"), skip_special_tokens=True) == "ok ✓"


def test_parameter_count_matches_files(checkpoint: Checkpoint) -> None:
    for preset in TINY_PRESETS:
        cfg = preset_config(preset)
        size = (checkpoint(preset, 0) / "model.safetensors").stat().st_size
        # header + 4 bytes per parameter
        assert 0 < size - 4 * num_parameters(cfg) < 64 * 1024
        assert math.prod(hf_tensor_shapes(cfg)["model.embed_tokens.weight"]) == cfg.vocab_size * cfg.hidden_size
