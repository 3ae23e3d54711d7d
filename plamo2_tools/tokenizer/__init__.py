"""PLaMo's own tokenizer, natively: ``tokenizer.jsonl`` read and run exactly as PLaMo 2's and PLaMo 3's
code does, without remote code or numba (docs/tokenizer.md).

Names are imported on first use, so ``write_synthetic_tokenizer`` (used by synth) does not pull in
transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Plamo3Cuts": ".plamo3",
    "PlamoEncoder": ".encoder",
    "PlamoTokenizerNative": ".hf",
    "has_plamo_vocab": ".loader",
    "load_native": ".loader",
    "load_tokenizer": ".loader",
    "plamo_family_of": ".hf",
    "synthetic_rows": ".synthetic",
    "write_synthetic_tokenizer": ".synthetic",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
