"""max_batch="auto": as many decode slots as a memory budget holds (runtime/batching/memory.py), with
the budget passed explicitly so the answer is deterministic.  The per-slot bytes are counted here
from the config, independently of the runtime's own state objects."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.memory import AUTO_MAX_BATCH, plan_batch, runner_bytes
from plamo2_tools.runtime.process.jobs import run_job

F32 = 4


def tiny_slot_bytes(cfg, capacity: int) -> int:
    """One slot of the tiny preset (TP1, fp32): per Mamba layer a conv state (inner, K-1) and an
    SSM state (heads, d, N), twice (the slot and its prefill group's copy); per attention layer K
    and V for every position; the sampler's rows of vocabulary on the last stage."""
    inner = cfg.mamba_num_heads * cfg.hidden_size_per_head
    mamba = (inner * (cfg.mamba_d_conv - 1) + cfg.mamba_num_heads * cfg.hidden_size_per_head * cfg.mamba_d_state) * F32
    kv = 2 * cfg.num_key_value_heads * cfg.hidden_size_per_head * F32 * capacity
    layers = cfg.layer_is_mamba
    return sum(2 * mamba if m else kv for m in layers) + 4 * F32 * cfg.vocab_size


def prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]


def test_auto_batch_respects_the_budget(shards) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        cfg, capacity = rt.config, 40
        per_slot = tiny_slot_bytes(cfg, capacity)
        probe = rt.auto_batch_size(capacity, 10**12)
        assert probe.per_slot_bytes == per_slot
        assert probe.slots == AUTO_MAX_BATCH and probe.limit == "cap"
        once = probe.fixed_bytes
        for want in (1, 5, 13):
            budget = once + want * per_slot + per_slot // 2
            plan = rt.auto_batch_size(capacity, budget)
            assert (plan.slots, plan.limit) == (want, "memory")
            assert once + plan.slots * per_slot <= budget < once + (plan.slots + 1) * per_slot
        assert rt.auto_batch_size(capacity, once - 1).limit == "minimum"

        # generate with "auto" runs that many slots, allocates no more than it planned, and gives the
        # tokens of an unbounded batch.
        seqs = prompts(cfg.vocab_size, 20)
        budget = once + 5 * tiny_slot_bytes(cfg, max(map(len, seqs)) + 10) + 1
        gen = rt.generate(seqs, 10, max_batch="auto", memory_budget=budget)
        assert gen.slots == 5 and rt.batch_plan is not None and rt.batch_plan.slots == 5
        assert runner_bytes(rt.engines[0].decode_runner) <= 5 * rt.batch_plan.per_slot_bytes
        assert gen.tokens == rt.generate(seqs, 10).tokens


def test_thread_ranks_share_the_device_and_torchrun_ranks_take_the_smallest(shards) -> None:
    path = shards("tiny-gqa", 2, 2, seed=11)
    capacity = 48
    with Runtime(path, backend="torch") as rt:
        per_rank = [eng.bytes_per_rank(capacity) for eng in rt.engines]
        budget = sum(b for _, b in per_rank) + 10 * sum(a for a, _ in per_rank)
        plan = rt.auto_batch_size(capacity, budget)
    assert plan.slots == 10
    # Threads: one device holds every rank's slots.
    assert plan.per_slot_bytes == sum(a for a, _ in per_rank) and plan.fixed_bytes == sum(b for _, b in per_rank)
    assert plan.slots == plan_batch(plan.per_slot_bytes, plan.fixed_bytes, budget, capacity).slots
    # torchrun: one device per rank, every rank runs the smallest pool any rank can hold.
    budget = max(b for _, b in per_rank) + 40 * max(a for a, _ in per_rank)  # per device, not for all ranks
    own = [plan_batch(a, b, budget, capacity).slots for a, b in per_rank]
    want = min(own)
    assert want >= 40 and len(set(own)) > 1  # the ranks would disagree on their own
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    runtime = {"shards": str(path), "backend": "torch"}
    got = run_job(auto_slots_job, runtime, {"capacity": capacity, "budget": budget}, launch=True, extra_env=env)
    assert got == [want] * len(per_rank)


def auto_slots_job(rt: Runtime, capacity: int, budget: int) -> list[int]:
    """Every rank's answer (gathered to rank 0)."""
    import torch.distributed as dist

    slots = rt.auto_batch_size(capacity, budget).slots
    out: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(out, slots)
    return out


@pytest.mark.parametrize("bad", ["many", "autox"])
def test_a_batch_size_that_is_neither_a_number_nor_auto_is_refused(shards, bad) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt, pytest.raises(ValueError):
        rt.generate([[5, 6]], 2, max_batch=bad)
