"""Admission policy of the generation loop (item 0 of "the main job at hardware speed"): freed slots
are refilled in groups, not one request per prefill while the others decode."""

from __future__ import annotations

import pytest
import torch

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.scheduler import Scheduler


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(requests decoding, requests admitted, requests still waiting) at every admission."""
    seen: list[tuple[int, int, int]] = []
    original = Scheduler.admit

    def spy(self, token_budget):  # type: ignore[no-untyped-def]
        decoding = len(self.active())
        group = original(self, token_budget)
        seen.append((decoding, len(group), len(self.pending)))
        return group

    monkeypatch.setattr(Scheduler, "admit", spy)
    return seen


def test_freed_slots_are_refilled_in_groups_not_one_by_one(shards, groups) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 40, (48,), generator=g).tolist()
    limits = torch.randint(1, 30, (48,), generator=g).tolist()
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        seqs = [torch.randint(3, rt.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        out = rt.generate(seqs, limits, max_batch=16).tokens
    assert [len(t) for t in out] == limits
    assert sum(n for _, n, _ in groups) == 48
    # A group that joins running decodes holds at least an eighth of the slots (2 of 16), unless it
    # takes the last waiting requests.
    lone = [(live, n, left) for live, n, left in groups if live > 0 and n < 2 and left > 0]
    assert lone == [], groups
    assert len(groups) <= 48 // 2 + 1, groups
