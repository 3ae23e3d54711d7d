"""Fixtures for the runtime tests: one synthetic checkpoint per tiny preset, converted on demand,
and the reference forward's outputs computed once per preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plamo2_tools.convert.engine import convert
from plamo2_tools.model.synth import preset_config, synth
from plamo2_tools.verify import random_prompts, reference_outputs

GREEDY_STEPS = 32


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {p: _synth(root / p, p) for p in ("tiny", "tiny-gqa", "tiny-edge", "tiny-2.1")}


def _synth(path: Path, preset: str) -> Path:
    synth(path, preset, seed=11)
    return path


class Shards:
    """Converts a preset to a layout the first time a test asks for it."""

    def __init__(self, root: Path, checkpoints: dict[str, Path]) -> None:
        self.root, self.checkpoints = root, checkpoints

    def __call__(self, preset: str, tp: int, pp: int, dtype: str = "auto") -> Path:
        out = self.root / f"{preset}-tp{tp}-pp{pp}-{dtype}"
        if not (out / "plamo2_shards.json").exists():
            convert(self.checkpoints[preset], out, tp=tp, pp=pp, dtype=dtype)
        return out


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> Shards:
    return Shards(tmp_path_factory.mktemp("shards"), checkpoints)


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[list[int]]]:
    """Fresh random prompts per preset, longer than every preset's attention window (6-12)."""
    seeds = {"tiny": 101, "tiny-gqa": 202, "tiny-edge": 303, "tiny-2.1": 404}
    return {p: random_prompts(3, preset_config(p).vocab_size, seed=s, lengths=(5, 40)) for p, s in seeds.items()}


@pytest.fixture(scope="session")
def reference(checkpoints: dict[str, Path], prompts: dict[str, list[list[int]]]):
    cache = {}

    def get(preset: str):
        if preset not in cache:
            cache[preset] = reference_outputs(checkpoints[preset], prompts[preset], GREEDY_STEPS, torch.float64)
        return cache[preset]

    return get
