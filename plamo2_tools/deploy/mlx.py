"""An MLX model directory run by mlx-lm (`pip install 'plamo2-tools[mlx]'`: `mlx[cpu]` runs on Linux).

The model is mlx-lm's own: `mlx_lm.utils.load_model` (what `mlx_lm.load` runs for the model: its
model class for the config's model_type, `sanitize`, the per-module quantization of the config)
and, for greedy continuations, `mlx_lm.generate.generate_step` with its prompt cache and greedy
sampler, so what is measured is what an mlx-lm user runs.  Only the tokenizer is ours: mlx-lm's
tokenizer for PLaMo is the checkpoint's remote code (`AutoTokenizer`, `trust_remote_code`, and
numba for PFN's `tokenization_plamo.py`), so `tokenize` uses the native PLaMo tokenizer of the
directory (docs/tokenizer.md), which gives the same ids.

Teacher-forced scores are one full forward per sequence (mlx-lm's prefill path, every position's
logits), cast to float64 and log-softmaxed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx  # an ImportError here is open_target's cue to name the [mlx] extra
import mlx_lm
import numpy as np
from mlx_lm.utils import load_model

from ..errors import CheckpointError, UserError
from ..model.registry import family_of, load_config
from ..shards.owned import ensure_readable_checkpoint
from .compare import log_softmax
from .target import Continuation, DirectoryTokenizer, Scores


class MLXTarget:
    kind = "mlx"
    full_logits = True
    top_k = 0

    def __init__(self, spec: str, check_writer: bool = True) -> None:
        """`check_writer`: refuse a directory being written or left unfinished by one of our
        writers (export's own verification, which holds the directory, passes False).  No other
        option: `open_target` passes an adapter only the options its constructor names."""
        self.location = spec
        self.path = Path(spec)
        if check_writer:
            ensure_readable_checkpoint(self.path)
        self.config = load_config(self.path)  # ours: refuses what is not a PLaMo config in one line
        self.family = family_of(self.config)
        try:
            self.model, self.mlx_config = load_model(self.path)
        except (ValueError, FileNotFoundError, KeyError, IndexError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{spec}: mlx-lm cannot load it ({type(e).__name__}: {e})") from None
        self._versions = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
        self._tokenize = DirectoryTokenizer(self.path)

    def info(self) -> dict[str, Any]:
        layout = self.family.mlx_layout()
        differences = [vars(d) for d in layout.differences(self.config)] if layout is not None else []
        quant = self.mlx_config.get("quantization")
        return {
            "runtime": "mlx-lm",
            "versions": self._versions,
            "device": str(mx.default_device()),
            "model_type": self.mlx_config.get("model_type"),
            "quantization": quant,
            "dtype": self._dtype(),
            "precision": self._precision(quant),
            "vocab_size": self.config.vocab_size,
            "eos_token_ids": list(self.config.eos_token_ids),
            "known_differences": differences,
            "differences_read_from": f"mlx-lm {layout.mlx_lm_version}" if layout is not None else None,
        }

    def _dtype(self) -> str:
        from mlx.utils import tree_flatten

        dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(self.model.parameters())})
        return ",".join(dtypes)

    def _precision(self, quant: Any) -> str:
        """What the thresholds are picked by (target.Target.info): a quantized directory is
        "mlx-affine-<bits>bit" (judged as quantized), otherwise its least precise float type."""
        if isinstance(quant, dict):
            return f"mlx-affine-{quant.get('bits')}bit"
        dtypes = set(self._dtype().split(","))
        return next((d for d in ("bfloat16", "float16") if d in dtypes), "float32")

    def can_score(self) -> bool:
        return True

    def _forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (T, V) of one sequence, one forward without a cache (mlx-lm's prefill math)."""
        bad = [t for t in ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        try:
            logits = self.model(mx.array([list(map(int, ids))], dtype=mx.int32))[0]
            return np.array(logits.astype(mx.float32))[:, : self.config.vocab_size]
        except (IndexError, ValueError, RuntimeError) as e:  # mlx-lm refusing a geometry it cannot run
            raise CheckpointError(f"{self.location}: mlx-lm cannot run this model ({type(e).__name__}: {e})") from None

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        out = []
        for seq in seqs:
            logprobs = log_softmax(self._forward(seq))[start : len(seq) - 1]
            nxt = np.asarray(seq[start + 1 :], dtype=np.int64)
            out.append(Scores(start, logprobs[np.arange(len(nxt)), nxt], logprobs))
        return out

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        """mlx-lm's own decode loop (`generate_step`: prompt cache, greedy sampler), end-of-text ignored."""
        from mlx_lm.generate import generate_step

        out = []
        for prompt in prompts:
            self._forward(prompt[:1])  # the vocabulary and geometry checks, with one-line refusals
            tokens: list[int] = []
            rows: list[np.ndarray] = []
            try:
                steps = generate_step(
                    mx.array(list(map(int, prompt)), dtype=mx.int32), self.model, max_tokens=max_new_tokens
                )
                for token, logprobs in steps:
                    tokens.append(int(token))
                    rows.append(log_softmax(np.array(logprobs.astype(mx.float32))[: self.config.vocab_size]))
            except (IndexError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{self.location}: mlx-lm cannot decode ({type(e).__name__}: {e})") from None
            logprobs_all = np.stack(rows) if rows else np.empty((0, self.config.vocab_size))
            chosen = [float(r[t]) for r, t in zip(rows, tokens, strict=True)]
            out.append(Continuation(tokens, chosen, logprobs_all, finish_reason="length"))
        return out

    def tokenize(self, text: str) -> list[int] | None:
        return self._tokenize(text)

    def close(self) -> None:
        self.model = None
