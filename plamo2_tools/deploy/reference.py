"""The judge: the float64 reference forward of the HF checkpoint (`Family.reference_logits`),
as numpy log-probabilities, under each of the family's forward conventions.

A family may declare choices of its forward (`Family.runtime_options`, e.g. PLaMo 3's window
convention: PFN's HF code lets a sliding-window query see W + 1 keys, vLLM and llama.cpp W).  Which
one a deployment follows is a property of its runtime, not an error, so a target is compared under
every combination the user did not pin (`conventions`), and the report says which it follows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..model.checkpoint import HFCheckpoint
from ..shards.owned import ensure_readable_checkpoint

Options = dict[str, Any]


def convention_label(options: Options) -> str:
    """How a report names a set of forward options ("window_convention=hf"; "default": none)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "default"


@dataclass(frozen=True)
class Greedy:
    """The reference's greedy continuation of every prompt and its log-probs along prompt +
    continuation (rows = positions 0 .. len - 2 of that sequence)."""

    tokens: list[list[int]]
    logprobs: list[np.ndarray]


class Reference:
    """One HF checkpoint's reference forward (opened per call: it holds no file between them)."""

    def __init__(self, path: Path, precision: str = "float64", device: str = "cpu") -> None:
        from ..errors import UserError

        if precision not in ("float64", "float32"):
            raise UserError("--precision must be float64 or float32")
        ensure_readable_checkpoint(path)
        with HFCheckpoint(path) as ckpt:
            ckpt.check_inventory()
            self.family = ckpt.family
            self.config = ckpt.config
        import torch  # after the checks: a refusal costs no torch import (issue 33)

        self.path = path
        self.precision = precision
        self.dtype = getattr(torch, precision)
        self.device = device

    def conventions(self, pinned: Options | None = None) -> list[Options]:
        """Every combination of the family's runtime options the user did not pin, the family's
        defaults first (a family without options: one empty set)."""
        pinned = dict(pinned or {})
        self.family.check_runtime_options(pinned)  # an unknown option or value: one line, now
        choices = {o.name: o.choices for o in self.family.runtime_options}
        free = [k for k in choices if k not in pinned]
        combos = itertools.product(*(choices[k] for k in free))
        return [self.family.check_runtime_options({**pinned, **dict(zip(free, c, strict=True))}) for c in combos]

    def logprobs(self, seqs: Sequence[Sequence[int]], options: Options) -> list[np.ndarray]:
        """float64 log-probs at positions 0 .. len - 2 of each sequence (one forward)."""
        with HFCheckpoint(self.path) as ckpt:
            logits = ckpt.family.reference_logits(ckpt, [list(s) for s in seqs], self.dtype, self.device, **options)
        return [lg[: len(s) - 1].double().log_softmax(-1).cpu().numpy() for lg, s in zip(logits, seqs, strict=True)]

    def greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        options: Options,
        progress: Callable[[int], None] | None = None,
    ) -> Greedy:
        """Greedy continuation (a full forward per step, no cache: nothing shared with any runtime),
        and the log-probs along prompt + continuation, stitched from the same forwards."""
        import torch

        from ..verify import reference_outputs

        ref = reference_outputs(
            self.path, [list(p) for p in prompts], max_new_tokens, self.dtype, self.device, progress, options
        )
        rows = []
        for prompt_logits, steps in zip(ref.prompt_logits, ref.step_logits, strict=True):
            # step k's logits are those of position len(prompt) - 1 + k: step 0 is the prompt's last row
            full = torch.cat([prompt_logits, steps[1:]]) if steps.shape[0] else prompt_logits[:-1]
            rows.append(full.double().log_softmax(-1).cpu().numpy())
        return Greedy([list(t) for t in ref.tokens], rows)


__all__ = ["Greedy", "Options", "Reference", "convention_label"]
