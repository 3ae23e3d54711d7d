"""The decode step of one rank over a pool of sequence slots, eager or replayed from CUDA graphs.

All inputs of a step live in static device buffers indexed by slot: the token to feed (`ids`), its
position (`pos`), the sampling stream (`keys`), how many tokens the slot has generated (`steps`)
and its request's sampling settings (`temp`, `top_p`).  A step runs the rank's stage over slots
[0, B) for a bucket B >= the highest slot in use (powers of two up to the pool size), picks the
next tokens on the device, and advances the buffers itself, so consecutive steps need nothing from
the host.  Slots beyond the live ones compute garbage that nobody reads (their states are reloaded
when a request is admitted; their position is clamped to the cache).

With graphs, each (bucket, sampling mode) pair is captured once (modes: `sampling.GREEDY`,
`SAMPLE`, `TOP_P`; the settings themselves are buffers, so one graph serves every mix of requests
its mode covers): the embedding (first stage), all layers with their TP collectives (NCCL
all-reduce is capturable), the head and the token choice (last stage).  The PP hand-over and the
broadcast of the chosen tokens stay outside, eager.  Graphs are used on CUDA when every collective
is capturable: one rank per process (torchrun/NCCL) or a single rank; thread ranks (`LocalComm`)
synchronise on the host and run eager.

Only the pairs a run meets are captured, when it first meets them (issue 33): `prepare` captures
the largest bucket of the run's modes while the pool is empty, and `step` captures a smaller bucket
the first time the live slots fit it (a one-prompt `generate` captures one graph; a GSM8K run's
tail captures each bucket it shrinks through; a server captures what its load reaches).  Capturing
runs the step twice first (Triton compiles, cuBLAS workspaces), and those runs write into the rows
[0, B) they cover: live sequences' recurrent states (Mamba conv and SSM) are parked in rows that no
request uses, [B, B + live), and put back afterwards, with the step buffers; their KV caches are
written only at and after each sequence's position, which the next real steps write before any
attention reads it.  Where no such rows are free (the pool's own size, or live rows past half the
pool) that step runs eager and the capture waits for a later step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ...model.forward import Batch, MixerState
from ..rank.comm import DistComm
from .core import RankCore
from .sampling import MODES, select_rows

Tensor = torch.Tensor


def buckets(slots: int) -> list[int]:
    """Decode batch sizes: powers of two below the pool size, and the pool size."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return [*out, slots]


def graphs_possible(engine: RankCore) -> bool:
    """CUDA, and every collective of the step is a device operation (see module doc)."""
    info = engine.comm.info
    return engine.device.type == "cuda" and (info.world_size == 1 or isinstance(engine.comm, DistComm))


Body = Callable[[], tuple[Tensor, ...]]


class GraphBackend(Protocol):
    """How a step is captured and replayed: `CudaGraphs` on CUDA; the tests give a stand-in that
    runs the body eagerly (the capture logic, the warm-up runs and what they write are the same)."""

    def capture(self, body: Body) -> Any: ...

    def replay(self, handle: Any) -> tuple[Tensor, ...]: ...


class CudaGraphs:
    """CUDA graphs of one device, sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pool = device, None

    def capture(self, body: Body) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):  # compile Triton kernels, create cuBLAS handles and workspaces
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        self.pool = graph.pool()
        return graph, out

    def replay(self, handle: tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        graph, out = handle
        graph.replay()
        return out


WARMUP_RUNS = 2  # eager runs of the step before it is captured


def recurrent_tensors(state: MixerState) -> list[Tensor]:
    """The tensors of a layer state that a step rewrites in place whatever the position (a Mamba
    layer's conv and SSM state: a fixed size per sequence); those in `per_token` (a KV cache) are
    written only at each sequence's position."""
    return [t for name, t in state.tensors().items() if name not in state.per_token]


class DecodeRunner:
    """Static buffers, state pool and (optionally) captured graphs of one rank's decode step."""

    def __init__(
        self, engine: RankCore, slots: int, capacity: int, use_graphs: bool, backend: GraphBackend | None = None
    ) -> None:
        self.engine, self.slots, self.capacity = engine, slots, capacity
        self.use_graphs = use_graphs and (backend is not None or graphs_possible(engine))
        self.backend: GraphBackend | None = None
        if self.use_graphs:
            self.backend = backend if backend is not None else CudaGraphs(engine.device)
        dev, info = engine.device, engine.comm.info
        self.states = engine.new_states(slots, capacity)
        zeros = {"dtype": torch.long, "device": dev}
        self.ids, self.pos = torch.zeros(slots, **zeros), torch.zeros(slots, **zeros)
        self.keys, self.steps = torch.zeros(slots, **zeros), torch.zeros(slots, **zeros)
        self.next = torch.zeros(slots, **zeros)
        self.temp = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.seq_index = torch.arange(slots, **zeros)
        self.cu = torch.arange(slots + 1, dtype=torch.int32, device=dev)
        self.has_state = torch.ones(slots, dtype=torch.bool, device=dev)
        D, dtype = engine.model.hidden_size, engine.model.dtype
        self.h_in = None if info.is_first_stage else torch.zeros(slots, D, dtype=dtype, device=dev)
        self.r_in = None if info.is_first_stage else torch.zeros(slots, D, dtype=dtype, device=dev)
        self.graphs: dict[tuple[int, str], Any] = {}  # (bucket, mode) -> the backend's handle
        self.captured: list[tuple[int, str]] = []  # in capture order (what a run needed, for tests and reports)

    def bucket(self, n: int) -> int:
        return next(b for b in buckets(self.slots) if b >= n)

    def fits(self, slots: int, capacity: int) -> bool:
        return self.slots >= slots and self.capacity >= capacity

    # ---- the step ------------------------------------------------------------------------------
    def _body(self, B: int, mode: str) -> tuple[Tensor, ...]:
        """What a graph holds: the stage over slots [0, B), token choice, buffer updates."""
        model, info = self.engine.model, self.engine.comm.info
        batch = Batch(
            input_ids=self.ids[:B],
            positions=self.pos[:B],
            seq_index=self.seq_index[:B],
            cu_seqlens=self.cu[: B + 1],
            kv_lens=(self.pos[:B] + 1).to(torch.int32),
            has_state=self.has_state[:B],
            decode=True,
        )
        states = {i: st.rows(0, B) for i, st in self.states.items()}
        if info.is_first_stage:
            h, residual = model.embed_tokens(batch.input_ids), None
        else:
            assert self.h_in is not None and self.r_in is not None
            h, residual = self.h_in[:B], self.r_in[:B]
        out = model.stage(batch, states, h, residual)
        if info.is_last_stage:
            picked = select_rows(out[0], self.keys[:B], self.steps[:B], self.temp[:B], self.top_p[:B], mode)
            self.next[:B].copy_(picked)
        self.pos[:B].add_(1).clamp_(max=self.capacity - 1)  # dead slots must not write past the cache
        self.steps[:B].add_(1)
        if info.world_size == 1:
            self.ids[:B].copy_(self.next[:B])
        return out

    def step(self, n: int, mode: str, live: int | None = None) -> tuple[Tensor, Tensor | None]:
        """One decode step of slots [0, bucket(n)): (next ids (B,), the last stage's logits or None).
        `live`: 1 + the highest slot in use (default: all of the bucket), for capturing lazily."""
        B = self.bucket(n)
        comm, info = self.engine.comm, self.engine.comm.info
        if not info.is_first_stage:
            assert self.h_in is not None and self.r_in is not None
            like = self.h_in[:B]
            h, r = comm.recv_prev([like, like])
            self.h_in[:B].copy_(h)
            self.r_in[:B].copy_(r)
        if self.backend is not None and (B, mode) not in self.graphs:
            self._capture_live(B, mode, B if live is None else min(live, B))
        if self.backend is not None and (B, mode) in self.graphs:
            out = self.backend.replay(self.graphs[(B, mode)])
        else:
            out = self._body(B, mode)
        if not info.is_last_stage:
            comm.send_next(list(out))
        if info.world_size > 1:
            nxt = comm.broadcast_from_last(self.next[:B])
            if nxt.data_ptr() != self.next.data_ptr():
                self.next[:B].copy_(nxt)
            self.ids[:B].copy_(self.next[:B])
        return self.next[:B], out[0] if info.is_last_stage else None

    # ---- graphs --------------------------------------------------------------------------------
    def prepare(self, modes: Sequence[str], max_active: int) -> None:
        """Capture the bucket of `max_active` sequences for these sampling modes (the smaller ones
        come lazily, in `step`).  Only call with no live sequence: the warm-up runs write into the
        pool's rows."""
        if self.backend is None:
            return
        B = self.bucket(max_active)
        for mode in sorted(modes, key=MODES.index):
            if (B, mode) not in self.graphs:
                self._capture(B, mode)
        self.reset()

    def _capture(self, B: int, mode: str) -> None:
        assert self.backend is not None
        self.graphs[(B, mode)] = self.backend.capture(lambda: self._body(B, mode))
        self.captured.append((B, mode))

    def _capture_live(self, B: int, mode: str, live: int) -> bool:
        """Capture (B, mode) while rows [0, live) hold running sequences (module doc): their
        recurrent states parked in rows [B, B + live) and the step buffers saved, then both put
        back.  False (the step runs eager) where those rows do not exist."""
        if live and B + live > self.slots:
            return False
        parked = [(t[:live], t[B : B + live]) for st in self.states.values() for t in recurrent_tensors(st)]
        for src, dst in parked:
            dst.copy_(src)
        saved = [(t, t[:B].clone()) for t in (self.ids, self.pos, self.steps, self.next)]
        try:
            self._capture(B, mode)
        finally:
            for t, old in saved:
                t[:B].copy_(old)
            for src, dst in parked:
                src.copy_(dst)
        return True

    def reset(self) -> None:
        """Zero the step buffers (after warm-ups; positions must stay inside the cache)."""
        for t in (self.ids, self.pos, self.keys, self.steps, self.next, self.temp):
            t.zero_()
        self.top_p.fill_(1.0)

    # ---- slots ---------------------------------------------------------------------------------
    def admit(
        self,
        slots: list[int],
        states: dict[int, MixerState],
        first: Tensor,
        lengths: list[int],
        keys: list[int],
        temperature: Sequence[float] | None = None,
        top_p: Sequence[float] | None = None,
    ) -> None:
        """Requests enter `slots`: their prefilled states (one row per slot, in order), first token,
        position, stream and sampling settings (default: greedy)."""
        dev = self.engine.device
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        for i, st in self.states.items():
            st.load(idx, states[i])
        n = len(slots)
        self.temp[idx] = torch.tensor(list(temperature or [0.0] * n), dtype=torch.float32, device=dev)
        self.top_p[idx] = torch.tensor(list(top_p or [1.0] * n), dtype=torch.float32, device=dev)
        self.ids[idx] = first
        self.pos[idx] = torch.tensor(lengths, dtype=torch.long, device=dev)
        self.steps[idx] = 1  # the first token was step 0
        self.keys[idx] = torch.tensor(keys, dtype=torch.long, device=dev)

    def move(self, src: int, dst: int) -> None:
        for st in self.states.values():
            st.move(src, dst)
        for t in (self.ids, self.pos, self.keys, self.steps, self.next, self.temp, self.top_p):
            t[dst] = t[src]
