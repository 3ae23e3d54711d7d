"""What a deployment under test gives back, whatever runs it (the seam every target implements).

Positions: a sequence `ids[0..n-1]` scored teacher-forced has n-1 next-token predictions, the one
at position i made after reading `ids[:i+1]` (so position i predicts `ids[i+1]`).  `Scores` holds
them from `start` on (earlier positions are context only: a target's prompt-logprob API may not
give position 0's, and a GGUF runtime scores only what it evaluated).

Distributions are natural-log probabilities, float64, over the *model's* vocabulary (the
checkpoint's `vocab_size`, not the padded one; a target that pads cuts its padding before
returning).  A target that yields full logits fills `logprobs`; one that yields only its top-K
(servers' `logprobs: K`) fills `top` and says so with `full_logits = False` and `top_k`, and the
comparison says which kind of KL it computed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import Plamo2Error, UserError
from ..jsonio import CONFIG_BYTES, read_object


@dataclass(frozen=True)
class Scores:
    """Teacher-forced scores of one sequence, positions `start .. n-2` (module docstring)."""

    start: int
    token_logprobs: np.ndarray  # (n-1-start,) float64: log p(ids[i+1] | ids[:i+1])
    logprobs: np.ndarray | None = None  # (n-1-start, V) float64 log-softmax, when the target gives full logits
    top: list[dict[int, float]] | None = None  # per position {token id: logprob}, its top-K, otherwise


@dataclass(frozen=True)
class Continuation:
    """A greedy (temperature 0) continuation of one prompt and what the target said of each step."""

    tokens: list[int]
    token_logprobs: list[float]  # log p of each chosen token, as the target reported it
    logprobs: np.ndarray | None = None  # (len(tokens), V) float64, when the target gives full logits
    top: list[dict[int, float]] | None = None  # per step, its top-K otherwise
    finish_reason: str | None = None  # "length", "stop" (an end-of-text the target decided), ...


class Target(Protocol):
    """One deployment under test.  Implementations live one per file in this package."""

    kind: str  # "shards" | "server" | "gguf" | "mlx" | "fp8"
    location: str  # what the user named (a path or a base URL), for the report
    full_logits: bool  # whether Scores.logprobs / Continuation.logprobs are filled
    top_k: int  # how many alternatives `top` holds when not full (0 when full)

    def info(self) -> dict[str, Any]:
        """What runs the model, for the report: runtime name and version, model id, dtype or
        quantization, what the target declares about RoPE, windows, end-of-text ids.  The key
        `precision` ("float32", "bfloat16", "float16", or a quantization such as "q8_0"), when
        the target knows it, picks the thresholds (`compare.THRESHOLDS`; any other name is judged
        as "quantized"); a target that cannot know it (a server) leaves it out."""
        ...

    def can_score(self) -> bool:
        """Whether `score` works (a server without prompt logprobs, e.g. llama-server, cannot)."""
        ...

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        """Teacher-forced scores of every sequence from position `start` on."""
        ...

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        """Greedy continuations, ignoring end-of-text (every prompt gets max_new_tokens tokens when
        the target allows it; a target that stops early says why in finish_reason)."""
        ...

    def tokenize(self, text: str) -> list[int] | None:
        """The target's own tokenization of `text` (no special tokens added), or None when it has
        no way to say (tokenizer parity is then not checked)."""
        ...

    def close(self) -> None: ...


class DirectoryTokenizer:
    """PLaMo's own tokenizer of a model directory (an MLX or FP8 export, a copied checkpoint), loaded
    on first use: the `tokenize` of targets that carry the checkpoint's tokenizer files.  None for a
    directory without PLaMo's vocabulary (parity is then not checked)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokenizer: Any = None

    def __call__(self, text: str) -> list[int] | None:
        from ..tokenizer import has_plamo_vocab, load_native

        if not has_plamo_vocab(self.path):
            return None
        if self._tokenizer is None:
            self._tokenizer = load_native(self.path)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


# kind -> "module:Class"; imported only when a target of that kind is opened (optional extras).
TARGETS: dict[str, str] = {
    "shards": "plamo2_tools.deploy.shards:ShardsTarget",
    "server": "plamo2_tools.deploy.server:ServerTarget",
    "gguf": "plamo2_tools.deploy.gguf:GGUFTarget",
    "mlx": "plamo2_tools.deploy.mlx:MLXTarget",
    "fp8": "plamo2_tools.deploy.fp8:FP8Target",
}


def is_fp8_config(config_path: Path) -> bool:
    """Whether config.json says compressed-tensors float-quantized (the FP8 target's mark); a
    missing or unreadable file says no (the caller's own reader refuses it in one line)."""
    try:
        raw = read_object(config_path, CONFIG_BYTES, "a config")
    except Plamo2Error:  # detection only: the opener reports what is wrong, in one line
        return False
    q = raw.get("quantization_config")
    return (
        isinstance(q, dict) and q.get("quant_method") == "compressed-tensors" and q.get("format") == "float-quantized"
    )


def detect_kind(spec: str) -> str:
    """Which kind of target a command-line argument names: an http(s):// base URL, a .gguf file,
    a shard directory (our manifest), or an MLX model directory (config.json + safetensors that
    mlx-lm's layout names).  Refuses anything else in one line."""
    if spec.startswith(("http://", "https://")):
        return "server"
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise UserError(f"{spec}: no such GGUF file")
        return "gguf"
    if path.is_dir():
        from ..shards.manifest import MANIFEST_NAME

        if (path / MANIFEST_NAME).is_file():
            return "shards"
        if is_fp8_config(path / "config.json"):
            return "fp8"
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return "mlx"
        raise UserError(f"{spec}: neither a shard directory nor an MLX model directory (no config.json + safetensors)")
    if path.exists():
        raise UserError(f"{spec}: not a target (a shard or MLX directory, a .gguf file or an http(s):// URL)")
    raise UserError(f"{spec}: no such file or directory")


def open_target(kind: str, spec: str, **options: Any) -> Target:
    """Open a target of `kind` (see TARGETS).  `options` are what `verify` knows (the reference's
    `vocab_size`, `token_texts`, the runtime's `device`, a server's `api_key`, ...); each adapter
    gets those its constructor names (all of them if it takes **kwargs), so one call opens any
    kind and an adapter declares only what it uses."""
    module, _, cls = TARGETS[kind].partition(":")
    try:
        adapter = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise UserError(
            f"{spec}: verifying a {kind} target needs {e.name or 'an optional package'} "
            f"(pip install 'plamo2-tools[{kind}]')"
        ) from None
    params = inspect.signature(adapter).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = {k: v for k, v in options.items() if k in params}
    return adapter(spec, **options)
