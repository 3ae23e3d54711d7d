"""The PLaMo 2 configuration (docs/model.md, "Configuration"): every key typed and checked, with the
derived values (Mamba inner width, time-step rank, padded vocab, layer kinds) in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ConfigError
from ...jsonio import CONFIG_BYTES, read_json
from ..limits import int_problem, shown_int, token_ids
from ..plamo import PlamoConfig, model_type_of

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size_per_head",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_num_heads",
    "mamba_step",
    "intermediate_size",
    "vocab_size",
)

# HF's PlamoConfig defaults for the optional keys (docs/model.md §1).
DEFAULTS: dict[str, Any] = {
    "model_type": "plamo2",
    "rms_norm_eps": 1e-6,
    "mamba_chunk_size": 256,
    "mamba_enabled": True,
    "attention_window_size": 2048,
    "full_attention_idx": [],
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
MODEL_TYPES = ("plamo2", "plamo")
# HF's remote code forces at least this context (modeling_plamo.py).
MIN_MAX_POSITIONS = 10 * 2**20


@dataclass(frozen=True)
class Plamo2Config(PlamoConfig):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size_per_head: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_num_heads: int
    mamba_step: int
    intermediate_size: int
    vocab_size: int
    model_type: str = "plamo2"
    rms_norm_eps: float = 1e-6
    mamba_chunk_size: int = 256
    mamba_enabled: bool = True
    attention_window_size: int = 2048
    full_attention_idx: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # PLaMo 2.1: the RoPE base of the sliding-window layers (None: rope_theta everywhere).
    rope_local_theta: float | None = None
    max_position_embeddings: int = MIN_MAX_POSITIONS
    tie_word_embeddings: bool = True
    torch_dtype: str = "float32"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ---- derived values -------------------------------------------------------------------
    @property
    def mamba_inner(self) -> int:
        """I = Hm * d: Mamba heads use the same head size as attention."""
        return self.mamba_num_heads * self.hidden_size_per_head

    @property
    def dt_rank(self) -> int:
        """R = max(64, D // 16): not stored in config.json (confirmed by parameter counts)."""
        return max(64, self.hidden_size // 16)

    @property
    def lm_head_rows(self) -> int:
        """HF rounds an untied lm_head up to a multiple of 16 rows; logits are cut to V."""
        return math.ceil(self.vocab_size / 16) * 16

    @property
    def layer_is_mamba(self) -> tuple[bool, ...]:
        """The is_mamba rule of HF, MLX, vLLM and llama.cpp (docs/model.md §1)."""
        L, step = self.num_hidden_layers, self.mamba_step
        if not self.mamba_enabled:
            return (False,) * L
        if step // 2 >= L:
            # Too few layers for the pattern: all Mamba except the last, which is attention.
            return tuple(i != L - 1 for i in range(L))
        return tuple(i % step != step // 2 for i in range(L))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("mamba" if m else "attention" for m in self.layer_is_mamba)

    def attention_window(self, layer: int) -> int | None:
        """Keys a query sees besides itself in this attention layer (None = full causal)."""
        return None if layer in self.full_attention_idx else self.attention_window_size

    def rope_base(self, layer: int) -> float:
        """PLaMo 2.1 picks the RoPE base per layer: rope_theta on the full-attention layers,
        rope_local_theta on the sliding-window ones (docs/model.md, "PLaMo 2.1")."""
        if self.rope_local_theta is None or layer in self.full_attention_idx:
            return self.rope_theta
        return self.rope_local_theta

    # ---- I/O ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Plamo2Config:
        model_type = model_type_of(raw, MODEL_TYPES, source, "PLaMo 2")
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required key(s): {', '.join(missing)}")
        values: dict[str, Any] = {}
        for key in REQUIRED_KEYS:
            values[key] = _int(raw, key, source)
        for key, default in DEFAULTS.items():
            value = raw.get(key, default)
            # An explicit null means "default", except for token ids where None is meaningful.
            values[key] = default if value is None and not key.endswith("_token_id") else value
        values["model_type"] = model_type
        values["mamba_chunk_size"] = _int({"k": values["mamba_chunk_size"]}, "k", source, "mamba_chunk_size")
        values["attention_window_size"] = _int(
            {"k": values["attention_window_size"]}, "k", source, "attention_window_size"
        )
        values["rms_norm_eps"] = _float(values["rms_norm_eps"], source, "rms_norm_eps")
        values["rope_theta"] = _float(values["rope_theta"], source, "rope_theta")
        if raw.get("rope_local_theta") is not None:
            values["rope_local_theta"] = _float(raw["rope_local_theta"], source, "rope_local_theta")
        if "attention_window_size" not in raw and raw.get("sliding_window") is not None:
            # Some exports carry only the vLLM-style key; the remote code writes both, equal.
            values["attention_window_size"] = _int(raw, "sliding_window", source)
        fai = values["full_attention_idx"]
        if not isinstance(fai, (list, tuple)):
            raise ConfigError(f"{source}: full_attention_idx = {fai!r}: must be a list of layer indices")
        values["full_attention_idx"] = tuple(_int({"k": i}, "k", source, "full_attention_idx entry") for i in fai)
        values["max_position_embeddings"] = max(
            MIN_MAX_POSITIONS,
            _int({"k": values["max_position_embeddings"]}, "k", source, "max_position_embeddings"),
        )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            values[key] = token_ids(values[key], source, key, many=key == "eos_token_id")
        values["mamba_enabled"] = _bool(values["mamba_enabled"], source, "mamba_enabled")
        values["tie_word_embeddings"] = _bool(values["tie_word_embeddings"], source, "tie_word_embeddings")
        known = set(REQUIRED_KEYS) | set(DEFAULTS) | {"rope_local_theta"}
        values["extra"] = {k: v for k, v in raw.items() if k not in known}
        cfg = cls(**values)
        cfg._validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> Plamo2Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists() and not path.is_symlink():
            raise ConfigError(f"{path}: not found (is this a PLaMo 2 checkpoint directory?)")
        try:
            raw = read_json(path, CONFIG_BYTES)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        for key in REQUIRED_KEYS:
            out[key] = getattr(self, key)
        for key in DEFAULTS:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        if self.rope_local_theta is not None:
            out["rope_local_theta"] = self.rope_local_theta
        return out

    def _validate(self, source: str) -> None:
        def fail(key: str, why: str) -> None:
            raise ConfigError(f"{source}: {key} = {shown_int(getattr(self, key))!r:.60}: {why}")

        for key in (*REQUIRED_KEYS, "mamba_chunk_size", "attention_window_size", "max_position_embeddings"):
            problem = int_problem(key, getattr(self, key))
            if problem:
                fail(key, problem)
        if self.mamba_enabled and self.mamba_step <= 1:
            fail("mamba_step", "must be > 1 (the Mamba/attention layer pattern needs it)")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"must divide num_attention_heads = {self.num_attention_heads}")
        if self.hidden_size_per_head % 2:
            fail("hidden_size_per_head", "must be even (rotate-half RoPE)")
        if self.mamba_d_conv < 2:
            fail("mamba_d_conv", "must be >= 2")
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps", "must be > 0")
        if self.rope_theta <= 0:
            fail("rope_theta", "must be > 0")
        if self.rope_local_theta is not None and self.rope_local_theta <= 0:
            fail("rope_local_theta", "must be > 0")
        bad = [i for i in self.full_attention_idx if not 0 <= i < self.num_hidden_layers]
        if bad:
            fail("full_attention_idx", f"layer(s) {bad} out of range 0..{self.num_hidden_layers - 1}")


def _int(raw: dict[str, Any], key: str, source: str, name: str | None = None) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: {name or key} = {value!r:.40}: must be an integer")
    return value


def _float(value: Any, source: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {name} = {value!r:.40}: must be a finite number")
    return float(value)


def _bool(value: Any, source: str, name: str) -> bool:
    # bool("false") is True: a string here would silently flip the meaning, so refuse it.
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {name} = {value!r:.40}: must be true or false")
    return value
