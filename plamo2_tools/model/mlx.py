"""What a family looks like to mlx-lm (docs/export.md, "MLX"): the model-independent half.

mlx-lm loads a directory of `model*.safetensors` and a `config.json` into its own model class for
the config's `model_type` (`mlx_lm/models/<model_type>.py`), after that class's `sanitize`; every
`nn.Linear` / `nn.Embedding` whose `<path>.scales` is present is rebuilt quantized (mode "affine"
unless the config says otherwise; a per-module entry in `config["quantization"]` overrides the
default, `false` keeps a module unquantized).  A family says, in `model/<family>/mlx.py`, one
row per row of its own tensor table (`mlx_table` refuses a row the family does not have and
fills in every one it leaves out):

* whether the tensor is the weight of such a module (quantizable), and its precision under
  `--mixed`: `BULK` (the --bits of the export), `BASE` (8 bits) or `KEEP` (unquantized);
* the shape mlx-lm's module holds when it is not the HF one (same bytes, row-major);
* how many leading rows mlx-lm's module holds when the HF tensor is padded;

plus the config keys mlx-lm reads and what its model computes differently from our reference
(`Difference`), so an export can say it before anyone runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .layout import TensorKind

BULK, BASE, KEEP = "bulk", "base", "keep"  # precision under --mixed: --bits, 8 bits, unquantized
MIXED_BASE_BITS = 8


@dataclass(frozen=True)
class MLXTensor:
    hf: str  # the family table's HF name (layer-relative for per-layer rows)
    linear: bool = False  # the weight of an nn.Linear / nn.Embedding: mlx-lm quantizes it
    mixed: str = BASE
    shape: Callable[[Any], tuple[int, ...]] | None = None  # mlx-lm's shape, when it is not the HF one
    rows: Callable[[Any], int] | None = None  # mlx-lm holds only these leading rows (a padded HF head)


@dataclass(frozen=True)
class Difference:
    """Something mlx-lm computes differently from the reference for a given config."""

    key: str  # short name: "rope_base", "sliding_window", ...
    text: str  # one sentence for the report
    from_position: int | None = None  # the first teacher-forced position it can change (None: unknown)


@dataclass(frozen=True)
class MLXLayout:
    model_type: str  # mlx-lm's module: mlx_lm/models/<model_type>.py
    tensors: dict[str, MLXTensor]  # by the family table's HF name
    config: Callable[[dict[str, Any], Any], dict[str, Any]]  # (raw config.json, typed config) -> mlx-lm's config
    differences: Callable[[Any], list[Difference]]  # typed config -> what mlx-lm does differently
    mlx_lm_version: str  # the mlx-lm whose model file the layout was read from


def mlx_table(
    table: Iterable[TensorKind],
    linear: dict[str, str],
    shapes: dict[str, Callable[[Any], tuple[int, ...]]] | None = None,
    rows: dict[str, Callable[[Any], int]] | None = None,
) -> dict[str, MLXTensor]:
    """One MLXTensor per row of the family's table; `linear` maps the quantizable weights to their
    --mixed precision.  A name that is not a row of the table is a bug in the family's file."""
    kinds = [t.hf for t in table]
    shapes, rows = shapes or {}, rows or {}
    unknown = (set(linear) | set(shapes) | set(rows)) - set(kinds)
    if unknown:
        raise ValueError(f"MLX table names tensors the family does not have: {sorted(unknown)}")
    return {hf: MLXTensor(hf, hf in linear, linear.get(hf, BASE), shapes.get(hf), rows.get(hf)) for hf in kinds}
