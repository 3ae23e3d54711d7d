"""Synthetic PLaMo 2 checkpoints in the exact HF layout, for tests and benchmarks when no real
weights can be downloaded.

Values are random but keep the model numerically healthy: unit-scale activations, Mamba2's
initialisation ranges for dt and A (so states decay but do not vanish), norm deltas that make a
missing offset obvious, and q/k scales that give non-trivial attention.  Every tensor has its own
generator seeded from (seed, name), so a checkpoint is reproducible bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..dtypes import FLOAT_DTYPES as DTYPES
from ..dtypes import dtype_name, element_size
from ..errors import UserError
from ..outputs import make_output_dir, prepare_output, write_record
from ..tokenizer.synthetic import FIRST_PIECE_ID, write_synthetic_tokenizer
from .checkpoint import INDEX_NAME, hf_file_names, write_hf_weights
from .config import FINAL_NORM_OFFSET, NORM_OFFSETS, Plamo2Config
from .tensors import kind_of, layer_of

_1B: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=1,
    hidden_size_per_head=128, mamba_d_state=64, mamba_d_conv=4, mamba_num_heads=32, mamba_step=2,
    intermediate_size=8192, vocab_size=100000, attention_window_size=2048, torch_dtype="float32",
)  # fmt: skip
_8B: dict[str, Any] = dict(
    _1B, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
    mamba_num_heads=64, intermediate_size=16384, torch_dtype="bfloat16",
)  # fmt: skip

# PLaMo 2.1 (docs/research/plamo2-configs.json): the 2B geometry is mlx-vlm's plamo2vl text-config
# defaults (32 x 2048 confirmed by llama.cpp's size table); the 8B one is plamo-2-8b's plus the
# 2.1 keys.  Neither config.json is public: full_attention_idx and rope_local_theta are the port's
# defaults, which only matter for values, not shapes.
_2_1_2B: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
    hidden_size_per_head=128, mamba_d_state=64, mamba_d_conv=4, mamba_num_heads=64, mamba_step=2,
    intermediate_size=5632, vocab_size=100032, attention_window_size=32768, rope_theta=1e6,
    rope_local_theta=1e6, torch_dtype="bfloat16",
)  # fmt: skip
_2_1_8B: dict[str, Any] = dict(
    _8B, vocab_size=100032, attention_window_size=32768, rope_theta=1e6, rope_local_theta=1e6
)

# The tiny presets together cover: one KV head, 1 < Hkv < Hq, mamba_step 3 with an odd layer
# count, the L <= mamba_step // 2 edge case, an untied head, vocabularies that are not multiples
# of 64 (or 16), full-attention layers, a non-default rope_theta, and a window short enough to
# be crossed in tests; tiny-2.1 adds PLaMo 2.1's per-layer RoPE base.  No two sub-blocks share a
# shape (hidden != 2F, Hm != Hq, ...).
PRESETS: dict[str, dict[str, Any]] = {
    "plamo-2-1b": _1B,
    "plamo-2-8b": _8B,
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        hidden_size_per_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_num_heads=8,
        mamba_step=2, intermediate_size=96, vocab_size=1000, attention_window_size=12,
    ),
    "tiny-gqa": dict(
        hidden_size=96, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2,
        hidden_size_per_head=16, mamba_d_state=8, mamba_d_conv=3, mamba_num_heads=16,
        mamba_step=3, intermediate_size=160, vocab_size=515, attention_window_size=10,
        full_attention_idx=[4], rope_theta=1e6, tie_word_embeddings=False,
    ),
    "plamo-2.1-2b": _2_1_2B,
    "plamo-2.1-8b": _2_1_8B,
    # PLaMo 2.1 in small: attention layers 1, 3, 5; layer 3 full attention with rope_theta, the
    # others windowed with a very different rope_local_theta (the mlx-vlm comparison).
    "tiny-2.1": dict(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        hidden_size_per_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_num_heads=8,
        mamba_step=2, intermediate_size=112, vocab_size=700, attention_window_size=9,
        full_attention_idx=[3], rope_theta=1e6, rope_local_theta=10.0,
    ),
    "tiny-edge": dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        hidden_size_per_head=8, mamba_d_state=4, mamba_d_conv=4, mamba_num_heads=4,
        mamba_step=5, intermediate_size=40, vocab_size=300, attention_window_size=6,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
TINY_PRESETS = ("tiny", "tiny-gqa", "tiny-edge", "tiny-2.1")

SPECIAL_TOKENS = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]


def preset_config(name: str, dtype: str | None = None) -> Plamo2Config:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    if dtype is not None and dtype not in DTYPES:
        # Checked here, not only in synth(): the CLI looks the preset's dtype up before synth() runs.
        raise UserError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    raw = {"model_type": "plamo2", "architectures": ["Plamo2ForCausalLM"], **PRESETS[name]}
    if dtype is not None:
        raw["torch_dtype"] = dtype
    raw.setdefault("torch_dtype", "float32")
    raw["sliding_window"] = raw["attention_window_size"]  # the remote config writes it "for vLLM"
    return Plamo2Config.from_dict(raw, f"preset {name}")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_tensor(cfg: Plamo2Config, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A healthy float32 value for one HF tensor (see the module docstring)."""
    g = _generator(seed, name)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    init = kind_of(name).init  # the table names each tensor's initialiser
    if init == "embedding":
        t = normal(1.0 / math.sqrt(cfg.hidden_size))
        t[cfg.vocab_size :] = 0  # HF's lm_head rows beyond V are never used: keep them zero
        return t
    if init == "norm_delta":
        # Stored deltas around the folded offset: forgetting the offset changes the scale ~10x.
        norm = layer_of(name)[1].removesuffix(".weight")
        return normal(0.1 * NORM_OFFSETS.get(norm, FINAL_NORM_OFFSET))
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


ValueFn = Callable[[str, tuple[int, ...]], torch.Tensor]


def write_checkpoint(
    out: Path,
    cfg: Plamo2Config,
    values: ValueFn,
    dtype: torch.dtype,
    files: int = 1,
    tokenizer: bool = True,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write config.json, safetensors file(s) (+ index when files > 1) and a tokenizer.

    Tensors are generated and written one at a time, so memory stays at one tensor.
    """
    out.mkdir(parents=True, exist_ok=True)
    shapes = cfg.hf_tensor_shapes()
    names = list(shapes)
    files = max(1, min(files, len(names)))
    groups = [names[i * len(names) // files : (i + 1) * len(names) // files] for i in range(files)]
    specs = {n: (dtype, shapes[n]) for n in names}
    write_hf_weights(out, groups, specs, lambda n: [(0, values(n, shapes[n]))], progress)
    config = cfg.to_dict()
    config["torch_dtype"] = dtype_name(dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}, indent=2) + "\n"
    )
    if tokenizer:
        write_tokenizer(out, cfg.vocab_size)


TOKENIZER_FILES = ("tokenizer.jsonl", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer(out: Path, vocab_size: int, seed: int = 0) -> None:
    """A tokenizer in PLaMo's own format (tokenizer.jsonl: control tokens 0-6, the 256 byte
    tokens, pieces with scores learned from text), run natively by plamo2_tools.tokenizer, so the
    whole pipeline exercises the format real checkpoints ship (docs/tokenizer.md)."""
    if vocab_size < FIRST_PIECE_ID:
        raise UserError(f"vocab_size {vocab_size} is too small for a PLaMo tokenizer (needs >= {FIRST_PIECE_ID})")
    write_synthetic_tokenizer(out, vocab_size, seed=seed)


def synth(
    out: str | Path,
    preset: str,
    seed: int = 0,
    dtype: str | None = None,
    files: int = 1,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Plamo2Config:
    """Create a random checkpoint of a preset's shapes in `out`."""
    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    cfg = preset_config(preset, dtype)
    tensors = len(cfg.hf_tensor_shapes())
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


def checkpoint_bytes(cfg: Plamo2Config, dtype: torch.dtype) -> int:
    return cfg.num_parameters() * element_size(dtype)
