"""Fixtures for the kernel tests: the backend/dtype matrix and output poisoning."""

from __future__ import annotations

import pytest
import torch
from kernel_matrix import INTERPRETED

from plamo2_tools.kernels import get_ops

# The interpreter multiplies bf16 bit patterns in tl.dot, so it gets fp16 instead.
CASES = [
    ("torch", torch.float32),
    ("torch", torch.bfloat16),
    ("triton", torch.float32),
    ("triton", torch.float16 if INTERPRETED else torch.bfloat16),
]


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def case(request: pytest.FixtureRequest):
    """(ops, activation dtype) for every backend."""
    backend, dtype = request.param
    return get_ops(backend), dtype


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float tensor from torch.empty / empty_like starts as NaN, so unwritten output shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def alloc(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return alloc

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))
