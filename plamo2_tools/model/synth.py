"""Synthetic checkpoints of any registered family in the exact HF layout, for tests and benchmarks
when no real weights can be downloaded.  Presets are the families' (`Family.presets`).

Values are random but keep the model numerically healthy: unit-scale activations, Mamba2's
initialisation ranges for dt and A (so states decay but do not vanish), norm deltas that make a
missing offset obvious, and q/k scales that give non-trivial attention.  Every tensor has its own
generator seeded from (seed, name), so a checkpoint is reproducible bit for bit.  The table names
each tensor's initialiser (`TensorKind.init`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtypes import FLOAT_DTYPES as DTYPES
from ..dtypes import DType, as_dtype, dtype_name, element_size
from ..errors import UserError
from ..outputs import make_output_dir, prepare_output, write_record
from ..tokenizer.synthetic import FIRST_PIECE_ID, write_synthetic_tokenizer
from .checkpoint import INDEX_NAME, hf_file_names, write_hf_weights
from .layout import kind_of
from .registry import all_presets, family_of, family_of_preset, hf_tensor_shapes, num_parameters

if TYPE_CHECKING:  # the values come from torch's generators (reproducible bit for bit): imported when made
    import torch


def preset_config(name: str, dtype: str | None = None) -> Any:
    """The typed config of a preset of any family (optionally with another torch_dtype)."""
    if name not in all_presets():
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(all_presets())}")
    if dtype is not None and dtype not in DTYPES:
        # Checked here, not only in synth(): the CLI looks the preset's dtype up before synth() runs.
        raise UserError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    family = family_of_preset(name)
    raw = family.preset_raw(name)
    if dtype is not None:
        raw["torch_dtype"] = dtype
    raw.setdefault("torch_dtype", "float32")
    return family.config(raw, f"preset {name}")


def _generator(seed: int, name: str) -> torch.Generator:
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_tensor(cfg: Any, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A healthy float32 value for one HF tensor of any family (see the module docstring)."""
    import torch

    family = family_of(cfg)
    g = _generator(seed, name)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    init = kind_of(family, name).init  # the table names each tensor's initialiser
    if init == "embedding":
        t = normal(1.0 / math.sqrt(cfg.hidden_size))
        t[cfg.vocab_size :] = 0  # HF's lm_head rows beyond V are never used: keep them zero
        return t
    if init == "norm_delta":
        # Stored deltas around the folded offset: forgetting the offset changes the scale ~10x.
        return normal(0.1 * family.norm_offset(cfg, name))
    if init == "norm_scale":
        return uniform(0.7, 1.5)
    if init == "A_log":
        return uniform(1.0, 16.0).log()
    if init == "D":
        return uniform(0.5, 1.5)
    if init == "dt_bias":
        # Mamba2 init: softplus(dt_bias) log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1.
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
        return dt + torch.log(-torch.expm1(-dt))
    if init == "dt_proj":
        return normal(0.5 / math.sqrt(shape[1]))
    if init == "conv":
        return normal(1.0 / math.sqrt(shape[-1]))
    if init == "linear":  # keeps activations at unit scale
        return normal(1.0 / math.sqrt(shape[1]))
    raise AssertionError(f"no initialiser for {name}")


ValueFn = Callable[[str, tuple[int, ...]], "torch.Tensor"]


def write_checkpoint(
    out: Path,
    cfg: Any,
    values: ValueFn,
    dtype: DType,
    files: int = 1,
    tokenizer: bool = True,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write config.json, safetensors file(s) (+ index when files > 1) and a tokenizer.

    Tensors are generated a few at a time on a thread pool, ahead of the writer, in file order
    (each has its own seeded generator, so the bytes do not depend on the threads), and written
    one at a time: memory stays at the tensors in flight (one per worker plus one, each cast to `dtype`).
    """
    out.mkdir(parents=True, exist_ok=True)
    dtype = as_dtype(dtype)
    shapes = hf_tensor_shapes(cfg)
    names = list(shapes)
    files = max(1, min(files, len(names)))
    groups = [names[i * len(names) // files : (i + 1) * len(names) // files] for i in range(files)]
    specs = {n: (dtype, shapes[n]) for n in names}
    ahead = _Ahead(names, lambda n: values(n, shapes[n]).to(dtype.torch))
    try:
        write_hf_weights(out, groups, specs, lambda n: [(0, ahead.take(n))], progress)
    finally:
        ahead.close()
    config = cfg.to_dict()
    config["torch_dtype"] = dtype_name(dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}, indent=2) + "\n"
    )
    if tokenizer:
        write_tokenizer(out, cfg.vocab_size, flavour=family_of(cfg).tokenizer_flavour)


class _Ahead:
    """Values of `names` made on a thread pool, at most one per worker plus one ahead of the one taken (torch's
    kernels release the GIL, so the cores fill the tensors in parallel)."""

    def __init__(self, names: list[str], make: Callable[[str], torch.Tensor]) -> None:
        workers = max(1, min(8, (os.cpu_count() or 1)))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="plamo2-synth")
        self.names, self.make, self.next = names, make, 0
        self.futures: dict[str, Future] = {}
        self.depth = workers + 1
        self._refill()

    def _refill(self) -> None:
        while self.next < len(self.names) and len(self.futures) < self.depth:
            name = self.names[self.next]
            self.futures[name] = self.pool.submit(self.make, name)
            self.next += 1

    def take(self, name: str) -> torch.Tensor:
        value = self.futures.pop(name).result()
        self._refill()
        return value

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)


TOKENIZER_FILES = ("tokenizer.jsonl", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer(out: Path, vocab_size: int, seed: int = 0, flavour: str = "plamo2") -> None:
    """A tokenizer in PLaMo's own format (tokenizer.jsonl: control tokens 0-6, the 256 byte
    tokens, pieces with scores learned from text), run natively by plamo2_tools.tokenizer, so the
    whole pipeline exercises the format real checkpoints ship (docs/tokenizer.md), in the flavour
    the model family declares (`Family.tokenizer_flavour`: "plamo3" makes it a Plamo3Tokenizer's)."""
    if vocab_size < FIRST_PIECE_ID:
        raise UserError(f"vocab_size {vocab_size} is too small for a PLaMo tokenizer (needs >= {FIRST_PIECE_ID})")
    write_synthetic_tokenizer(out, vocab_size, seed=seed, flavour=flavour)


def synth(
    out: str | Path,
    preset: str,
    seed: int = 0,
    dtype: str | None = None,
    files: int = 1,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """Create a random checkpoint of a preset's shapes in `out`."""
    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    cfg = preset_config(preset, dtype)
    tensors = len(hf_tensor_shapes(cfg))
    if not 1 <= files <= tensors:
        # write_checkpoint would clamp silently, and the CLI would then report the wrong count.
        raise UserError(f"files = {files}: must be between 1 and the {tensors} tensors of {preset}")
    make_output_dir(out)
    # --force replaces an earlier synth's files (as its record lists them), never anything else.
    writes = synth_files(files)
    prepare_output(out, writes, force)
    write_record(out, "synth", f"preset {preset}, seed {seed}", writes, "writing")
    write_checkpoint(
        out,
        cfg,
        lambda name, shape: random_tensor(cfg, name, shape, seed),
        DTYPES[cfg.torch_dtype],
        files=files,
        progress=progress,
    )
    write_record(out, "synth", f"preset {preset}, seed {seed}", writes, "complete")
    return cfg


def synth_files(files: int) -> list[str]:
    """Every file `synth` writes: the weights (+ index), config, generation config, tokenizer."""
    weights = hf_file_names(files) + ([INDEX_NAME] if files > 1 else [])
    return weights + ["config.json", "generation_config.json", *TOKENIZER_FILES]


def checkpoint_bytes(cfg: Any, dtype: DType) -> int:
    return num_parameters(cfg) * element_size(dtype)
