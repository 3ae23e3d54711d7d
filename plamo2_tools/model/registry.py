"""The families this package runs, and the one place that tells which family a config belongs to.

`FAMILIES` lists them in detection order (one line per family).  Everything downstream goes
through here: `load_config(path)` / `config_from_dict(raw)` dispatch on config.json's
`model_type` (else its `architectures`), `family_of(cfg)` gives the family of a typed config, and
the inventory helpers ask that family's table through the layout engine.  `register()` adds a
family defined elsewhere (the toy family of tests/model/test_family_seam.py does).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, Plamo2Error
from ..jsonio import CONFIG_BYTES, read_json
from . import layout
from .family import Family
from .plamo2 import FAMILY as PLAMO2
from .plamo3 import FAMILY as PLAMO3

FAMILIES: list[Family] = [PLAMO2, PLAMO3]


def register(family: Family) -> Family:
    """Add a family (a later registration of the same name replaces the earlier one)."""
    FAMILIES[:] = [f for f in FAMILIES if f.name != family.name] + [family]
    return family


def unregister(name: str) -> None:
    FAMILIES[:] = [f for f in FAMILIES if f.name != name]


def family_named(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ConfigError(f"unknown model family {name!r} (this plamo2-tools knows {', '.join(known_families())})")


def known_families() -> list[str]:
    return [f.name for f in FAMILIES]


def family_for(raw: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a raw config.json: the first whose model_type (else architectures) matches."""
    for f in FAMILIES:
        if f.matches(raw):
            return f
    what = (
        f"model_type is {raw['model_type']!r}" if "model_type" in raw else f"architectures {raw.get('architectures')!r}"
    )
    readable = ", ".join(mt for f in FAMILIES for mt in f.model_types[:1])
    raise ConfigError(f"{source}: {what}, which plamo2-tools does not read (it reads {readable})")


def family_of(cfg: Any) -> Family:
    """The family of a typed config (by its class)."""
    for f in FAMILIES:
        if isinstance(cfg, f.config_class):
            return f
    raise TypeError(f"{type(cfg).__name__} is not the config of a registered family")


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> Any:
    return family_for(raw, source).config(raw, source)


def load_config(path: str | Path) -> Any:
    """The typed config of a checkpoint or shard directory (or of a config.json file)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"{path}: not found (is this a model checkpoint directory?)")
    try:  # bounded: a FIFO, a huge or a deeply nested file is one line
        raw = read_json(path, CONFIG_BYTES)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config_from_dict(raw, str(path))


def runtime_options_help() -> str:
    """What `--option` can choose, from the registered families' declarations (for `--help`)."""
    lines = [f"{f.name}: {o.describe()}" for f in FAMILIES for o in f.runtime_options]
    return "; ".join(lines) if lines else "no registered family has any"


def tokenizer_flavour(directory: str | Path) -> str | None:
    """The tokenizer flavour the model family of a checkpoint or shard directory declares
    (`Family.tokenizer_flavour`); None without a config.json of a family this package reads."""
    path = Path(directory) / "config.json"
    try:
        raw = read_json(path, CONFIG_BYTES)
        return family_for(raw, str(path)).tokenizer_flavour if isinstance(raw, dict) else None
    except (Plamo2Error, OSError):  # none, unreadable, not a family's: the tokenizer config decides
        return None


# ---- inventory, through the family's table ---------------------------------------------------------
def hf_tensor_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The tensor inventory of an HF checkpoint of this config, in the model's own order."""
    return layout.hf_tensor_shapes(family_of(cfg), cfg)


def num_parameters(cfg: Any) -> int:
    return sum(math.prod(s) for s in hf_tensor_shapes(cfg).values())


def valid_layouts(cfg: Any, max_ranks: int = 8, tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[tuple[int, int]]:
    """Every (tp, pp) with tp in `tps` and at most `max_ranks` ranks that the family can split."""
    family = family_of(cfg)
    L = cfg.num_hidden_layers
    return [
        (tp, pp)
        for tp in tps
        for pp in range(1, L + 1)
        if tp * pp <= max_ranks and not family.tp_problems(cfg, tp) and not layout.pp_problems(L, pp)
    ]


# ---- synth presets of every family ---------------------------------------------------------------
def all_presets() -> dict[str, dict[str, Any]]:
    return {name: raw for f in FAMILIES for name, raw in f.presets.items()}


def tiny_presets() -> tuple[str, ...]:
    return tuple(name for f in FAMILIES for name in f.tiny_presets)


def family_of_preset(name: str) -> Family:
    for f in FAMILIES:
        if name in f.presets:
            return f
    raise KeyError(name)
