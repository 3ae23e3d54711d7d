"""Fixtures for the evaluation tests: one tiny synthetic model as TP1xPP1 and TP2xPP2 shards (from
the session cache of tests/conftest.py), in-process runtimes over both, the plamo2 lm-eval model
around them, and the self-written mini-GSM8K fixture (tests/eval/data/gsm8k_mini, real JSONL
schema, not GSM8K data)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from eval_helpers import MINI_GSM8K, SpyRuntime

from plamo2_tools.eval.gsm8k_task import Gsm8kData, load_gsm8k_data
from plamo2_tools.eval.plamo2_lm import PlamoLM
from plamo2_tools.runtime.batching.engine import Runtime


@pytest.fixture(scope="session")
def shard_dirs(shards) -> dict[str, Path]:
    """The same random tiny model (synth seed 5) as TP1xPP1 ("tp1pp1") and TP2xPP2 ("tp2pp2") shards."""
    return {f"tp{tp}pp{pp}": shards("tiny", tp, pp, seed=5) for tp, pp in ((1, 1), (2, 2))}


@pytest.fixture(scope="session")
def runtimes(shard_dirs: dict[str, Path]) -> dict[str, Runtime]:
    """In-process runtimes (ranks as threads), loaded once per layout."""
    return {name: Runtime(path, mode="local") for name, path in shard_dirs.items()}


@pytest.fixture(scope="session")
def runtime(runtimes: dict[str, Runtime]) -> Runtime:
    return runtimes["tp1pp1"]


MakeLM = Callable[..., PlamoLM]


@pytest.fixture(scope="session")
def make_lm(runtimes: dict[str, Runtime], shard_dirs: dict[str, Path]) -> MakeLM:
    """PlamoLM over a shared runtime; keyword arguments go to the constructor."""

    def make(layout: str = "tp1pp1", runtime: Any = None, **kwargs: Any) -> PlamoLM:
        rt = runtime if runtime is not None else runtimes[layout]
        return PlamoLM(pretrained=str(shard_dirs[layout]), runtime=rt, **kwargs)

    return make


@pytest.fixture(scope="session")
def mini_data() -> Gsm8kData:
    return load_gsm8k_data(MINI_GSM8K, allow_unverified=True)


@pytest.fixture
def spy(runtime: Runtime) -> SpyRuntime:
    return SpyRuntime(runtime)
