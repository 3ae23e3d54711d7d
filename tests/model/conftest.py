"""Fixtures for the model tests: checkpoints of any config (not only a preset's), with synth's values.
The presets' checkpoints come from the session cache (`checkpoint`, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.model.synth import random_tensor, write_checkpoint


@pytest.fixture
def custom_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """custom_checkpoint(raw_config, seed) -> a checkpoint with synth's values for any config."""

    def make(raw: dict[str, Any], seed: int = 0, files: int = 1) -> Path:
        cfg = Plamo2Config.from_dict(raw, "custom")
        path = tmp_path / f"custom-{seed}"
        write_checkpoint(
            path, cfg, lambda n, s: random_tensor(cfg, n, s, seed), torch.float32, files=files, tokenizer=False
        )
        return path

    return make
