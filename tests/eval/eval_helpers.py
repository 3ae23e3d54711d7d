"""Helpers shared by the evaluation tests (imported as a top-level module, like convert_expect)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plamo2_tools.runtime.batching.engine import Generation, Runtime

MINI_GSM8K = Path(__file__).parent / "data" / "gsm8k_mini"  # self-written 6 train + 4 test problems


class SpyRuntime:
    """A runtime that records each generate() call: (prompts, max_new_tokens, kwargs, tokens)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.calls: list[tuple[list[list[int]], int, dict[str, Any], list[list[int]]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, **kwargs: Any) -> Generation:
        gen = self._runtime.generate(prompts, max_new_tokens, **kwargs)
        self.calls.append(([list(p) for p in prompts], max_new_tokens, kwargs, gen.tokens))
        return gen
