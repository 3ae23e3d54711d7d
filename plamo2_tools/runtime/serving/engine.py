"""The SPMD program every rank runs (prompt logits and scores in chunked prefills; generation by
continuous batching over decode slots, CUDA-graph decode steps and tokens chosen on the GPU, see
`generation`, `graphs`, `sampling`), and the `Runtime` that runs it: as real torchrun ranks (one
rank per process) or as threads of one process.

Every rank sees the same inputs and, through a broadcast from the last stage, the same sampled
tokens, so all ranks walk the same loop in lock-step and any rank can return the results.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import UserError
from ...kernels import get_ops
from ...model import family_of
from ...model.forward import Comm, LayerState
from ...parallel import RankInfo
from ...shards.integrity import verify_shard_files
from ...shards.manifest import Manifest, load_manifest
from ..rank.comm import DistComm, LocalComm, LocalWorld, init_distributed, shutdown_distributed
from ..rank.weights import load_rank_weights
from .core import RankCore
from .generation import GenerateOptions, GenerationLoop, make_requests
from .graphs import DecodeRunner

Tensor = torch.Tensor
StopFn = Callable[[int, list[int]], bool]


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per sequence (EOS included when it stopped there)
    logits: list[Tensor] | None = None  # per sequence (steps, V) float32, when asked for


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
    ) -> None:
        info = comm.info
        cfg = manifest.config
        ops = get_ops(backend, device)
        weights = load_rank_weights(manifest, info.rank, device)
        model = family_of(cfg).rank_model(
            cfg, manifest.mapping.stages[info.pp_rank], weights, ops, comm, dtype=manifest.activation_dtype,
            **(forward_options or {}),
        )  # fmt: skip
        super().__init__(model, cfg, comm, device, ops, prefill_chunk, cuda_graph, prefill_tokens)
        self.decode_runner: DecodeRunner | None = None

    def _prefill(self, seqs: Sequence[Sequence[int]], states: dict[int, LayerState], all_logits: bool) -> Tensor | None:
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
        states = self.new_states(len(seqs), max(len(s) for s in seqs))
        logits = self._prefill(seqs, states, all_logits=True)
        total = sum(len(s) - st for s, st in zip(seqs, starts, strict=True))
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
            result = torch.stack([logprob, greedy], dim=1)
        shared = self.share(result, (total, 2), torch.float64).cpu()
        out, offset = [], 0
        for s, st in zip(seqs, starts, strict=True):
            part = shared[offset : offset + len(s) - st]
            out.append((part[:, 0], part[:, 1].bool()))
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
        max_batch: int | None = None,
        request_keys: Sequence[int] | None = None,
        sync_every: int = 8,
    ) -> Generation:
        """Greedy (temperature 0) or sampled continuation of every prompt (see `generation`).

        `max_new_tokens` is one limit or one per prompt.  At most `max_batch` sequences decode at
        once (default: all); a finished one's slot is refilled with the next prompt.  `stop(i,
        tokens)` ends sequence i early (e.g. on a stop string); EOS ids end it too (the EOS token is
        kept).  Sampling draws from a stream keyed on (seed, request_keys[i]) (default: i), so a
        request samples the same tokens in any batch.  Tokens are looked at every `sync_every`
        decode steps, not after each one.
        """
        S = len(prompts)
        limits = [int(max_new_tokens)] * S if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if len(limits) != S:
            raise ValueError("generate: one max_new_tokens per prompt")
        requests = make_requests(prompts, limits, seed, request_keys)
        live = [r for r in requests if r.max_new > 0]
        if live:
            slots = max(1, min(max_batch or len(live), len(live)))
            capacity = max(len(r.prompt) + r.max_new for r in live)
            runner = self._runner(slots, capacity)
            sampling = (float(temperature), float(top_p)) if temperature > 0 else (0.0, 1.0)
            runner.prepare(sampling, slots)
            options = GenerateOptions(max_batch, max(1, sync_every), return_logits)
            callback = on_token if self.comm.info.rank == 0 else None  # once, not once per thread rank
            GenerationLoop(self, runner, requests, sampling, eos_token_ids, stop, callback, options, slots).run()
        V = self.cfg.vocab_size
        logits = None
        if return_logits:
            logits = [torch.stack(r.logits) if r.logits else torch.empty(0, V) for r in requests]
        return Generation([r.tokens for r in requests], logits)

    def _runner(self, slots: int, capacity: int) -> DecodeRunner:
        """The decode slot pool (and its graphs), kept between calls while it is big enough."""
        if self.decode_runner is None or not self.decode_runner.fits(slots, capacity):
            self.decode_runner = None  # free the old pool first
            self.decode_runner = DecodeRunner(self, slots, capacity, self.cuda_graph)
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
    ) -> None:
        """`cuda_graph=False` keeps decode eager on CUDA (the CPU is always eager);
        `prefill_tokens` caps the prompt tokens of one prefill forward in generate (default 32768
        on CUDA, unlimited on the CPU); `verify_files=False` skips the digests of the shard files
        (their headers are checked against the manifest regardless); `forward_options` are the
        family's choices for its forward (`Family.runtime_options`, e.g. PLaMo 3's window
        convention)."""
        self.manifest = load_manifest(shards)
        self.forward_options = family_of(self.manifest.config).check_runtime_options(forward_options or {})
        self.trust_remote_code = trust_remote_code
        self.config = self.manifest.config
        self.path = Path(shards)
        mapping = self.manifest.mapping
        self.mode = ("dist" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "local") if mode == "auto" else mode
        self._tokenizer: Any = None
        # The files this process loads, against the manifest, before any is used (shards/integrity.py).
        own = [int(os.environ.get("RANK", "0"))] if self.mode == "dist" else range(mapping.world_size)
        verify_shard_files(self.manifest, own, digests=verify_files)
        if self.mode == "dist":
            rank, world, local_device = init_distributed(device)
            if world != mapping.world_size:
                raise UserError(
                    f"{shards} has {mapping.world_size} ranks (tp={mapping.tp} pp={mapping.pp}) "
                    f"but torchrun started {world}"
                )
            self.rank = rank
            comm = DistComm(RankInfo(rank, mapping.tp, mapping.pp))
            self.engines = [
                RankEngine(
                    self.manifest,
                    comm,
                    local_device,
                    backend,
                    prefill_chunk,
                    cuda_graph,
                    prefill_tokens,
                    self.forward_options,
                )  # fmt: skip
            ]
        else:
            self.rank = 0
            self.world = LocalWorld(mapping.tp, mapping.pp)
            dev = torch.device(device)
            if dev.type == "cpu" and mapping.world_size > 1:
                # Every rank thread would otherwise use the whole intra-op pool: oversubscription.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // mapping.world_size))
            self.engines = [
                RankEngine(
                    self.manifest,
                    LocalComm(self.world, r),
                    dev,
                    backend,
                    prefill_chunk,
                    cuda_graph,
                    prefill_tokens,
                    self.forward_options,
                )  # fmt: skip
                for r in range(mapping.world_size)
            ]

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the manifest's)."""
        return self.manifest.activation_dtype

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
        return self._spmd("prompt_logits", seqs)

    def score(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        self._check(seqs)
        if any(not 1 <= st <= len(s) for s, st in zip(seqs, starts, strict=True)):
            raise ValueError("score: each start must be in [1, len(sequence)]")
        return self._spmd("score", seqs, starts)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs: Any) -> Generation:
        self._check(prompts)
        return self._spmd("generate", prompts, max_new_tokens, **kwargs)

    def _check(self, seqs: Sequence[Sequence[int]]) -> None:
        V = self.config.vocab_size
        if not seqs or any(len(s) == 0 for s in seqs):
            raise UserError("every sequence needs at least one token")
        bad = sorted({t for s in seqs for t in s if not 0 <= t < V})
        if bad:
            raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {V})")

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
    """The directory's tokenizer: PLaMo's tokenizer.jsonl natively unless trust_remote_code asks for
    the checkpoint's own code, else AutoTokenizer (see plamo2_tools.tokenizer.load_tokenizer)."""
    from ...tokenizer import load_tokenizer as load

    return load(path, trust_remote_code=trust_remote_code)


@contextmanager
def load_engine(shards: str | Path, device: str = "cpu", backend: str = "auto", **kwargs: Any):  # type: ignore[no-untyped-def]
    runtime = Runtime(shards, device=device, backend=backend, **kwargs)
    try:
        yield runtime
    finally:
        runtime.close()
