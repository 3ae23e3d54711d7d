"""A compressed-tensors FP8 checkpoint (what `export fp8` writes, llm-compressor's FP8_DYNAMIC) as a
verify target: the W8A8 forward vLLM's `CompressedTensorsW8A8Fp8` computes, simulated on CPU.

The directory's own files are read back (`HFCheckpoint`: index, headers, bounds), every quantized
weight dequantized as compressed-tensors decompresses it (`q.to(scale.dtype) * scale`,
`export/fp8_format.dequantize_rows`), and the family's reference forward runs on those weights with
every input of a quantized linear first rounded to e4m3fn with its own per-token scale
(`max(amax / 448, 1 / (448 * 512))`, vLLM's dynamic per-token rule); the matmul then runs in the
forward's precision, not in FP8 GEMM arithmetic.  Detected by `config.json`'s `quantization_config`
(`quant_method` compressed-tensors, `format` float-quantized).  Full logits; the precision it
declares is "fp8", judged with the quantized thresholds (compare.THRESHOLDS).  Imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT16, FLOAT32
from ..errors import CheckpointError, UserError
from ..model.checkpoint import HFCheckpoint
from ..model.registry import hf_tensor_shapes
from ..shards.owned import ensure_readable_checkpoint
from .compare import log_softmax
from .target import Continuation, DirectoryTokenizer, Scores, is_fp8_config

PRECISION = "fp8"  # not a key of compare.THRESHOLDS: judged as "quantized"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPES = (FLOAT32, BFLOAT16, FLOAT16)
MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for a dynamic per-token scale
SCALE_SUFFIX = ".weight_scale"


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3fn per row (token) with scale max(amax / 448, 1 / (448 * 512)), back in x's dtype."""
    x = x.as_subclass(torch.Tensor)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


class W8A8Weight(torch.Tensor):
    """A dequantized FP8 weight: `x @ w.T` first rounds x to e4m3fn with one scale per token (row of x)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # `a @ w` arrives as TensorBase.matmul (a plain tensor's __matmul__), torch.matmul as itself.
        if (
            getattr(func, "__name__", None) in ("matmul", "__matmul__")
            and len(args) == 2
            and type(args[1]) is cls
            and type(args[0]) is not cls
        ):
            return torch.matmul(fake_quantize_tokens(args[0]), args[1].as_subclass(torch.Tensor))
        return super().__torch_function__(func, types, args, kwargs or {})


class DequantizedWeights:
    """What a family's reference forward reads (`config`, `tensors`, `get`): the export's tensors,
    quantized ones dequantized (and W8A8-wrapped unless `activations` is False)."""

    def __init__(self, ckpt: HFCheckpoint, names: Sequence[str], quantized: set[str], activations: bool) -> None:
        self.config, self.tensors = ckpt.config, list(names)
        self._ckpt, self._quantized, self._activations = ckpt, quantized, activations

    def get(self, name: str) -> torch.Tensor:
        if name not in self._quantized:
            return self._ckpt.get(name)
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
        # compressed-tensors' decompression (`_dequantize`): q.to(scale.dtype) * scale, in the scale's dtype
        s = self._ckpt.get(scale_name)
        t = self._ckpt.get(name).to(s.dtype) * s
        return t.as_subclass(W8A8Weight) if self._activations else t


def quantized_names(ckpt: HFCheckpoint, where: str) -> set[str]:
    """The FP8 weights of the directory (each with its [rows, 1] scale), refusing in one line any
    tensor the family does not name or a weight without its scale."""
    expected = hf_tensor_shapes(ckpt.config)
    quantized, problems = set(), []
    for name, info in ckpt.tensors.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX) + ".weight"
            w = ckpt.tensors.get(weight)
            if w is None or w.dtype != FLOAT8_E4M3 or info.shape != (w.shape[0], 1) or info.dtype not in SCALE_DTYPES:
                problems.append(f"{name} {list(info.shape)}: no FP8 weight it scales")
            continue
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
        elif info.shape != tuple(expected[name]):
            problems.append(f"{name}: shape {list(info.shape)}, expected {list(expected[name])}")
        elif info.dtype == FLOAT8_E4M3:
            if name.removesuffix(".weight") + SCALE_SUFFIX not in ckpt.tensors:
                problems.append(f"{name}: FP8 without its {SCALE_SUFFIX}")
            quantized.add(name)
        elif not info.dtype.is_floating_point:
            problems.append(f"{name}: not a float tensor")
    problems += [f"missing tensor {n}" for n in expected if n not in ckpt.tensors]
    if problems:
        raise CheckpointError(
            f"{where}: not an FP8 export of this model ({len(problems)} problem(s)): " + "; ".join(problems[:5])
        )
    if not quantized:
        raise CheckpointError(f"{where}: config.json says FP8 but no tensor is float8_e4m3fn")
    return quantized


class FP8Target:
    """A compressed-tensors FP8 directory, run as vLLM runs it (the module docstring)."""

    kind = "fp8"
    full_logits = True
    top_k = 0

    def __init__(
        self,
        spec: str,
        dtype: str = "float64",
        activations: bool = True,
        check_writer: bool = True,
        reference_config: Any = None,
    ) -> None:
        """`dtype`: the forward's precision (float64, or float32 for a big model on CPU);
        `activations` False runs the dequantized weights alone (weight-only); `check_writer`:
        refuse a directory one of our writers is still writing (export's own verification, which
        holds it, passes False)."""
        if dtype not in ("float64", "float32"):
            raise UserError(f"{spec}: the FP8 target computes in float64 or float32, not {dtype}")
        self.location, self.path = spec, Path(spec)
        if check_writer:
            ensure_readable_checkpoint(self.path)
        if not is_fp8_config(self.path / "config.json"):
            raise UserError(f"{spec}: config.json has no compressed-tensors float-quantized quantization_config")
        self.ckpt = HFCheckpoint(self.path)
        try:
            self.config, self.family = self.ckpt.config, self.ckpt.family
            if reference_config is not None and hf_tensor_shapes(self.config) != hf_tensor_shapes(reference_config):
                raise UserError(f"{spec} is not shaped like the reference")
            self.quantized = quantized_names(self.ckpt, spec)
        except BaseException:
            self.ckpt.close()
            raise
        self.names = list(hf_tensor_shapes(self.config))
        self.dtype, self.activations = dtype, activations
        self._tokenize = DirectoryTokenizer(self.path)

    def info(self) -> dict[str, Any]:
        return {
            "runtime": "plamo2-tools FP8 W8A8 simulation (the family's reference forward)",
            "precision": PRECISION,
            "compute_dtype": self.dtype,
            "activations": "e4m3fn per token, dynamic" if self.activations else "unquantized (weights only)",
            "quantized_linears": len(self.quantized),
            "vocab_size": self.config.vocab_size,
        }

    def _logprobs(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        weights = DequantizedWeights(self.ckpt, self.names, self.quantized, self.activations)
        logits = self.family.reference_logits(weights, [list(s) for s in seqs], getattr(torch, self.dtype))
        return [log_softmax(lg.double().numpy()) for lg in logits]

    def can_score(self) -> bool:
        return True

    def score(self, seqs: Sequence[Sequence[int]], start: int = 0) -> list[Scores]:
        out = []
        for seq, lp in zip(seqs, self._logprobs(seqs), strict=True):
            rows = lp[start : len(seq) - 1]
            nxt = np.asarray(seq[start + 1 :], dtype=np.int64)
            out.append(Scores(start, rows[np.arange(len(nxt)), nxt], rows))
        return out

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Continuation]:
        """A full forward per step (no cache), every prompt at once; end-of-text ignored."""
        current = [list(p) for p in prompts]
        rows: list[list[np.ndarray]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            for i, lp in enumerate(self._logprobs(current)):
                rows[i].append(lp[-1])
                current[i].append(int(np.argmax(lp[-1])))
        out = []
        for p, c, r in zip(prompts, current, rows, strict=True):
            tokens = c[len(p) :]
            lp = np.stack(r) if r else np.empty((0, self.config.vocab_size))
            out.append(Continuation(tokens, [float(x[t]) for x, t in zip(r, tokens, strict=True)], lp, None, "length"))
        return out

    def tokenize(self, text: str) -> list[int] | None:
        return self._tokenize(text)

    def close(self) -> None:
        self.ckpt.close()


__all__ = ["FP8Target", "fake_quantize_tokens", "is_fp8_config"]
