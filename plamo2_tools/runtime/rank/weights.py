"""One rank's tensors, read from its shard files (checked against the manifest first: shards/integrity.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ...errors import CheckpointError
from ...shards.manifest import Manifest


def load_rank_weights(manifest: Manifest, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of one global rank, read with safetensors from its shard files."""
    weights: dict[str, torch.Tensor] = {}
    for name in manifest.rank_files(rank):
        path = Path(manifest.path) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest for rank {rank})")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                weights[key] = f.get_tensor(key)
    expected = set(manifest.entries[rank])
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise CheckpointError(f"rank {rank}: shard keys differ from the manifest (missing {missing}, extra {extra})")
    return weights
