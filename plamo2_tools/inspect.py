"""`plamo2-tools inspect`: what a checkpoint or shard directory holds and how it can be split."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from .dtypes import SAFETENSORS_NAMES as DTYPE_NAMES
from .dtypes import dtype_name
from .errors import CheckpointError
from .kinds import INSPECT_KIND, INSPECT_SCHEMA_VERSION
from .model import family_of, num_parameters
from .model.checkpoint import HFCheckpoint
from .model.layout import pp_problems
from .outputs import ensure_complete
from .parallel import pp_layer_counts
from .shards.lock import ensure_not_being_written
from .shards.manifest import MANIFEST_NAME, load_manifest
from .shards.owned import unfinished_conversion

TP_CANDIDATES = (1, 2, 3, 4, 6, 8, 16, 32)
# `inspect --json` (inspect_path) carries INSPECT_KIND (kinds.py); its "format" says what was inspected:
# "hf" (a checkpoint) or "shards" (a shard directory).


def split_table(cfg: Any) -> dict[str, list[dict[str, Any]]]:
    family = family_of(cfg)
    tp_rows = []
    for t in TP_CANDIDATES:
        problems = family.tp_problems(cfg, t)
        notes = [] if problems else family.tp_notes(cfg, t)
        tp_rows.append({"tp": t, "ok": not problems, "reasons": problems, "notes": notes})
    L = cfg.num_hidden_layers
    pp_rows = []
    for p in sorted({1, 2, 3, 4, 8, min(L, 16), L + 1}):
        problems = pp_problems(L, p)
        pp_rows.append(
            {"pp": p, "ok": not problems, "reasons": problems, "layers": [] if problems else pp_layer_counts(L, p)}
        )
    return {"tp": tp_rows, "pp": pp_rows}


def vllm_compatibility(tp: int, pp: int) -> list[str]:
    """What a vLLM 0.26 user gets from these shards (docs/shard-format.md, "PP > 1 and vLLM")."""
    if pp == 1:
        return [f"loads with vLLM <= 0.26: LLM(..., load_format='sharded_state', tensor_parallel_size={tp})"]
    return [
        "vLLM's sharded_state loader names files by TP rank only and every PP stage would read stage 0's "
        "files: PP > 1 shards are for plamo2-tools' runtime; for vLLM, convert with --pp 1 and let vLLM "
        "place the layers"
    ]


def inspect_path(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    ensure_not_being_written(path)
    if (path / MANIFEST_NAME).exists():
        return _inspect_shards(path)
    unfinished = unfinished_conversion(path)
    if unfinished:
        raise CheckpointError(unfinished)
    ensure_complete(path)
    with HFCheckpoint(path) as ckpt:
        cfg = ckpt.config
        by_dtype: dict[str, int] = {}
        params = 0
        for info in ckpt.tensors.values():
            n = math.prod(info.shape)
            params += n
            by_dtype[DTYPE_NAMES[info.dtype]] = by_dtype.get(DTYPE_NAMES[info.dtype], 0) + info.nbytes
        return {
            "kind": INSPECT_KIND,
            "schema_version": INSPECT_SCHEMA_VERSION,
            "format": "hf",
            "path": str(path),
            "family": family_of(cfg).name,
            "config": family_of(cfg).summary(cfg),
            "geometry": family_of(cfg).describe(cfg),
            "layers": family_of(cfg).layer_map(cfg),
            "parameters": params,
            "expected_parameters": num_parameters(cfg),
            "tensors": len(ckpt.tensors),
            "bytes_by_dtype": by_dtype,
            "files": [{"name": f.path.name, "size": f.size, "tensors": len(f.tensors)} for f in ckpt.files],
            "inventory_problems": ckpt.inventory_problems(),
            "splits": split_table(cfg),
        }


def _inspect_shards(path: Path) -> dict[str, Any]:
    m = load_manifest(path)
    cfg = m.config
    by_dtype: dict[str, int] = {}
    for rank in m.entries.values():
        for e in rank.values():
            name = dtype_name(e.tensor.dtype)
            by_dtype[name] = by_dtype.get(name, 0) + e.tensor.nbytes
    return {
        "kind": INSPECT_KIND,
        "schema_version": INSPECT_SCHEMA_VERSION,
        "format": "shards",
        "path": str(path),
        "family": family_of(cfg).name,
        "config": family_of(cfg).summary(cfg),
        "geometry": family_of(cfg).describe(cfg),
        "layers": family_of(cfg).layer_map(cfg),
        "mapping": {
            "tp_size": m.mapping.tp,
            "pp_size": m.mapping.pp,
            "world_size": m.mapping.world_size,
            "stages": [list(s) for s in m.mapping.stages],
        },
        "vllm": vllm_compatibility(m.mapping.tp, m.mapping.pp),
        "ranks": [dataclasses.asdict(r) | {"files": list(r.files)} for r in m.ranks],
        "options": dataclasses.asdict(m.options),
        "source": {"path": m.source.path, "kind": m.source.kind},
        "tensors": sum(len(r) for r in m.entries.values()),
        "bytes_by_dtype": by_dtype,
        "files": [
            {"name": n, "size": f.size, "digest": f.digest, "rank": f.rank, "part": f.part}
            for n, f in sorted(m.files.items())
        ],
        "plamo2_tools_version": m.tool_version,
        "splits": split_table(cfg),
    }
