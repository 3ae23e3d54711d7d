"""What every part of the batching loop shares about one rank: its forward (the family's
`RankModel`), its collectives, its device, how prompts are cut into forwards, and the three small
services the loop needs from it: packed batches, fresh states, and the last stage's tensors on
every rank.  `engine.RankEngine` builds on it; `generation` and `graphs` only need this."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...model.forward import Batch, Comm, MixerState, RankModel

Tensor = torch.Tensor
DEFAULT_PREFILL_TOKENS = 32768


def make_batch(
    chunks: Sequence[Sequence[int]],
    starts: Sequence[int],
    decode: bool,
    logits_index: Sequence[int] | None,
    device: torch.device,
) -> Batch:
    """A packed batch of token chunks, chunk i continuing its sequence at position starts[i]."""
    lens = [len(c) for c in chunks]
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
    positions = torch.tensor(
        [s + j for s, n in zip(starts, lens, strict=True) for j in range(n)], dtype=torch.long, device=device
    )
    seq_index = torch.repeat_interleave(torch.arange(len(chunks), device=device), torch.tensor(lens, device=device))
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lens, device=device).cumsum(0)
    return Batch(
        input_ids=ids,
        positions=positions,
        seq_index=seq_index,
        cu_seqlens=cu,
        kv_lens=torch.tensor([s + n for s, n in zip(starts, lens, strict=True)], dtype=torch.int32, device=device),
        has_state=torch.tensor([s > 0 for s in starts], dtype=torch.bool, device=device),
        decode=decode,
        logits_index=None
        if logits_index is None
        else torch.tensor(list(logits_index), dtype=torch.long, device=device),
    )


class RankCore:
    """One rank's model and the settings of how it is driven."""

    def __init__(
        self,
        model: RankModel,
        cfg: Any,
        comm: Comm,
        device: torch.device,
        ops: Any,
        prefill_chunk: int | None,
        cuda_graph: bool = True,
        prefill_tokens: int | None = None,
    ) -> None:
        self.model, self.cfg, self.comm, self.device, self.ops = model, cfg, comm, device, ops
        self.prefill_chunk, self.cuda_graph = prefill_chunk, cuda_graph
        # Prompt tokens per prefill forward in generate: large forwards keep the GPU's matmuls
        # efficient; on the CPU there is nothing to gain from splitting.
        self.prefill_tokens = prefill_tokens or (DEFAULT_PREFILL_TOKENS if device.type == "cuda" else None)
        self.timer: Any = None  # benchmarks: a generation.PhaseTimer (device time of prefill and decode)
        self.layers = [layer.index for layer in model.layers]

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)

    def batch(
        self, chunks: Sequence[Sequence[int]], starts: Sequence[int], decode: bool, logits_index: Sequence[int] | None
    ) -> Batch:
        return make_batch(chunks, starts, decode, logits_index, self.device)

    def new_states(self, batch: int, capacity: int) -> dict[int, MixerState]:
        return self.model.new_states(batch, capacity)

    def share(self, x: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The last stage's tensor on every rank."""
        if x is None:
            x = torch.empty(shape, dtype=dtype, device=self.device)
        return self.comm.broadcast_from_last(x.contiguous())
