"""Shared pytest setup: Triton's CPU interpreter and skipping ``gpu`` tests without a GPU.

(The ``gpu`` marker itself is registered in pyproject.toml.)
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
