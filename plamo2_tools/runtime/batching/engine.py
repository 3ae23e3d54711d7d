"""The SPMD program every rank runs (prompt logits and scores in chunked prefills; generation by
continuous batching over decode slots, CUDA-graph decode steps and tokens chosen on the GPU, see
`generation`, `graphs`, `sampling`), and the `Runtime` that runs it: as real torchrun ranks (one
rank per process) or as threads of one process.

Every rank sees the same inputs and, through a broadcast from the last stage, the same sampled
tokens, so all ranks walk the same loop in lock-step and any rank can return the results.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ... import timeline
from ...errors import UserError
from ...kernels import get_ops
from ...model import family_of
from ...model.forward import Comm, MixerState
from ...shards.integrity import verify_shard_files
from ...shards.manifest import Manifest, load_manifest
from ...token_ids import check_token_ids
from ..rank.comm import DistComm, ProcessRanks, open_ranks, process_mode, shutdown_distributed
from ..rank.weights import load_rank_weights
from .core import RankCore
from .generation import GenerateOptions, GenerationLoop, Intake, LoopStats, OnUpdates, make_requests
from .graphs import DecodeRunner, GraphBackend
from .memory import BatchPlan, device_budget, plan_batch, rank_bytes
from .sampling import MODES, mode_of
from .scheduler import Scheduler, Update

log = logging.getLogger(__name__)
Tensor = torch.Tensor
StopFn = Callable[[int, list[int]], bool]
BatchSize = int | str | None  # a number of decode slots, "auto" (as memory allows) or None (every prompt)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per sequence (EOS included when it stopped there)
    logits: list[Tensor] | None = None  # per sequence (steps, V) float32, when asked for
    finish_reasons: list[str] = field(default_factory=list)  # "stop" (EOS id or stop callback) or "length"
    slots: int = 0  # decode slots the call ran with


@dataclass
class TokenScores:
    """Per scored position p >= start of one sequence: log p(seq[p] | seq[:p]), whether seq[p] is the
    argmax, and the top-k alternatives (ids, log-probabilities, most likely first), all from the
    same float32 log-softmax."""

    logprobs: Tensor  # (n,) float64
    greedy: Tensor  # (n,) bool
    top_ids: Tensor  # (n, k) int64
    top_logprobs: Tensor  # (n, k) float64


class RankEngine(RankCore):
    """One rank's model and the driver loop around it."""

    def __init__(
        self,
        manifest: Manifest,
        comm: Comm,
        device: torch.device,
        backend: str,
        prefill_chunk: int | None,
        cuda_graph: bool = True,
        prefill_tokens: int | None = None,
        forward_options: dict[str, Any] | None = None,
        verify_files: bool = True,
    ) -> None:
        info = comm.info
        cfg = manifest.config
        ops = get_ops(backend, device)
        weights = load_rank_weights(manifest, info.rank, device, verify=verify_files)  # digests taken as it copies
        model = family_of(cfg).rank_model(
            cfg,
            manifest.mapping.stages[info.pp_rank],
            weights,
            ops,
            comm,
            dtype=manifest.activation_dtype.torch,
            **(forward_options or {}),
        )
        super().__init__(model, cfg, comm, device, ops, prefill_chunk, cuda_graph, prefill_tokens)
        self.decode_runner: DecodeRunner | None = None
        self.graph_backend: GraphBackend | None = None  # None: CUDA graphs where possible (graphs.py)
        self.stats = LoopStats()  # summed over every generation loop of this rank
        self.last_plan: BatchPlan | None = None  # the last max_batch="auto" decision
        self.serving_stats = LoopStats()  # the current (or last) online loop's
        # Host-side agreement between torchrun ranks (online arrivals, batch sizes): a gloo group,
        # so that it never waits behind the device's queue (new_group is collective: every rank
        # builds its engine at the same point).
        self.control = dist.new_group(backend="gloo") if isinstance(comm, DistComm) and info.world_size > 1 else None

    def _prefill(self, seqs: Sequence[Sequence[int]], states: dict[int, MixerState], all_logits: bool) -> Tensor | None:
        """Run the prompts in chunks of at most `prefill_chunk` tokens per sequence.

        Returns, on the last stage, float32 logits of every prompt token (packed) or of the last
        token of each sequence; None on other stages.
        """
        longest = max(len(s) for s in seqs)
        step = self.prefill_chunk or longest
        pieces: list[tuple[list[int], Tensor]] = []  # (sequence ids, logits) per chunk
        for start in range(0, longest, step):
            active = [i for i, s in enumerate(seqs) if len(s) > start]
            chunks = [list(seqs[i][start : start + step]) for i in active]
            ends = [len(seqs[i]) <= start + step for i in active]
            if all_logits:
                want = list(range(sum(len(c) for c in chunks)))
            else:  # the last prompt token of the sequences that end in this chunk
                offsets = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0).tolist()
                want = [offsets[j + 1] - 1 for j, e in enumerate(ends) if e]
            batch = self.batch(chunks, [start] * len(active), decode=False, logits_index=want)
            if len(active) == len(seqs):
                logits = self.model.forward(batch, states)
            else:  # a subset of the batch: run it on a copy of its states
                index = torch.tensor(active, device=self.device)
                sub = {i: st.select(index) for i, st in states.items()}
                logits = self.model.forward(batch, sub)
                for i, st in states.items():
                    st.update(index, sub[i])
            if logits is not None:
                owners = (
                    [active[j] for j, c in enumerate(chunks) for _ in c]
                    if all_logits
                    else [a for a, e in zip(active, ends, strict=True) if e]
                )
                pieces.append((owners, logits))
        if not self.comm.info.is_last_stage:
            return None
        if all_logits:  # reorder chunk-major pieces into sequence-major packing
            owners = torch.tensor([o for p in pieces for o in p[0]], dtype=torch.long)
            stacked = torch.cat([p[1] for p in pieces])
            order = torch.sort(owners, stable=True).indices.to(stacked.device)
            return stacked[order]
        last = torch.empty(len(seqs), self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        for owners, logits in pieces:
            last[torch.tensor(owners, dtype=torch.long, device=self.device)] = logits
        return last

    # ---- the three things callers ask for -------------------------------------------------------
    @torch.no_grad()
    def prompt_logits(self, seqs: Sequence[Sequence[int]]) -> list[Tensor]:
        """float32 logits (T_i, V) of every position of every sequence, on the CPU."""
        states = self.new_states(len(seqs), max(len(s) for s in seqs))
        logits = self.share(
            self._prefill(seqs, states, all_logits=True), (sum(map(len, seqs)), self.cfg.vocab_size), torch.float32
        )
        return [t.cpu() for t in logits.split([len(s) for s in seqs])]

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        """Per sequence, for positions p >= start: (log p(seq[p] | seq[:p]), seq[p] is the argmax).

        Computed on the last stage so that only two numbers per token cross ranks.
        """
        return [(t.logprobs, t.greedy) for t in self.token_scores(seqs, starts, 0)]

    @torch.no_grad()
    def token_scores(self, seqs: Sequence[Sequence[int]], starts: Sequence[int], top_k: int) -> list[TokenScores]:
        """`score` plus the top_k most likely tokens at every scored position (prompt logprobs)."""
        states = self.new_states(len(seqs), max(len(s) for s in seqs))
        logits = self._prefill(seqs, states, all_logits=True)
        total = sum(len(s) - st for s, st in zip(seqs, starts, strict=True))
        k = max(0, min(int(top_k), self.cfg.vocab_size))
        result = None
        if logits is not None:
            rows, targets, offset = [], [], 0
            for s, st in zip(seqs, starts, strict=True):
                rows += range(offset + st - 1, offset + len(s) - 1)
                targets += s[st:]
                offset += len(s)
            sel = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)].log_softmax(-1)
            tgt = torch.tensor(targets, dtype=torch.long, device=logits.device)
            logprob = sel.gather(-1, tgt[:, None])[:, 0].double()
            greedy = (sel.argmax(-1) == tgt).double()
            parts = [logprob[:, None], greedy[:, None]]
            if k:
                top = sel.topk(k, dim=-1)
                parts += [top.indices.double(), top.values.double()]
            result = torch.cat(parts, dim=1)
        shared = self.share(result, (total, 2 + 2 * k), torch.float64).cpu()
        out, offset = [], 0
        for s, st in zip(seqs, starts, strict=True):
            part = shared[offset : offset + len(s) - st]
            out.append(TokenScores(part[:, 0], part[:, 1].bool(), part[:, 2 : 2 + k].long(), part[:, 2 + k :]))
            offset += len(s) - st
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        eos_token_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: StopFn | None = None,
        return_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
        max_batch: BatchSize = None,
        request_keys: Sequence[int] | None = None,
        sync_every: int = 8,
        on_finish: Callable[[int], None] | None = None,
        on_updates: OnUpdates | None = None,
        memory_budget: int | None = None,
    ) -> Generation:
        """Greedy (temperature 0) or sampled continuation of every prompt (see `generation`): the
        requests are handed to the continuous-batching loop at once and it runs until all finish.

        `max_new_tokens` is one limit or one per prompt.  At most `max_batch` sequences decode at
        once (None: all; "auto": as many as the device's memory holds, see `memory`); a finished
        one's slot is refilled with a waiting prompt.  `stop(i, tokens)` ends sequence i early (e.g.
        on a stop string); EOS ids end it too (the EOS token is kept).  Sampling draws from a stream
        keyed on (seed, request_keys[i]) (default: i), so a request samples the same tokens in any
        batch.  Tokens are looked at every `sync_every` decode steps, not after each one; then
        `on_token(i, token)` is called per new token, `on_finish(i)` per finished request and
        `on_updates(updates)` once per look with everything that changed (rank 0 only).
        """
        S = len(prompts)
        limits = [int(max_new_tokens)] * S if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if len(limits) != S:
            raise ValueError("generate: one max_new_tokens per prompt")
        requests = make_requests(prompts, limits, seed, request_keys, temperature, top_p, stop)
        live = [r for r in requests if r.max_new > 0]
        slots = 0
        main = self.comm.info.rank == 0  # callbacks once, not once per thread rank
        if main and on_finish is not None:
            for r in requests:
                if r.max_new <= 0:
                    on_finish(r.index)
        if live:
            capacity = max(len(r.prompt) + r.max_new for r in live)
            if max_batch == "auto":
                max_batch = self.auto_batch(capacity, memory_budget).slots
            elif isinstance(max_batch, str):
                raise ValueError(f"max_batch must be a number, 'auto' or None, not {max_batch!r}")
            slots = max(1, min(int(max_batch or len(live)), len(live)))
            runner = self._runner(slots, capacity)
            runner.prepare(sorted({mode_of(r.temperature, r.top_p) for r in live}, key=MODES.index), slots)
            sched = Scheduler(live, slots, eos_token_ids, stop, on_token if main else None)
            options = GenerateOptions(slots, max(1, sync_every), return_logits)

            def report(updates: list[Update]) -> None:
                if on_updates is not None:
                    on_updates(updates)
                if on_finish is not None:
                    for u in updates:
                        if u.finished:
                            on_finish(u.index)

            stats = LoopStats()
            callback = report if main and (on_updates is not None or on_finish is not None) else None
            GenerationLoop(self, runner, sched, options, on_updates=callback, stats=stats).run()
            self.stats.merge(stats)
        V = self.cfg.vocab_size
        logits = None
        if return_logits:
            logits = [torch.stack(r.logits) if r.logits else torch.empty(0, V) for r in requests]
        reasons = [r.finish_reason or "length" for r in requests]
        return Generation([r.tokens for r in requests], logits, reasons, slots)

    def serve(
        self,
        intake_for: Callable[[RankEngine], Intake],
        slots: int,
        capacity: int,
        eos_token_ids: Sequence[int],
        sync_every: int,
        on_updates: OnUpdates | None,
    ) -> None:
        """The online loop on this rank: requests arrive through the intake (see `online`) until it
        says stop.  Every sampling mode's graphs are captured first, so any mix of requests decodes
        from graphs."""
        runner = self._runner(slots, capacity)
        runner.prepare(MODES, slots)
        sched = Scheduler([], slots, eos_token_ids, None, keep_finished=False)
        options = GenerateOptions(slots, max(1, sync_every))
        main = self.comm.info.rank == 0
        self.serving_stats = LoopStats()
        loop = GenerationLoop(
            self, runner, sched, options, intake_for(self), on_updates if main else None, self.serving_stats
        )
        try:
            loop.run()
        finally:
            self.stats.merge(self.serving_stats)

    def prepare_decode(self, slots: int, capacity: int, modes: Sequence[str]) -> None:
        """Make the slot pool and capture its decode graphs now (a warm-up), not in a later call."""
        self._runner(slots, capacity).prepare(modes, slots)

    def bytes_per_rank(self, capacity: int) -> tuple[int, int]:
        """(bytes per decode slot, bytes held once) of this rank's generation at this capacity."""
        return rank_bytes(self, capacity)

    def auto_batch(self, capacity: int, budget: int | None = None) -> BatchPlan:
        """How many decode slots of `capacity` tokens this rank's device holds (`memory.plan_batch`);
        on torchrun ranks the smallest over all ranks, so that every rank runs the same pool."""
        per_slot, once = self.bytes_per_rank(capacity)
        if budget is None:
            budget = device_budget(self.device, self.decode_runner)
        plan = plan_batch(per_slot, once, budget, capacity)
        if self.control is not None:
            t = torch.tensor([plan.slots], dtype=torch.long)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
            plan = plan.limited(int(t.item()))
        if self.comm.info.rank == 0 and self.control is not None:
            log.info("%s", plan.describe())
        self.last_plan = plan
        return plan

    def _runner(self, slots: int, capacity: int) -> DecodeRunner:
        """The decode slot pool (and its graphs), kept between calls while it is big enough."""
        if self.decode_runner is None or not self.decode_runner.fits(slots, capacity):
            self.decode_runner = None  # free the old pool first
            self.decode_runner = DecodeRunner(self, slots, capacity, self.cuda_graph, self.graph_backend)
        return self.decode_runner


# ---- running the SPMD program -------------------------------------------------------------------
class Runtime:
    """A loaded shard directory; methods run on every rank and return rank-independent results."""

    def __init__(
        self,
        shards: str | Path,
        device: str = "cpu",
        backend: str = "auto",
        prefill_chunk: int | None = None,
        mode: str = "auto",
        trust_remote_code: bool = False,
        cuda_graph: bool = True,
        prefill_tokens: int | None = None,
        verify_files: bool = True,
        forward_options: dict[str, Any] | None = None,
        memory_budget: int | None = None,
    ) -> None:
        """`cuda_graph=False` keeps decode eager on CUDA (the CPU is always eager);
        `prefill_tokens` caps the prompt tokens of one prefill forward in generate (default 32768
        on CUDA, unlimited on the CPU); `verify_files=False` skips the digests of the shard files
        (their headers are checked against the manifest regardless); `forward_options` are the
        family's choices for its forward (`Family.runtime_options`, e.g. PLaMo 3's window
        convention); `memory_budget` (bytes) replaces the device's free memory in
        `max_batch="auto"` (see `memory`)."""
        timeline.mark("load_start")
        self.manifest = load_manifest(shards)
        self.memory_budget = memory_budget
        self.batch_plan: BatchPlan | None = None  # the last "auto" decision
        self.online: Any = None  # an `online.OnlineLoop` while one runs (it routes calls through itself)
        self.forward_options = family_of(self.manifest.config).check_runtime_options(forward_options or {})
        self.trust_remote_code = trust_remote_code
        self.config = self.manifest.config
        self.path = Path(shards)
        mapping = self.manifest.mapping
        self.mode = process_mode(mode)
        self._tokenizer: Any = None
        # The files this process loads, against the manifest, before any is read (shards/integrity.py):
        # side files, presence, headers; their digests are taken from the loaded bytes while they
        # are loaded (rank/weights.py), and a mismatch refuses the load there.
        verify_shard_files(self.manifest, ProcessRanks.own(self.mode, mapping.world_size), digests=False)
        ranks = open_ranks(self.mode, mapping.tp, mapping.pp, device, str(shards))
        self.rank, self.world = ranks.rank, ranks.world
        self.engines = [
            RankEngine(
                self.manifest,
                comm,
                ranks.device,
                backend,
                prefill_chunk,
                cuda_graph,
                prefill_tokens,
                self.forward_options,
                verify_files,
            )
            for comm in ranks.comms
        ]
        timeline.mark("load_end")

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the manifest's)."""
        return self.manifest.activation_dtype.torch

    @property
    def kernels(self) -> str:
        """Which kernel backend runs: "torch" or "triton"."""
        return self.engines[0].ops.__name__.rsplit(".", 1)[-1].removesuffix("_ops")

    @property
    def is_main(self) -> bool:
        """True on the process that should print and write results (rank 0)."""
        return self.rank == 0

    def _spmd(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if len(self.engines) == 1:
            return getattr(self.engines[0], method)(*args, **kwargs)
        results: list[Any] = [None] * len(self.engines)
        errors: list[BaseException] = []

        def run(r: int) -> None:
            try:
                results[r] = getattr(self.engines[r], method)(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.world.abort()

        threads = [threading.Thread(target=run, args=(r,), name=f"plamo2-rank{r}") for r in range(len(self.engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results[0]

    def prompt_logits(self, seqs: Sequence[Sequence[int]]) -> list[Tensor]:
        self._check(seqs)
        self._not_online("prompt_logits")
        return self._spmd("prompt_logits", seqs)

    def score(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        return [(t.logprobs, t.greedy) for t in self.token_scores(seqs, starts)]

    def token_scores(self, seqs: Sequence[Sequence[int]], starts: Sequence[int], top_k: int = 0) -> list[TokenScores]:
        """Log-probabilities of seq[p] for p >= start, whether each is the argmax, and the top_k
        alternatives (while an online loop runs, computed inside it, between two of its steps)."""
        self._check(seqs)
        if any(not 1 <= st <= len(s) for s, st in zip(seqs, starts, strict=True)):
            raise ValueError("score: each start must be in [1, len(sequence)]")
        if self.online is not None:
            return self.online.token_scores(seqs, starts, top_k)
        return self._spmd("token_scores", seqs, starts, top_k)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], **kwargs: Any
    ) -> Generation:
        """`RankEngine.generate` on every rank.  `max_batch="auto"` is resolved once here (thread
        ranks share the device) or by all torchrun ranks together; `batch_plan` keeps the answer.
        While an online loop runs, the prompts are submitted to it and this waits for them."""
        self._check(prompts)
        if self.online is not None:
            return self.online.generate(prompts, max_new_tokens, **kwargs)
        if kwargs.get("max_batch") == "auto":
            limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
            live = [len(p) + int(m) for p, m in zip(prompts, limits, strict=True) if int(m) > 0]
            if live and self.mode != "dist":
                kwargs["max_batch"] = self.auto_batch_size(max(live), kwargs.pop("memory_budget", None)).slots
            elif not live:
                kwargs["max_batch"] = None
        kwargs.setdefault("memory_budget", self.memory_budget)
        gen = self._spmd("generate", prompts, max_new_tokens, **kwargs)
        if self.mode == "dist":
            self.batch_plan = self.engines[0].last_plan or self.batch_plan
        return gen

    def prepare_decode(self, slots: int, capacity: int, modes: Sequence[str] = ("greedy",)) -> None:
        """Warm-up: allocate a pool of `slots` decode slots of `capacity` tokens and capture the decode
        graphs of every bucket for these sampling modes, so that later `generate` calls that fit it
        start at once."""
        self._not_online("prepare_decode")
        self._spmd("prepare_decode", slots, capacity, list(modes))

    def auto_batch_size(self, capacity: int, memory_budget: int | None = None) -> BatchPlan:
        """How many decode slots of `capacity` tokens fit (`memory`); logged on rank 0 and kept in
        `batch_plan`.  On torchrun ranks this is collective (every rank must call it)."""
        budget = memory_budget if memory_budget is not None else self.memory_budget
        if self.mode == "dist":
            plan = self.engines[0].auto_batch(capacity, budget)
        else:
            per_slot = once = 0
            for eng in self.engines:  # thread ranks share one device
                a, b = eng.bytes_per_rank(capacity)
                per_slot, once = per_slot + a, once + b
            dev = self.engines[0].device
            if budget is None:
                budget = device_budget(dev, [e.decode_runner for e in self.engines])
            plan = plan_batch(per_slot, once, budget, capacity)
        if self.is_main:
            log.info("%s", plan.describe())
        self.batch_plan = plan
        return plan

    def _not_online(self, what: str) -> None:
        if self.online is not None:
            raise UserError(f"{what} cannot run while an online loop serves this runtime (stop it first)")

    def _check(self, seqs: Sequence[Sequence[int]]) -> None:
        if not seqs or any(len(s) == 0 for s in seqs):
            raise UserError("every sequence needs at least one token")
        check_token_ids(seqs, self.config.vocab_size)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path, self.trust_remote_code)
        return self._tokenizer

    def close(self, clean: bool = True) -> None:
        self.engines = []
        if self.mode == "dist" and clean:  # after a failure the other ranks may never reach the barrier
            shutdown_distributed()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The directory's tokenizer: PLaMo's tokenizer.jsonl natively (in the flavour its model family
    declares where its tokenizer config names none) unless trust_remote_code asks for the
    checkpoint's own code, else AutoTokenizer (see plamo2_tools.tokenizer.load_tokenizer)."""
    from ...model.registry import tokenizer_flavour
    from ...tokenizer import load_tokenizer as load

    return load(path, trust_remote_code=trust_remote_code, flavour=tokenizer_flavour(path))


@contextmanager
def load_engine(shards: str | Path, device: str = "cpu", backend: str = "auto", **kwargs: Any):  # type: ignore[no-untyped-def]
    runtime = Runtime(shards, device=device, backend=backend, **kwargs)
    try:
        yield runtime
    finally:
        runtime.close()
