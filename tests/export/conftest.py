"""Fixtures of the export tests (`mlx`-marked tests skip where mlx or mlx-lm is missing: the
[mlx] extra; tests/conftest.py): `plamo_checkpoint` makes synthetic checkpoints of a preset with
config overrides (a wide window, another RoPE base) that the presets do not have."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# A stand-in for PFN's tokenization_plamo.py (which needs numba and is not shipped with synthetic
# checkpoints): the class mlx_lm.load's AutoTokenizer(trust_remote_code=True) imports from the
# directory, here our native tokenizer under PFN's class names.
TOKENIZER_SHIM = """from plamo2_tools.tokenizer.hf import PlamoTokenizerNative


class Plamo2Tokenizer(PlamoTokenizerNative):
    pass


class Plamo3Tokenizer(PlamoTokenizerNative):
    pass
"""

MakeCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def plamo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """plamo_checkpoint(preset, dtype=None, shim=False, **overrides) -> an HF checkpoint written
    once per session: synth's values for the preset's config with `overrides` applied, its
    tokenizer, and (shim=True) TOKENIZER_SHIM as tokenization_plamo.py."""
    from plamo2_tools.dtypes import FLOAT_DTYPES
    from plamo2_tools.model.registry import config_from_dict, family_of_preset
    from plamo2_tools.model.synth import random_tensor, write_checkpoint

    cache: dict[str, Path] = {}

    def make(preset: str, dtype: str | None = None, shim: bool = False, **overrides: Any) -> Path:
        key = json.dumps([preset, dtype, shim, overrides], sort_keys=True)
        if key not in cache:
            raw = {**family_of_preset(preset).preset_raw(preset), **overrides}
            cfg = config_from_dict(raw)
            path = tmp_path_factory.mktemp(f"{preset}-x") / "ckpt"
            name = dtype or raw.get("torch_dtype", "float32")
            write_checkpoint(path, cfg, lambda n, s: random_tensor(cfg, n, s, 0), FLOAT_DTYPES[name])
            if shim:
                (path / "tokenization_plamo.py").write_text(TOKENIZER_SHIM)
            cache[key] = path
        return cache[key]

    return make
