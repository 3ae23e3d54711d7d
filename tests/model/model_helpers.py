"""Helpers shared by the model tests (imported as a top-level module, like convert_expect)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from plamo2_tools.model.plamo2.presets import PRESETS

Checkpoint = Callable[..., Path]  # the `checkpoint` fixture of tests/conftest.py


def preset_raw(name: str, **overrides: Any) -> dict[str, Any]:
    """A preset as a raw config.json dict, with overrides (None removes a key)."""
    raw = {"model_type": "plamo2", **PRESETS[name], **overrides}
    return {k: v for k, v in raw.items() if v is not None}
