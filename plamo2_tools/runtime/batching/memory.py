"""How many sequences fit: the memory behind `max_batch="auto"` (and `eval --batch-size auto`).

A decode slot of `capacity` tokens holds, on each rank, its layers' states, each a
`model.forward.MixerState` that counts its own bytes: a fixed part (e.g. PLaMo 2's Mamba conv and SSM
state) and a part per token (an attention KV cache).  A sequence being prefilled holds a
second copy of the fixed part (prefill groups run on states of their own, `generation`), and the
last stage holds a row of decode logits plus the sampler's (rows, vocab) temporaries.  Held once:
the activations of one prefill forward of `prefill_tokens` tokens and its group's KV.  So

    slots = (budget - held once) // per slot,   at most AUTO_MAX_BATCH

The budget is the device's: on CUDA what `torch.cuda.mem_get_info` reports free, plus what PyTorch's
allocator holds unused and the current slot pool (it is freed before a new one is made), times
0.9; on the CPU half of `MemAvailable` (/proc/meminfo).  Tests pass an explicit budget.  Thread
ranks on one device add their needs (`Runtime.auto_batch_size`); torchrun ranks take the smallest
answer of all ranks (`RankEngine.auto_batch`), so every rank runs the same slot pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

AUTO_MAX_BATCH = 1024  # beyond this the decode step's graphs and buckets grow for little gain
CPU_PREFILL_TOKENS = 8192  # activation estimate where the prefill budget is unlimited (the CPU)
CUDA_FRACTION = 0.9
CPU_FRACTION = 0.5


@dataclass(frozen=True)
class BatchPlan:
    slots: int
    capacity: int  # tokens per slot (prompt + answer)
    per_slot_bytes: int
    fixed_bytes: int
    budget_bytes: int
    limit: str  # what bounds `slots`: "memory", "cap" or "minimum"

    def limited(self, slots: int) -> BatchPlan:
        return self if slots == self.slots else replace(self, slots=slots, limit="other ranks")

    def describe(self) -> str:
        gib, mib = 2**30, 2**20
        return (
            f"auto batch size: {self.slots} sequences of {self.capacity} tokens "
            f"({self.per_slot_bytes / mib:.2f} MiB each + {self.fixed_bytes / gib:.2f} GiB held once, "
            f"budget {self.budget_bytes / gib:.2f} GiB; bound by {self.limit})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "capacity": self.capacity,
            "per_slot_bytes": self.per_slot_bytes,
            "fixed_bytes": self.fixed_bytes,
            "budget_bytes": self.budget_bytes,
            "limit": self.limit,
        }


def activation_bytes_per_token(engine: Any) -> int:
    """A generous bound on one prefill token's live activations on this rank: the hidden and
    residual streams and the widest projections' outputs, counted in fp32."""
    widest = 0
    for layer in engine.model.layers:
        tensors = [getattr(layer, "gate_up", None), *vars(layer.mixer).values()]
        widest = max([widest, *(t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 2)])
    return 4 * (8 * int(engine.model.hidden_size) + 3 * widest)


def rank_bytes(engine: Any, capacity: int) -> tuple[int, int]:
    """(bytes per decode slot, bytes held once) on this rank, as the module doc counts them."""
    fixed = per_token = 0
    for st in engine.new_states(1, 1).values():  # each mixer's state counts its own bytes
        f, t = st.bytes_per_sequence()
        fixed, per_token = fixed + f, per_token + t
    per_slot = 2 * fixed + per_token * capacity
    if engine.comm.info.is_last_stage:
        per_slot += 4 * 4 * int(engine.cfg.vocab_size)
    tokens = engine.prefill_tokens or CPU_PREFILL_TOKENS
    once = tokens * activation_bytes_per_token(engine) + 2 * tokens * per_token
    return per_slot, once


def runner_bytes(runner: Any) -> int:
    """Memory a slot pool holds (its states)."""
    if runner is None:
        return 0
    return sum(st.nbytes for st in runner.states.values())


def device_budget(device: torch.device, runners: Any = ()) -> int:
    """Bytes generation may use on `device` (see the module doc); `runners` are slot pools that a
    new pool replaces."""
    pools = runners if isinstance(runners, (list, tuple)) else [runners]
    held = sum(runner_bytes(r) for r in pools)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(CUDA_FRACTION * (free + held))
    return int(CPU_FRACTION * available_ram()) + held


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 2**30


def plan_batch(per_slot: int, once: int, budget: int, capacity: int, cap: int = AUTO_MAX_BATCH) -> BatchPlan:
    room = (budget - once) // max(1, per_slot)
    if room >= cap:
        slots, limit = cap, "cap"
    elif room >= 1:
        slots, limit = int(room), "memory"
    else:
        slots, limit = 1, "minimum"
    return BatchPlan(slots, capacity, per_slot, once, budget, limit)
