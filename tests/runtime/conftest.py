"""Fixtures for the runtime tests: fresh prompts per tiny preset and the reference forward's outputs,
computed once per preset.  The model of every runtime test is synth's checkpoint of the preset with
seed 11 (`checkpoint(preset, seed=11)`), run as `shards(preset, tp, pp, seed=11)` (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from plamo2_tools.model.synth import preset_config
from plamo2_tools.verify import random_prompts, reference_outputs

GREEDY_STEPS = 32


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[list[int]]]:
    """Fresh random prompts per preset, longer than every preset's attention window (6-12)."""
    seeds = {"tiny": 101, "tiny-gqa": 202, "tiny-edge": 303, "tiny-2.1": 404}
    return {p: random_prompts(3, preset_config(p).vocab_size, seed=s, lengths=(5, 40)) for p, s in seeds.items()}


@pytest.fixture(scope="session")
def reference(checkpoint, prompts: dict[str, list[list[int]]]):
    cache = {}

    def get(preset: str):
        if preset not in cache:
            cache[preset] = reference_outputs(checkpoint(preset, seed=11), prompts[preset], GREEDY_STEPS, torch.float64)
        return cache[preset]

    return get
