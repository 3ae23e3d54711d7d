"""Kernel decisions measured on the cards we support, shipped with the package as data, so that a
fresh machine does not measure them again (issue 33).

Two kinds of decision are kept: the configurations Triton's autotuner picks (`gemv`, the SSD
output kernel: block sizes, warps, stages per shape key) and our own SSD variant pick
(`ssd_chunk_scan`: (variant, chunk size) per shape bucket, kernels/ssd.py `auto_choice`).  Each
card has one file, `kernels/tuned/<card>.json` (the card's name as CUDA reports it, lowercase,
runs of other characters as "-": "NVIDIA H100 80GB HBM3" -> `nvidia-h100-80gb-hbm3.json`):

    {"kind": "plamo2-tuned-kernels", "schema_version": 1,
     "card": "NVIDIA H100 80GB HBM3", "capability": "9.0",
     "made_with": {"plamo2_tools": ..., "torch": ..., "triton": ..., "commit": ..., "command": ...},
     "kernels": {"gemv": {"2048|8192|torch.bfloat16|torch.bfloat16|torch.bfloat16":
                            {"kwargs": {"BLOCK_N": 8, "BLOCK_K": 512}, "num_warps": 4, "num_stages": 3}},
                 "ssd_chunk_output": {...}, "ssd_chunk_scan": {"32|64|128|torch.bfloat16|...": ["parallel", 256]}}}

A table is read before anything is measured: an autotuner's cache is seeded with it (`seed_autotuner`)
and the SSD pick looks it up (`nearest_choice`: the same shapes at the nearest token and sequence
buckets, so a run never measures on a card we ship).  The autotuner and the SSD timing stay as the
fallback for other cards, for shapes the table lacks, and with `PLAMO2_TUNED=0`.

A table is only ever a hint and never makes a result wrong: a file that is not valid, names another
card or capability, or is not ours is ignored (logged); an entry is used only when its value is one
of the kernel's own candidates (a Triton config from the kernel's list, whose correctness the tests
and the NaN-poisoned benchmark cover; a known SSD variant and chunk size).  The software versions
in `made_with` are provenance, not a condition: a configuration of block sizes stays valid across
torch and Triton versions, and at worst is not the fastest there.

`write_table` writes a card's file from what this process measured (`plamo2-tools warmup SHARDS
--tuned-out DIR` on that card: docs/kernels.md section 4.8).  This module imports neither torch nor
Triton at import time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..jsonio import parse_json
from ..safe_files import read_regular

log = logging.getLogger("plamo2_tools.kernels")
KIND = "plamo2-tuned-kernels"
SCHEMA_VERSION = 1
TUNED_DIR = Path(__file__).with_name("tuned")
MAX_BYTES = 4 << 20  # a card's table is tens of kB
KERNELS = ("gemv", "ssd_chunk_output", "ssd_chunk_output_f32", "ssd_chunk_scan")
_INT = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class Card:
    """A GPU model as CUDA names it, and its compute capability ("9.0")."""

    name: str
    capability: str

    @property
    def slug(self) -> str:
        return card_slug(self.name)


def card_slug(name: str) -> str:
    """The file name stem of a card's table: lowercase, runs of anything but [a-z0-9] as one "-"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unnamed"


def current_card(device: Any) -> Card:
    """The card of a CUDA device (imports torch)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return Card(props.name, f"{props.major}.{props.minor}")


@dataclass(frozen=True)
class TunedTable:
    card: Card
    kernels: Mapping[str, Mapping[str, Any]]
    made_with: Mapping[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def entries(self, kernel: str) -> Mapping[str, Any]:
        return self.kernels.get(kernel, {})


def read_table(path: Path, card: Card | None = None) -> TunedTable:
    """A table file, checked: ours, this schema, and (when given) made for exactly this card.
    Every problem is one CheckpointError line."""
    data = parse_json(read_regular(path, MAX_BYTES), str(path))
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise CheckpointError(f"{path}: not a tuned-kernel table (kind {KIND!r} expected)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{path}: schema_version {data.get('schema_version')!r}, this reads {SCHEMA_VERSION}")
    name, capability, kernels = data.get("card"), data.get("capability"), data.get("kernels")
    if not isinstance(name, str) or not isinstance(capability, str) or not isinstance(kernels, dict):
        raise CheckpointError(f"{path}: card, capability (strings) and kernels (an object) are required")
    if card is not None and (name, capability) != (card.name, card.capability):
        raise CheckpointError(f"{path}: made for {name} (sm {capability}), not {card.name} (sm {card.capability})")
    clean = {k: dict(v) for k, v in kernels.items() if k in KERNELS and isinstance(v, dict)}
    made_with = data.get("made_with") if isinstance(data.get("made_with"), dict) else {}
    return TunedTable(Card(name, capability), clean, made_with, path)


def tuned_dir() -> Path | None:
    """Where shipped tables are read: the package's, `$PLAMO2_TUNED_DIR` instead, none with PLAMO2_TUNED=0."""
    if os.environ.get("PLAMO2_TUNED", "1") == "0":
        return None
    override = os.environ.get("PLAMO2_TUNED_DIR")
    return Path(override) if override else TUNED_DIR


@functools.lru_cache(maxsize=16)
def _cached_table(card: Card, directory: Path) -> TunedTable | None:
    path = directory / f"{card.slug}.json"
    if not path.exists():
        return None
    try:
        table = read_table(path, card)
    except CheckpointError as e:  # a hint: ignored, and the kernels measure as on any other card
        log.warning("ignoring the tuned-kernel table: %s", e)
        return None
    log.info("%s: tuned kernel decisions for %s", path, card.name)
    return table


def table_for(card: Card, directory: Path | None = None) -> TunedTable | None:
    """The shipped table of this card, or None (no table, tables off, or an invalid one)."""
    where = directory if directory is not None else tuned_dir()
    return None if where is None else _cached_table(card, where)


def write_table(path: Path, card: Card, kernels: Mapping[str, Mapping[str, Any]], made_with: Mapping[str, Any]) -> Path:
    """Write a card's table (temporary name, then rename: a reader sees the old file or the new)."""
    data = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "card": card.name,
        "capability": card.capability,
        "made_with": dict(made_with),
        "kernels": {k: dict(sorted(v.items())) for k, v in kernels.items() if v},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


# ---- keys -------------------------------------------------------------------------------------
def key_text(key: tuple[Any, ...]) -> str:
    return "|".join(str(p) for p in key)


def parse_key(text: str) -> tuple[Any, ...]:
    """A key written by `key_text`: integers back as ints, everything else as strings."""
    return tuple(int(p) if _INT.fullmatch(p) else p for p in text.split("|"))


def nearest_choice(
    entries: Mapping[str, Any], key: tuple[Any, ...], valid: Callable[[Any], bool], buckets: int = 2
) -> Any | None:
    """The entry for `key`, else the one whose key agrees on everything but the last `buckets`
    parts (powers of two: token and sequence buckets) and is nearest in log2 over those; ties go to
    the larger bucket.  Only `valid` values count."""
    exact = entries.get(key_text(key))
    if exact is not None and _ok(valid, exact):
        return exact
    head, tail = key_text(key[:-buckets]), key[-buckets:]
    best: tuple[float, tuple[int, ...], Any] | None = None
    for text, value in entries.items():
        parts = parse_key(text)
        if len(parts) != len(key) or key_text(parts[:-buckets]) != head or not _ok(valid, value):
            continue
        theirs = parts[-buckets:]
        if not all(isinstance(t, int) and t > 0 for t in theirs):
            continue
        distance = sum(abs(math.log2(t) - math.log2(max(int(m), 1))) for t, m in zip(theirs, tail, strict=True))
        rank = (distance, tuple(-t for t in theirs))
        if best is None or rank < best[:2]:
            best = (*rank, value)
    return None if best is None else best[2]


def _ok(valid: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(valid(value))
    except (TypeError, ValueError):
        return False


# ---- Triton's autotuner ---------------------------------------------------------------------------
def config_value(config: Any) -> dict[str, Any]:
    """A triton.Config as table data."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def _signature(value: Any) -> tuple[Any, ...] | None:
    if not isinstance(value, dict) or not isinstance(value.get("kwargs"), dict):
        return None
    return (tuple(sorted(value["kwargs"].items())), value.get("num_warps"), value.get("num_stages"))


def seed_autotuner(autotuner: Any, entries: Mapping[str, Any]) -> int:
    """Put the table's configurations into a Triton autotuner's cache (shape key -> Config) before it
    benchmarks anything; an entry is taken only when it is one of the autotuner's own configs (its
    object, so launch options come from the kernel's list, not the file).  The number seeded."""
    allowed = {_signature(config_value(c)): c for c in autotuner.configs}
    seeded = 0
    for text, value in entries.items():
        config = allowed.get(_signature(value))
        if config is None:
            log.info("tuned table: %s is not one of the kernel's configs: ignored", value)
            continue
        autotuner.cache.setdefault(parse_key(text), config)
        seeded += 1
    return seeded


def autotuner_entries(autotuner: Any) -> dict[str, dict[str, Any]]:
    """What a Triton autotuner has decided in this process, as table entries."""
    return {key_text(key): config_value(config) for key, config in dict(autotuner.cache).items()}


_seeded: set[tuple[int, str]] = set()
_seed_lock = threading.Lock()  # thread ranks launch the same kernel at once: one seeds, all wait for it


def seed_once(autotuner: Any, kernel: str, device: Any) -> None:
    """Seed `autotuner` from the table of `device`'s card, once per process and device."""
    tag = (id(autotuner), str(device))
    if tag in _seeded:
        return
    with _seed_lock:
        if tag in _seeded:
            return
        table = table_for(current_card(device))
        if table is not None:
            seed_autotuner(autotuner, table.entries(kernel))
        _seeded.add(tag)
