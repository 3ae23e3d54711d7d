"""The variant seam (docs/architecture.md, "Add a model variant"): every PLaMo 2 family member
this code runs, keyed by its config.  A variant names what differs from plain PLaMo 2; the code
that implements a difference asks the config (e.g. `Plamo2Config.rope_base`), so adding a variant
is an entry here, its config keys in `config.py`, its presets in `synth.py`, and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import Plamo2Config
from .tensors import TENSORS, TensorKind


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    matches: Callable[[Plamo2Config], bool]
    differences: tuple[str, ...] = ()  # what differs from plain PLaMo 2, for `inspect` and docs
    tensors: tuple[TensorKind, ...] = TENSORS


PLAMO2 = Variant(
    "plamo2",
    "PLaMo 2 (plamo-2-1b, plamo-2-8b, plamo-2-translate)",
    matches=lambda cfg: True,
)
PLAMO2_1 = Variant(
    "plamo2.1",
    "PLaMo 2.1 (plamo-2.1-2b-cpt, plamo-2.1-8b-cpt, the language model of plamo-2.1-*-vl)",
    matches=lambda cfg: cfg.rope_local_theta is not None,
    differences=("RoPE base per layer: rope_theta on full_attention_idx layers, rope_local_theta on the others",),
)
# Most specific first: the first match wins.
VARIANTS: tuple[Variant, ...] = (PLAMO2_1, PLAMO2)


def detect_variant(cfg: Plamo2Config) -> Variant:
    return next(v for v in VARIANTS if v.matches(cfg))
