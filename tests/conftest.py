"""Shared pytest setup: the ``gpu`` marker, and Triton's CPU interpreter when there is no GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
