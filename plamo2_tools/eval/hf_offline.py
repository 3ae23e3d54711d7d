"""A job-local, offline Hugging Face environment for evaluation runs.

Offline so that nothing is fetched behind our back (the stock Hub-backed gsm8k then fails fast
instead of silently evaluating other data), and a private cache so that runs neither read nor
pollute ~/.cache/huggingface.

huggingface_hub and datasets read these variables once, at import.  A fresh process (the CLI, a
torchrun rank) gets them from the environment; inside a process that already imported them (tests,
lm-eval's CLI) `hf_offline` also sets the module-level copies, and puts everything back afterwards.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def offline_env(cache_root: str | Path) -> dict[str, str]:
    """Environment variables of an offline run whose caches live under `cache_root`."""
    root = Path(cache_root)
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "HF_DATASETS_CACHE": str(root / "datasets"),
    }


def _module_settings(root: Path) -> list[tuple[str, str, Any]]:
    """(module, attribute, value) copies that were computed from the environment at import."""
    datasets_cache = root / "datasets"
    return [
        ("huggingface_hub.constants", "HF_HUB_OFFLINE", True),
        ("datasets.config", "HF_HUB_OFFLINE", True),
        ("datasets.config", "HF_DATASETS_OFFLINE", True),
        ("datasets.config", "HF_DATASETS_CACHE", datasets_cache),
        ("datasets.config", "DOWNLOADED_DATASETS_PATH", datasets_cache / "downloads"),
        ("datasets.config", "EXTRACTED_DATASETS_PATH", datasets_cache / "downloads" / "extracted"),
        ("datasets.config", "HF_MODULES_CACHE", root / "hf-home" / "modules"),
    ]


@contextmanager
def hf_offline(cache_root: str | Path) -> Iterator[dict[str, str]]:
    """Run the body offline with caches under `cache_root`; yields the environment it set."""
    root = Path(cache_root)
    env = offline_env(root)
    saved_env = {k: os.environ.get(k) for k in env}
    saved_attrs: list[tuple[Any, str, Any]] = []
    os.environ.update(env)
    for module_name, attr, value in _module_settings(root):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            saved_attrs.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
    try:
        yield env
    finally:
        for module, attr, old in reversed(saved_attrs):
            setattr(module, attr, old)
        for k, old_value in saved_env.items():
            if old_value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old_value
