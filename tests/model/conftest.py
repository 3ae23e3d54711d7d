"""Fixtures for the foundation tests: synthetic checkpoints (cached per session, never mutated by a
test: tests that break a checkpoint copy it first), custom-config checkpoints, and a CLI runner."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from plamo2_tools.cli import app
from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.model.plamo2.presets import PRESETS
from plamo2_tools.model.synth import random_tensor, synth, write_checkpoint

MakeCkpt = Callable[..., Path]


def preset_raw(name: str, **overrides: Any) -> dict[str, Any]:
    """A preset as a raw config.json dict, with overrides (None removes a key)."""
    raw = {"model_type": "plamo2", **PRESETS[name], **overrides}
    return {k: v for k, v in raw.items() if v is not None}


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> MakeCkpt:
    """make_ckpt(preset, seed=0, files=1, dtype=None) -> a synth checkpoint dir, shared read-only."""
    cache: dict[tuple[str, int, int, str | None], Path] = {}

    def make(preset: str, seed: int = 0, files: int = 1, dtype: str | None = None) -> Path:
        key = (preset, seed, files, dtype)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{preset}-s{seed}-f{files}-{dtype}") / "ckpt"
            synth(path, preset, seed=seed, files=files, dtype=dtype)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture
def custom_ckpt(tmp_path: Path) -> Callable[..., Path]:
    """custom_ckpt(raw_config, seed) -> a checkpoint with synth's values for any config."""

    def make(raw: dict[str, Any], seed: int = 0, files: int = 1) -> Path:
        cfg = Plamo2Config.from_dict(raw, "custom")
        path = tmp_path / f"custom-{seed}"
        write_checkpoint(
            path, cfg, lambda n, s: random_tensor(cfg, n, s, seed), torch.float32, files=files, tokenizer=False
        )
        return path

    return make


@pytest.fixture
def copy_ckpt(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a cached checkpoint, for tests that damage it."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(src, dst)
        return dst

    return copy


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """Run `plamo2-tools ARGS` in process; a wide terminal so Rich does not wrap table cells."""
    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})

    def run(*args: str | Path) -> CliResult:
        r = runner.invoke(app, [str(a) for a in args])
        # SystemExit is how Typer/Click exit; anything else escaped the CLI's error handling.
        exc = None if isinstance(r.exception, SystemExit) else r.exception
        return CliResult(r.exit_code, r.stdout, r.stderr, exc)

    return run


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spinning threads slow these tests down several times; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
