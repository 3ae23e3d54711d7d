"""The collectives a rank needs (the `Comm` interface of model/forward.py), with two implementations,
and the process-group set-up of real ranks:

- `DistComm`: real ranks under torchrun, torch.distributed (gloo on CPU, NCCL on GPU);
- `LocalComm`: every rank a thread of one process; all-reduce sums the TP ranks' partial results
  in rank order, so the one-process run is the same SPMD program with the same kernels.

Only four operations are needed: TP all-reduce (after row-parallel projections and the
vocab-parallel embedding), TP all-gather (vocab-parallel logits), the PP hand-over of
(hidden, residual) to the next stage, and a broadcast from the last stage (sampled tokens, logits).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import UserError
from ...parallel import RankInfo, stage_groups

Tensor = torch.Tensor


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the torchrun world: NCCL on GPUs (one per local rank), gloo on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda but no CUDA device is visible")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise UserError(
                f"{local_world} ranks on this node but {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank "
                "(run without --launch to put all ranks on one GPU as threads)"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=30)}
        if backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return rank, world, dev


MODES = ("local", "dist")


def process_mode(mode: str = "auto") -> str:
    """Which ranks this process runs: "dist", its one rank of the torchrun world it was started in,
    or "local", every rank as a thread of its own; "auto" is "dist" exactly under torchrun.  (The
    other choice, to start fresh torchrun ranks, is `runtime/process/jobs.py:run_job`'s.)"""
    if mode == "auto":
        return "dist" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "local"
    if mode not in MODES:
        raise ValueError(f"mode must be auto, local or dist, not {mode!r}")
    return mode


@dataclass
class ProcessRanks:
    """The ranks of a TP x PP world this process runs: their collectives and device."""

    mode: str  # "local" or "dist" (process_mode)
    rank: int  # this process's rank in the world (0 for thread ranks)
    comms: list[Any]  # one per rank this process runs: LocalComm threads or its one DistComm
    device: torch.device
    world: LocalWorld | None = None  # the thread ranks' shared state (abort on failure)

    @staticmethod
    def own(mode: str, world_size: int) -> list[int]:
        """The ranks (of `world_size`) whose files this process loads, known before joining the world."""
        return [int(os.environ.get("RANK", "0"))] if mode == "dist" else list(range(world_size))


def open_ranks(mode: str, tp: int, pp: int, device: str, name: str = "the shards") -> ProcessRanks:
    """Join the torchrun world ("dist"), or set up every rank as a thread on `device` ("local");
    `name` (the shard directory) is what a refusal names."""
    if mode == "dist":
        rank, world, local_device = init_distributed(device)
        if world != tp * pp:
            raise UserError(f"{name} has {tp * pp} ranks (tp={tp} pp={pp}) but torchrun started {world}")
        return ProcessRanks(mode, rank, [DistComm(RankInfo(rank, tp, pp))], local_device)
    threads = LocalWorld(tp, pp)
    dev = torch.device(device)
    if dev.type == "cpu" and tp * pp > 1:
        # Every rank thread would otherwise use the whole intra-op pool: oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * pp)))
    return ProcessRanks(mode, 0, [LocalComm(threads, r) for r in range(tp * pp)], dev, threads)


def shutdown_distributed() -> None:
    """Leave the world cleanly: without it gloo's threads abort the process at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class DistComm:
    """torch.distributed; the caller has run `init_distributed`."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.tp_group = None
        for stage, ranks in enumerate(stage_groups(info.tp, info.pp)):  # new_group is collective: all create all
            group = dist.new_group(ranks)
            if stage == info.pp_rank:
                self.tp_group = group

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.info.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        if self.info.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.info.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def send_next(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            dist.send(t.contiguous(), self.info.next_rank)

    def recv_prev(self, like: list[Tensor]) -> list[Tensor]:
        out = []
        for t in like:
            buf = torch.empty_like(t)
            dist.recv(buf, self.info.prev_rank)
            out.append(buf)
        return out

    def broadcast_from_last(self, x: Tensor) -> Tensor:
        if self.info.world_size > 1:
            x = x.contiguous()
            dist.broadcast(x, self.info.last_stage_root)
        return x

    def barrier(self) -> None:
        if self.info.world_size > 1:
            dist.barrier()


class LocalWorld:
    """Shared state of the thread ranks of one process."""

    TIMEOUT = float(os.environ.get("PLAMO2_LOCAL_COMM_TIMEOUT", "600"))

    def __init__(self, tp: int, pp: int) -> None:
        self.tp, self.pp = tp, pp
        self.tp_barriers = [threading.Barrier(tp) for _ in range(pp)]
        self.world_barrier = threading.Barrier(tp * pp)
        self.slots: list[Tensor | None] = [None] * (tp * pp)
        self.pipes = {r: queue.Queue() for r in range(tp * pp)}
        self.failed = threading.Event()

    def abort(self) -> None:
        """One rank failed: release every other rank from its wait."""
        self.failed.set()
        for b in [*self.tp_barriers, self.world_barrier]:
            b.abort()


class LocalComm:
    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.info = RankInfo(rank, world.tp, world.pp)

    def _tp_wait(self) -> None:
        self.world.tp_barriers[self.info.pp_rank].wait(LocalWorld.TIMEOUT)

    def _tp_peers(self) -> list[Tensor]:
        return [self.world.slots[r] for r in self.info.stage_ranks]  # type: ignore[misc]

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.info.tp == 1:
            return x
        self.world.slots[self.info.rank] = x
        self._tp_wait()
        peers = self._tp_peers()
        total = peers[0].clone()
        for p in peers[1:]:  # rank order: every rank computes the identical sum
            total += p
        self._tp_wait()  # nobody may overwrite its slot before all have read
        x.copy_(total)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        if self.info.tp == 1:
            return x
        self.world.slots[self.info.rank] = x
        self._tp_wait()
        out = torch.cat(self._tp_peers(), dim=dim)
        self._tp_wait()
        return out

    def send_next(self, tensors: list[Tensor]) -> None:
        self.world.pipes[self.info.next_rank].put([t.clone() for t in tensors])

    def recv_prev(self, like: list[Tensor]) -> list[Tensor]:
        while True:
            try:
                return self.world.pipes[self.info.rank].get(timeout=0.5)
            except queue.Empty:
                if self.world.failed.is_set():
                    raise threading.BrokenBarrierError("another rank failed") from None

    def broadcast_from_last(self, x: Tensor) -> Tensor:
        if self.info.world_size == 1:
            return x
        root = self.info.last_stage_root
        if self.info.rank == root:
            self.world.slots[root] = x
        self.world.world_barrier.wait(LocalWorld.TIMEOUT)
        src = self.world.slots[root]
        out = x if self.info.rank == root else src.clone()  # type: ignore[union-attr]
        self.world.world_barrier.wait(LocalWorld.TIMEOUT)
        return out

    def barrier(self) -> None:
        self.world.world_barrier.wait(LocalWorld.TIMEOUT)
