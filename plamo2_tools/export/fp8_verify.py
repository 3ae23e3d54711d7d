"""The FP8 export checked by construction: its own files read back, dequantized as compressed-tensors does,
and run through the family's reference forward beside the source (docs/export.md, "FP8").

Two variants of the exported model are measured against the source on the same fixed token sequences:

* `weights`: the dequantized weights alone (what a weight-only consumer computes);
* `w8a8`: the same weights, and every activation entering a quantized linear rounded to e4m3fn with its own
  per-token scale first, as FP8_DYNAMIC prescribes and vLLM's dynamic per-token kernel does (scale =
  max(amax / 448, 1 / (448 * 512)); the product then runs in the reference's precision, not in FP8 GEMM
  arithmetic).  This is the headline figure (`kl_mean`).

Per variant: mean and max KL(source || export) over all positions, top-1 agreement, the largest logit
difference and, per sequence, the first position whose argmax differs.  Imports torch (the reference forward).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import numerics
from ..dtypes import FLOAT8_E4M3, DType
from ..model.registry import family_of
from ..safetensors_io import read_array, read_header
from .fp8_format import FP8_MAX, dequantize_rows

DEFAULT_SEQUENCES, DEFAULT_TOKENS, DEFAULT_SEED = 4, 32, 0
MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for a dynamic per-token scale


def fixed_sequences(vocab: int, sequences: int, tokens: int, seed: int) -> list[list[int]]:
    """The prompt set: token ids drawn from the whole vocabulary with a fixed seed (no tokenizer needed,
    the same on every machine)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens).tolist() for _ in range(sequences)]


class Weights:
    """What a family's reference forward reads of a checkpoint: `config`, `tensors` (names) and `get(name)`."""

    def __init__(self, config: Any, names: Sequence[str], read: Callable[[str], Any]) -> None:
        self.config, self.tensors, self._read = config, list(names), read

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)


class W8A8Weight(torch.Tensor):
    """A dequantized FP8 weight: `x @ w.T` first rounds x to e4m3fn with one scale per token (row of x)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # `a @ w` arrives as TensorBase.matmul (a plain tensor's __matmul__), torch.matmul as itself.
        if getattr(func, "__name__", None) in ("matmul", "__matmul__") and len(args) == 2 \
                and type(args[1]) is cls and type(args[0]) is not cls:  # fmt: skip
            return torch.matmul(fake_quantize_tokens(args[0]), args[1].as_subclass(torch.Tensor))
        return super().__torch_function__(func, types, args, kwargs or {})


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3fn per row (token) with scale max(amax / 448, 1 / (448 * 512)), back in x's dtype."""
    x = x.as_subclass(torch.Tensor)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


class ExportReader:
    """The export's own files, read back: copies as written, quantized weights dequantized (numpy, bit for bit
    compressed-tensors' decompression)."""

    def __init__(self, out: Path, files: Sequence[str], quantized: Sequence[str]) -> None:
        self.out, self.quantized = out, set(quantized)
        self._fds: dict[str, int] = {}
        self._where: dict[str, tuple[str, Any]] = {}
        for fname in files:
            header = read_header(out / fname)
            self._fds[fname] = os.open(out / fname, os.O_RDONLY)
            for name, info in header.tensors.items():
                self._where[name] = (fname, info)

    def array(self, name: str) -> np.ndarray:
        fname, info = self._where[name]
        return read_array(self._fds[fname], info, 0, info.rows, self.out / fname).reshape(info.shape)

    def dequantized(self, name: str) -> tuple[np.ndarray, DType]:
        """The weight a consumer gets: a source name, dequantized when the export quantized it."""
        if name not in self.quantized:
            return self.array(name), self._where[name][1].dtype
        q = self.array(name)
        assert self._where[name][1].dtype == FLOAT8_E4M3, name
        scale_name = name.removesuffix(".weight") + ".weight_scale"
        dtype = self._where[scale_name][1].dtype
        return dequantize_rows(q, self.array(scale_name), dtype), dtype

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any]:
    """KL(ref || got) per position (float64), its mean and max, top-1 agreement, the largest logit difference
    and each sequence's first position whose argmax differs (None: none)."""
    kls, agree, first, max_diff = [], [], [], 0.0
    for r, g in zip(ref, got, strict=True):
        lr, lg = torch.log_softmax(r.double(), -1), torch.log_softmax(g.double(), -1)
        kls.append((lr.exp() * (lr - lg)).sum(-1))
        same = r.argmax(-1) == g.argmax(-1)
        agree.append(same)
        first.append(None if bool(same.all()) else int((~same).nonzero()[0, 0]))
        max_diff = max(max_diff, float((r.double() - g.double()).abs().max()))
    kl, top1 = torch.cat(kls), torch.cat(agree)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(top1.double().mean()),
            "max_abs_logit_diff": max_diff, "first_divergence": first, "positions": int(kl.numel())}  # fmt: skip


def verify_export(
    source: Any,
    out: Path,
    files: Sequence[str],
    quantized: Sequence[str],
    *,
    sequences: int = DEFAULT_SEQUENCES,
    tokens: int = DEFAULT_TOKENS,
    seed: int = DEFAULT_SEED,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Figures of the export in `out` against its source (a convert Source), as `plamo2_export.json` keeps them."""
    start = time.perf_counter()
    cfg = source.config
    family = family_of(cfg)
    compute = getattr(torch, dtype)
    seqs = fixed_sequences(cfg.vocab_size, sequences, tokens, seed)

    def from_source(name: str) -> torch.Tensor:
        t = source.tensors[name]
        return numerics.to_torch(source.read_rows(name, 0, t.rows), t.dtype).reshape(t.shape)

    reader = ExportReader(out, files, quantized)

    def exported(w8a8: bool) -> Callable[[str], torch.Tensor]:
        def read(name: str) -> torch.Tensor:
            values, dt = reader.dequantized(name)
            t = numerics.to_torch(values, dt).reshape(source.tensors[name].shape)
            return t.as_subclass(W8A8Weight) if w8a8 and name in reader.quantized else t

        return read

    try:
        names = list(source.tensors)
        ref = family.reference_logits(Weights(cfg, names, from_source), seqs, compute)
        variants = {
            "weights": compare(ref, family.reference_logits(Weights(cfg, names, exported(False)), seqs, compute)),
            "w8a8": compare(ref, family.reference_logits(Weights(cfg, names, exported(True)), seqs, compute)),
        }
    finally:
        reader.close()
    return {
        "method": f"{family.name} reference forward in {dtype} on the source and on the export's files read back "
        "and dequantized (compressed-tensors' rule); w8a8 also rounds each quantized linear's input to e4m3fn "
        "per token",
        "dtype": dtype,
        "prompts": {"kind": "random token ids", "sequences": sequences, "tokens": tokens, "seed": seed},
        "kl_mean": variants["w8a8"]["kl_mean"],
        "top1_agreement": variants["w8a8"]["top1_agreement"],
        "variants": variants,
        "seconds": round(time.perf_counter() - start, 3),
    }
