"""Our own runtime on a shard directory as a verify target (what `verify SHARDS` always checked).

Full logits at every position: teacher-forced scores from one prefill over each sequence
(`Runtime.prompt_logits`), greedy continuations from the continuous-batching loop with the logits
of every decode step (`Runtime.generate(return_logits=True)`, no end-of-text), both as float64
log-softmax of the runtime's float32 logits.  In-process the ranks are threads of one `Runtime`
kept open between calls; with `launch` every call is a job on fresh torchrun ranks (`run_job`).
The shard files are checked against the manifest when the target opens, so a damaged layout is
refused in one line before the (long) reference forward starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import UserError
from ..model import hf_tensor_shapes
from ..shards.integrity import verify_shard_files
from ..shards.manifest import load_manifest
from ..version import __version__
from .compare import log_softmax
from .target import Continuation, Scores


def logits_job(rt: Any, seqs: list[list[int]]) -> list[Any]:
    """float32 logits (len, V) of every position of every sequence (a `run_job` job)."""
    return rt.prompt_logits(seqs)


def greedy_job(rt: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy tokens and the float32 logits of every step, end-of-text ignored (a `run_job` job)."""
    gen = rt.generate(prompts, max_new_tokens, return_logits=True)
    return {"tokens": gen.tokens, "logits": gen.logits, "finish_reasons": gen.finish_reasons}


class ShardsTarget:
    """A shard directory run by the bundled runtime (see the module docstring)."""

    kind = "shards"
    full_logits = True
    top_k = 0

    def __init__(
        self,
        spec: str,
        device: str = "cpu",
        backend: str = "auto",
        launch: bool = False,
        prefill_chunk: int | None = None,
        forward_options: dict[str, Any] | None = None,
        verify_files: bool = True,
        reference_config: Any = None,
    ) -> None:
        """`reference_config` (the checkpoint `verify` compares with): the shards must have been
        converted from a checkpoint of its shapes, or the comparison is refused in one line."""
        self.location = spec
        self.manifest = load_manifest(spec)
        shapes = hf_tensor_shapes(self.manifest.config)
        if reference_config is not None and shapes != hf_tensor_shapes(reference_config):
            raise UserError(f"{spec} was not converted from a checkpoint shaped like the reference")
        world = self.manifest.mapping.world_size
        verify_shard_files(self.manifest, range(world), digests=verify_files)
        self.launch = launch
        # Checked just now: the runtime need not hash the files again.
        self.runtime = {
            "shards": spec,
            "device": device,
            "backend": backend,
            "prefill_chunk": prefill_chunk,
            "verify_files": False,
            "forward_options": dict(forward_options or {}),
        }
        self._rt: Any = None
        self._tokenizer: Any = None

    def _run(self, job: Any, args: dict[str, Any]) -> Any:
        if self.launch:
            from ..runtime.process.jobs import run_job

            return run_job(job, self.runtime, args, launch=True)
        if self._rt is None:
            from ..runtime.batching.engine import Runtime

            self._rt = Runtime(**self.runtime, mode="auto")
        return job(self._rt, **args)

    def info(self) -> dict[str, Any]:
        m = self.manifest.mapping
        return {
            "runtime": f"plamo2-tools {__version__}",
            "shards": self.location,
            "tp": m.tp,
            "pp": m.pp,
            "world_size": m.world_size,
            "precision": dtype_name(self.manifest.activation_dtype),
            "device": self.runtime["device"],
            "backend": self.runtime["backend"],
            "launch": self.launch,
            "forward_options": self.runtime["forward_options"],
        }

    def can_score(self) -> bool:
        return True

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        logits = self._run(logits_job, {"seqs": [list(s) for s in seqs]})
        out = []
        for s, lg in zip(seqs, logits, strict=True):
            lp = log_softmax(lg.double().numpy()[start : len(s) - 1])
            nxt = np.asarray(s[start + 1 :], dtype=np.int64)
            out.append(Scores(start, lp[np.arange(len(nxt)), nxt], logprobs=lp))
        return out

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        got = self._run(greedy_job, {"prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens})
        out = []
        reasons = got.get("finish_reasons") or [None] * len(prompts)
        for tokens, lg, why in zip(got["tokens"], got["logits"], reasons, strict=True):
            lp = log_softmax(lg.double().numpy())
            chosen = lp[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] if tokens else np.zeros(0)
            out.append(Continuation(list(tokens), chosen.tolist(), logprobs=lp, finish_reason=why))
        return out

    def tokenize(self, text: str) -> list[int] | None:
        if self._tokenizer is None:
            from ..runtime.batching.engine import load_tokenizer

            self._tokenizer = load_tokenizer(Path(self.location))
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def close(self) -> None:
        if self._rt is not None:
            self._rt.close()
            self._rt = None


__all__ = ["ShardsTarget", "greedy_job", "logits_job"]
