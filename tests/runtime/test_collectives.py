"""The tensor table's TP split kinds and the runtime's collectives agree: the runtime all-reduces
right after using each `row`-split weight (partial sums) and after the vocab-parallel embedding,
all-gathers after the vocab-parallel head, and communicates nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plamo2_tools.kernels import get_ops
from plamo2_tools.model import family_of
from plamo2_tools.model.forward import Batch
from plamo2_tools.model.layout import ROW, VOCAB, layer_of
from plamo2_tools.parallel import RankInfo
from plamo2_tools.runtime.rank.weights import load_rank_weights
from plamo2_tools.shards import load_manifest

EMBEDDING = "<embedding lookup>"


class RecordingComm:
    """One TP rank alone: records every collective and the weight used last before it."""

    def __init__(self, info: RankInfo, last: dict[str, str | None]) -> None:
        self.info, self.last = info, last
        self.calls: list[tuple[str, str | None]] = []

    def _record(self, op: str) -> None:
        self.calls.append((op, self.last["key"]))
        self.last["key"] = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce")
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self._record("all_gather")
        return torch.cat([x] * self.info.tp, dim=dim)

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        self._record("send_next")

    def recv_prev(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        self._record("recv_prev")
        return [torch.zeros_like(t) for t in like]

    def broadcast_from_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def barrier(self) -> None:
        pass


def _expected(manifest, rank: int) -> list[tuple[str, str]]:
    """What the table says rank `rank` must communicate after, as (op, vLLM key) sorted."""
    table = family_of(manifest.config).tensors
    row = {k.vllm for k in table if k.split == ROW}
    out = []
    for key in manifest.entries[rank]:
        layer, rel = layer_of(key)
        if layer is not None and rel in row:
            out.append(("all_reduce", key))
    vocab = {k.vllm for k in table if k.split == VOCAB}
    assert vocab == {"model.embed_tokens.weight", "lm_head.weight"}
    out.append(("all_reduce", EMBEDDING))  # the vocab-parallel lookup (no linear before it)
    out.append(("all_gather", "lm_head.weight"))  # vocab-parallel logits
    return sorted(out)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_all_reduce_follows_exactly_the_row_split_weights(preset: str, shards, monkeypatch) -> None:
    path: Path = shards(preset, 2, 1, seed=11)
    manifest = load_manifest(path)
    rank = 1
    weights = load_rank_weights(manifest, rank, torch.device("cpu"))
    by_ptr = {t.data_ptr(): k for k, t in weights.items()}
    last: dict[str, str | None] = {"key": None}
    linear = torch.nn.functional.linear

    def traced(x: torch.Tensor, w: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        last["key"] = by_ptr.get(w.data_ptr(), "?unknown weight")
        return linear(x, w, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", traced)
    info = RankInfo(rank, manifest.mapping.tp, manifest.mapping.pp)
    comm = RecordingComm(info, last)
    family = family_of(manifest.config)
    model = family.rank_model(manifest.config, manifest.mapping.stages[0], weights, get_ops("torch", "cpu"), comm)
    T = 5
    batch = Batch(
        input_ids=torch.arange(T) + 7,
        positions=torch.arange(T),
        seq_index=torch.zeros(T, dtype=torch.long),
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
        kv_lens=torch.tensor([T], dtype=torch.int32),
        has_state=torch.tensor([False]),
        decode=False,
    )
    states = model.new_states(1, 16)
    model.forward(batch, states)
    got = sorted((op, key or EMBEDDING) for op, key in comm.calls)
    assert got == _expected(manifest, rank)
