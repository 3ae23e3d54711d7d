"""`plamo2-tools inspect`: what a checkpoint or shard directory holds and how it can be split."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .dtypes import SAFETENSORS_NAMES as DTYPE_NAMES
from .dtypes import dtype_name
from .errors import CheckpointError
from .model.checkpoint import HFCheckpoint
from .model.config import Plamo2Config
from .model.tensors import pp_problems, tp_notes, tp_problems
from .outputs import ensure_complete
from .parallel import pp_layer_counts
from .shards.lock import ensure_not_being_written
from .shards.manifest import MANIFEST_NAME, load_manifest
from .shards.owned import unfinished_conversion

TP_CANDIDATES = (1, 2, 3, 4, 6, 8, 16, 32)
# `inspect --json` (inspect_path): `plamo2-tools report` recognises it by this kind and version.
# "format" says what was inspected: "hf" (a checkpoint) or "shards" (a shard directory).  Bump the
# version when a field changes meaning or goes away (adding one is compatible).
INSPECT_KIND = "plamo2-inspect"
INSPECT_SCHEMA_VERSION = 1


def config_summary(cfg: Plamo2Config) -> dict[str, Any]:
    return {
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_size_per_head": cfg.hidden_size_per_head,
        "mamba_num_heads": cfg.mamba_num_heads,
        "mamba_d_state": cfg.mamba_d_state,
        "mamba_d_conv": cfg.mamba_d_conv,
        "mamba_step": cfg.mamba_step,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "padded_vocab": cfg.padded_vocab,
        "mamba_inner": cfg.mamba_inner,
        "dt_rank": cfg.dt_rank,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_local_theta": cfg.rope_local_theta,
        "variant": cfg.variant.name,
        "attention_window_size": cfg.attention_window_size,
        "full_attention_idx": list(cfg.full_attention_idx),
        "rms_norm_eps": cfg.rms_norm_eps,
        "torch_dtype": cfg.torch_dtype,
    }


def split_table(cfg: Plamo2Config) -> dict[str, list[dict[str, Any]]]:
    tp_rows = [
        {
            "tp": t,
            "ok": not tp_problems(cfg, t),
            "reasons": tp_problems(cfg, t),
            "notes": [] if tp_problems(cfg, t) else tp_notes(cfg, t),
        }
        for t in TP_CANDIDATES
    ]
    L = cfg.num_hidden_layers
    pp_rows = []
    for p in sorted({1, 2, 3, 4, 8, min(L, 16), L + 1}):
        problems = pp_problems(cfg, p)
        pp_rows.append(
            {"pp": p, "ok": not problems, "reasons": problems, "layers": [] if problems else pp_layer_counts(L, p)}
        )
    return {"tp": tp_rows, "pp": pp_rows}


def layer_map(cfg: Plamo2Config) -> list[dict[str, Any]]:
    """Per layer: Mamba or attention, and for attention its window (None = full) and RoPE base."""
    return [
        {"index": i, "kind": kind}
        if kind == "mamba"
        else {"index": i, "kind": kind, "window": cfg.attention_window(i), "rope_base": cfg.rope_base(i)}
        for i, kind in enumerate(cfg.layer_kinds)
    ]


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
            "config": config_summary(cfg),
            "layers": layer_map(cfg),
            "parameters": params,
            "expected_parameters": cfg.num_parameters(),
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
        "config": config_summary(cfg),
        "layers": layer_map(cfg),
        "mapping": {k: m.raw["mapping"][k] for k in ("tp_size", "pp_size", "world_size", "stages")},
        "vllm": vllm_compatibility(m.mapping.tp, m.mapping.pp),
        "ranks": m.raw["mapping"]["ranks"],
        "options": m.raw["options"],
        "source": {"path": m.raw["source"]["path"], "kind": m.raw["source"]["kind"]},
        "tensors": sum(len(r) for r in m.entries.values()),
        "bytes_by_dtype": by_dtype,
        "files": [{"name": n, **{k: v for k, v in f.items() if k != "sha256"}} for n, f in sorted(m.files.items())],
        "plamo2_tools_version": m.raw.get("plamo2_tools_version"),
        "splits": split_table(cfg),
    }
