"""plamo2-tools: convert, check, run, serve and evaluate PLaMo 2 and PLaMo 3 checkpoints.

The library API (docs/api.md), in the spirit of mlx-lm's ``from mlx_lm import load, generate``::

    from plamo2_tools import convert, load, generate
    convert("plamo-2-1b", "plamo-2-1b-tp2", tp=2)
    with load("plamo-2-1b-tp2") as rt:
        print(generate(rt, "The capital of Japan is", max_new_tokens=16))

Every name is imported on first use (module ``__getattr__``), so ``import plamo2_tools``, ``--help``
and the commands that only move bytes never load PyTorch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from .version import __version__

# name -> the module that holds it.  The functions are thin, documented wrappers (`api.py`);
# `Runtime` is the loaded model `load` returns.
_HOMES = {
    "load": ".api",
    "generate": ".api",
    "score": ".api",
    "convert": ".api",
    "check": ".api",
    "verify": ".api",
    "eval": ".api",
    "export": ".api",
    "Score": ".api",
    "Runtime": ".runtime.batching.engine",
}
__all__ = ["__version__", *_HOMES]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


class _Face(types.ModuleType):
    """`convert`, `verify` and `eval` are also the names of a subpackage or module of the package.
    Python binds a submodule to its parent's attribute when it is first imported, which would make
    `from plamo2_tools import verify` the module once anything had imported `plamo2_tools.verify`;
    the face keeps its functions (the modules stay importable by their full names:
    `from plamo2_tools.convert import engine`, `from plamo2_tools.verify import compare`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOMES.get(name) == ".api":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
