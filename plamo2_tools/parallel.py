"""Rank arithmetic, written once (docs/shard-format.md, "Rank numbering").

A TP x PP split numbers its ranks like vLLM and TRT-LLM, TP innermost:
global rank = pp_rank * tp + tp_rank.  Shard file names, the converter's plan, the runtime's
process groups and the PP hand-over all go through these functions.
"""

from __future__ import annotations

from dataclasses import dataclass


def global_rank(tp_rank: int, pp_rank: int, tp: int) -> int:
    return pp_rank * tp + tp_rank


def split_rank(rank: int, tp: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank."""
    return rank % tp, rank // tp


def pp_layer_counts(num_layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices: L // p each, the remainder one each to the stages before the last."""
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    return counts


@dataclass(frozen=True)
class RankInfo:
    """Where one global rank sits in a TP x PP world."""

    rank: int
    tp: int
    pp: int

    @property
    def tp_rank(self) -> int:
        return split_rank(self.rank, self.tp)[0]

    @property
    def pp_rank(self) -> int:
        return split_rank(self.rank, self.tp)[1]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def stage_ranks(self) -> list[int]:
        """The global ranks of this rank's TP group (its PP stage)."""
        return [global_rank(t, self.pp_rank, self.tp) for t in range(self.tp)]

    @property
    def next_rank(self) -> int:
        """The same TP rank on the next PP stage (the PP hand-over goes there)."""
        return global_rank(self.tp_rank, self.pp_rank + 1, self.tp)

    @property
    def prev_rank(self) -> int:
        return global_rank(self.tp_rank, self.pp_rank - 1, self.tp)

    @property
    def last_stage_root(self) -> int:
        """The rank that broadcasts results: TP rank 0 of the last stage."""
        return global_rank(0, self.pp - 1, self.tp)


def stage_groups(tp: int, pp: int) -> list[list[int]]:
    """The TP group (global ranks) of every PP stage, in stage order."""
    return [[global_rank(t, s, tp) for t in range(tp)] for s in range(pp)]


@dataclass(frozen=True)
class Mapping:
    """A TP x PP split of a model's layers."""

    tp: int
    pp: int
    stages: tuple[tuple[int, int], ...]  # [start, stop) layer range of every PP stage

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def ranks(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a global rank."""
        return split_rank(rank, self.tp)

    @classmethod
    def even(cls, num_layers: int, tp: int, pp: int, layers: list[int] | None = None) -> Mapping:
        """Stages from explicit per-stage layer counts, or vLLM's default split."""
        counts = layers or pp_layer_counts(num_layers, pp)
        bounds = [sum(counts[:i]) for i in range(pp + 1)]
        return cls(tp, pp, tuple(zip(bounds[:-1], bounds[1:], strict=True)))
