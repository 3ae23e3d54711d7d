"""Fixtures for the convert / merge / check tests: synthetic checkpoints (cached per session) and
the real CLI run in-process.  Helpers that compute expectations live in convert_expect.py."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from convert_expect import Watermark
from typer.testing import Result

from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.model.synth import preset_config, random_tensor, write_checkpoint

Cli = Callable[..., Result]
MakeCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """An HF checkpoint of a tiny preset, written once per (preset, values, dtype, files).

    values="watermark" (default): every element encodes its own coordinates (see Watermark);
    values="random": synth's healthy random values (what the dtype/rounding tests need).
    Tests that modify a checkpoint must copy it first (`copy_checkpoint`).
    """
    cache: dict[tuple, Path] = {}

    def make(preset: str, values: str = "watermark", dtype: torch.dtype = torch.float32, files: int = 1) -> Path:
        key = (preset, values, dtype, files)
        if key not in cache:
            cfg = preset_config(preset)
            fn = Watermark(cfg) if values == "watermark" else (lambda n, s: random_tensor(cfg, n, s, seed=1))
            path = tmp_path_factory.mktemp(f"{preset}-{values}-{str(dtype)[6:]}-{files}") / "ckpt"
            write_checkpoint(path, cfg, fn, dtype, files=files, tokenizer=False)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a cached checkpoint, safe to damage."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "src"
        shutil.copytree(src, dst)
        return dst

    return copy


# Big enough (68 MB, 8 layers, V=32000) that a conversion split into ~50 files of <= 1 MB takes
# about a second on a 2-core CI machine: time to SIGKILL it after its first files are finished.
MEDIUM = dict(
    model_type="plamo2", hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
    hidden_size_per_head=64, mamba_d_state=16, mamba_d_conv=4, mamba_num_heads=8, mamba_step=2,
    intermediate_size=1024, vocab_size=32000,
)  # fmt: skip


@pytest.fixture(scope="session")
def medium_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = Plamo2Config.from_dict(MEDIUM)

    def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    path = tmp_path_factory.mktemp("medium") / "ckpt"
    write_checkpoint(path, cfg, values, torch.float32, tokenizer=False)
    return path
