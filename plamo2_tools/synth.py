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
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import FINAL_NORM_OFFSET, NORM_OFFSETS, Plamo2Config
from .errors import OutputExistsError, UserError
from .safetensors_io import PartialFile, plan_file, tensor_bytes

_1B: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=1,
    hidden_size_per_head=128, mamba_d_state=64, mamba_d_conv=4, mamba_num_heads=32, mamba_step=2,
    intermediate_size=8192, vocab_size=100000, attention_window_size=2048, torch_dtype="float32",
)  # fmt: skip
_8B: dict[str, Any] = dict(
    _1B, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
    mamba_num_heads=64, intermediate_size=16384, torch_dtype="bfloat16",
)  # fmt: skip

# The tiny presets together cover: one KV head, 1 < Hkv < Hq, mamba_step 3 with an odd layer
# count, the L <= mamba_step // 2 edge case, an untied head, vocabularies that are not multiples
# of 64 (or 16), full-attention layers, a non-default rope_theta, and a window short enough to
# be crossed in tests.  No two sub-blocks share a shape (hidden != 2F, Hm != Hq, ...).
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
    "tiny-edge": dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        hidden_size_per_head=8, mamba_d_state=4, mamba_d_conv=4, mamba_num_heads=4,
        mamba_step=5, intermediate_size=40, vocab_size=300, attention_window_size=6,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
TINY_PRESETS = ("tiny", "tiny-gqa", "tiny-edge")

SPECIAL_TOKENS = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" else parts[-1]
    if leaf in ("embed_tokens", "lm_head"):
        t = normal(1.0 / math.sqrt(cfg.hidden_size))
        t[cfg.vocab_size :] = 0  # HF's lm_head rows beyond V are never used: keep them zero
        return t
    if leaf in NORM_OFFSETS or leaf == "norm":
        # Stored deltas around the folded offset: forgetting the offset changes the scale ~10x.
        return normal(0.1 * NORM_OFFSETS.get(leaf, FINAL_NORM_OFFSET))
    if leaf in ("dt_norm_weight", "B_norm_weight", "C_norm_weight", "q_weight", "k_weight"):
        return uniform(0.7, 1.5)
    if leaf == "A_log":
        return uniform(1.0, 16.0).log()
    if leaf == "D":
        return uniform(0.5, 1.5)
    if leaf == "dt_bias":
        # Mamba2 init: softplus(dt_bias) log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1.
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "dt_proj":
        return normal(0.5 / math.sqrt(shape[1]))
    if leaf == "conv1d":
        return normal(1.0 / math.sqrt(shape[-1]))
    if len(shape) == 2:  # every other linear weight: keeps activations at unit scale
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
    file_names = (
        ["model.safetensors"] if files == 1 else [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    )
    weight_map = {}
    for fname, group in zip(file_names, groups, strict=True):
        layout = plan_file([(n, dtype, shapes[n]) for n in group], {"format": "pt"})
        part = PartialFile(out / fname, layout)
        try:
            for n in group:
                t = values(n, shapes[n]).to(dtype)
                part.write_at(layout.offsets[n], tensor_bytes(t))
                weight_map[n] = fname
                if progress:
                    progress(layout.nbytes[n])
            part.commit()
        except BaseException:
            part.abort()
            raise
    if files > 1:
        total = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = cfg.to_dict()
    config["torch_dtype"] = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}, indent=2) + "\n"
    )
    if tokenizer:
        write_tokenizer(out, cfg.vocab_size)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level tokenizer that `AutoTokenizer` loads without remote code.

    Ids 0-4 are PLaMo's special tokens, then the 256 byte symbols; the remaining ids up to V are
    filler pieces that decode to visible text, so any sampled id decodes.  BOS is added like the
    real tokenizer with add_bos_token = true.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda c: _byte_of(c))
    if vocab_size < len(SPECIAL_TOKENS) + len(byte_symbols):
        raise UserError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= 261)")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in byte_symbols:
        vocab[sym] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    spec = json.loads(tok.to_str())
    # Written as JSON: TemplateProcessing's string syntax cannot hold the ':' in PLaMo's names.
    bos = {"SpecialToken": {"id": SPECIAL_TOKENS[1], "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {SPECIAL_TOKENS[1]: {"id": SPECIAL_TOKENS[1], "ids": [1], "tokens": [SPECIAL_TOKENS[1]]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "unk_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[3],
        "model_max_length": 10 * 2**20,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: config[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _byte_of(symbol: str) -> int:
    """The byte a ByteLevel alphabet symbol stands for (GPT-2's bytes_to_unicode inverse)."""
    cp = ord(symbol)
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if cp in printable:
        return cp
    others = [b for b in range(256) if b not in printable]
    return others[cp - 256]


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
    if out.exists() and any(out.iterdir()):
        if not force:
            raise OutputExistsError(f"{out}: exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    write_checkpoint(
        out,
        cfg,
        lambda name, shape: random_tensor(cfg, name, shape, seed),
        DTYPES[cfg.torch_dtype],
        files=files,
        progress=progress,
    )
    return cfg


def checkpoint_bytes(cfg: Plamo2Config, dtype: torch.dtype) -> int:
    return cfg.num_parameters() * torch.empty((), dtype=dtype).element_size()
