"""The PLaMo 3 configuration (docs/plamo3.md, "Configuration"): every key typed and checked, both
forms real checkpoints carry (transformers v4: `rope_theta`, `rope_local_theta`,
`rope_scaling_factor`, `window_size`, `sliding_window_pattern`; v5: `rope_parameters` per layer
type and `layer_types`), the legacy names PFN's config class still accepts, and the derived
values (layer types, RoPE per layer, YaRN, padded vocabularies) in one place.

Defaults are those of PFN's newest `Plamo3Config` (the remote code shipped with the checkpoints).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ..layout import padded_vocab
from ..limits import int_problem, shown_int, token_ids
from ..plamo import PlamoConfig, model_type_of

MODEL_TYPES = ("plamo3",)
FULL, SLIDING = "full_attention", "sliding_attention"  # the layer kinds (transformers v5's names)

DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 13312,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "window_size": 128,
    "sliding_window_pattern": 8,
    "rope_theta": 150000.0,
    "rope_local_theta": 10000.0,
    "rope_scaling_factor": 1.0,
    "initial_context_length": None,
    "scale_embedding": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "window_size",
    "sliding_window_pattern",
)
# PFN's config class maps these older names to the current ones (when the current one is absent).
LEGACY = {"rope_global_theta": "rope_theta", "rope_local_base_freq": "rope_local_theta"}
# YaRN's constants as PFN's config writes them (beta_fast 32, beta_slow 1, truncate false).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0

# Norm offsets folded into the stored deltas (docs/plamo3.md, "Tensors"): PLaMo's four norms and
# the final one as PLaMo 2 (model/plamo.py), and the q/k norms.
QK_NORM_OFFSET = 1.0


@dataclass(frozen=True)
class Rope:
    """The RoPE of one layer type: its base and, for YaRN, the scaling."""

    theta: float
    yarn_factor: float = 1.0  # != 1: YaRN with the three values below
    original_max_positions: int | None = None
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    truncate: bool = False

    @property
    def is_yarn(self) -> bool:
        return self.yarn_factor != 1.0

    def describe(self) -> str:
        if not self.is_yarn:
            return "plain"
        return f"YaRN x{self.yarn_factor:g} from {self.original_max_positions} positions"


@dataclass(frozen=True)
class Plamo3Config(PlamoConfig):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    window_size: int  # W of the sliding layers
    rope_full: Rope
    rope_sliding: Rope
    model_type: str = "plamo3"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    sliding_window_pattern: int = 8
    scale_embedding: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    v5: bool = False  # the config came in transformers-v5 form (rope_parameters / layer_types)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def lm_head_rows(self) -> int:
        """vLLM's ParallelLMHead(round16(V), org_num_embeddings=V): its padded rows, over all ranks
        (the original rows padded to 64, plus the round-up-to-16 rows, padded to 64 again)."""
        return padded_vocab(self.padded_vocab + math.ceil(self.vocab_size / 16) * 16 - self.vocab_size)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.layer_types

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def window_keys(self, layer: int, convention: str) -> int | None:
        """Keys a query of this layer sees besides itself (None = full causal): HF's convention
        sees the query and W keys before it, vLLM's W keys in all (docs/plamo3.md §4.3)."""
        if self.is_full(layer):
            return None
        return self.window_size if convention == "hf" else self.window_size - 1

    def rope(self, layer: int) -> Rope:
        return self.rope_full if self.is_full(layer) else self.rope_sliding

    # ---- I/O ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Plamo3Config:
        model_type = model_type_of(raw, MODEL_TYPES, source, "PLaMo 3")
        raw = dict(raw)
        for old, new in LEGACY.items():
            if old in raw and raw.get(new) is None:
                raw[new] = raw[old]
        values: dict[str, Any] = {}
        for key, default in DEFAULTS.items():
            value = raw.get(key, default)
            values[key] = default if value is None and not key.endswith("_token_id") else value
        values["window_size"] = _window(raw, values["window_size"], source)
        for key in INT_KEYS:  # bounded before anything is built per layer (_layer_types)
            values[key] = _int(values[key], source, key)
            problem = int_problem(key, values[key])
            if problem:
                raise ConfigError(f"{source}: {key} = {shown_int(values[key])}: {problem}")
        for key in ("rms_norm_eps", "rope_theta", "rope_local_theta", "rope_scaling_factor"):
            values[key] = _float(values[key], source, key)
        for key in ("tie_word_embeddings", "scale_embedding"):
            values[key] = _bool(values[key], source, key)
        if values["initial_context_length"] is not None:
            values["initial_context_length"] = _int(values["initial_context_length"], source, "initial_context_length")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            values[key] = token_ids(values[key], source, key, many=key == "eos_token_id")
        layer_types = _layer_types(raw, values["num_hidden_layers"], values["sliding_window_pattern"], source)
        full, sliding, v5 = _ropes(raw, values, source)
        known = (
            set(DEFAULTS)
            | set(LEGACY)
            | {
                "model_type",
                "layer_types",
                "rope_parameters",
                "rope_scaling",
                "sliding_window",
                "interleaved_sliding_window",
            }
        )
        cfg = cls(
            hidden_size=values["hidden_size"],
            num_hidden_layers=values["num_hidden_layers"],
            num_attention_heads=values["num_attention_heads"],
            num_key_value_heads=values["num_key_value_heads"],
            head_dim=values["head_dim"],
            intermediate_size=values["intermediate_size"],
            vocab_size=values["vocab_size"],
            layer_types=layer_types,
            window_size=values["window_size"],
            rope_full=full,
            rope_sliding=sliding,
            model_type=model_type,
            rms_norm_eps=values["rms_norm_eps"],
            tie_word_embeddings=values["tie_word_embeddings"],
            max_position_embeddings=values["max_position_embeddings"],
            sliding_window_pattern=values["sliding_window_pattern"],
            scale_embedding=values["scale_embedding"],
            torch_dtype=str(values["torch_dtype"]),
            bos_token_id=values["bos_token_id"],
            eos_token_id=values["eos_token_id"],
            pad_token_id=values["pad_token_id"],
            v5=v5,
            extra={k: v for k, v in raw.items() if k not in known},
        )
        cfg._validate(source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The config in the form it came in (v4 keys, or v5 with rope_parameters/layer_types);
        both forms describe the same model."""
        out: dict[str, Any] = dict(self.extra)
        for key in INT_KEYS + (
            "rms_norm_eps",
            "tie_word_embeddings",
            "scale_embedding",
            "torch_dtype",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            out[key] = getattr(self, key)
        out["model_type"] = self.model_type
        if self.v5:
            out["layer_types"] = list(self.layer_types)
            ropes = ((FULL, self.rope_full), (SLIDING, self.rope_sliding))
            out["rope_parameters"] = {t: _rope_dict(r) for t, r in ropes if t in self.layer_types}
        else:
            out["rope_theta"] = self.rope_full.theta
            out["rope_local_theta"] = self.rope_sliding.theta
            out["rope_scaling_factor"] = self.rope_full.yarn_factor
            out["initial_context_length"] = self.rope_full.original_max_positions
        return out

    def _validate(self, source: str) -> None:
        def fail(key: str, value: Any, why: str) -> None:
            raise ConfigError(f"{source}: {key} = {shown_int(value)!r}: {why}")

        for key in INT_KEYS:
            problem = int_problem(key, getattr(self, key))
            if problem:
                fail(key, getattr(self, key), problem)
        H, K = self.num_attention_heads, self.num_key_value_heads
        if H % K:
            fail("num_key_value_heads", K, f"must divide num_attention_heads = {H}")
        if self.head_dim % 2:
            fail("head_dim", self.head_dim, "must be even (rotate-half RoPE)")
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps", self.rms_norm_eps, "must be > 0")
        for name, rope in (("full-attention", self.rope_full), ("sliding", self.rope_sliding)):
            if rope.theta <= 0:
                fail(f"RoPE theta of the {name} layers", rope.theta, "must be > 0")
            if rope.yarn_factor <= 0:
                fail(f"rope scaling factor of the {name} layers", rope.yarn_factor, "must be > 0")
            if rope.is_yarn:
                _check_yarn(rope, name, fail)


def _check_yarn(rope: Rope, name: str, fail: Any) -> None:
    """YaRN's values as every run computes with them (rope.py, vLLM's YaRNScalingRotaryEmbedding):
    refused here, by convert and check, instead of crashing every run (issue 28)."""
    orig = rope.original_max_positions
    if orig is None:
        fail(
            "initial_context_length",
            None,
            "must be set when rope_scaling_factor != 1 (YaRN needs the original context)",
        )
    elif int_problem("original_max_position_embeddings", orig):
        fail(
            f"YaRN's original_max_position_embeddings of the {name} layers",
            orig,
            int_problem("original_max_position_embeddings", orig),
        )
    if not rope.beta_slow > 0:
        fail(f"beta_slow of the {name} layers", rope.beta_slow, "must be > 0")
    if not rope.beta_fast > rope.beta_slow:
        why = f"must be > beta_slow = {rope.beta_slow} (YaRN ramps from the fast rotation count to the slow one)"
        fail(f"beta_fast of the {name} layers", rope.beta_fast, why)
    if not rope.theta > 1:
        fail(
            f"RoPE theta of the {name} layers",
            rope.theta,
            "must be > 1 with YaRN (its correction divides by log theta)",
        )


# ---- reading the two forms ------------------------------------------------------------------------
def _window(raw: dict[str, Any], window: Any, source: str) -> Any:
    """`window_size`, else the legacy `sliding_window` (an int, or a list with one value for every
    sliding layer) as PFN's config class maps it."""
    if "window_size" in raw and raw["window_size"] is not None:
        return window
    legacy = raw.get("sliding_window")
    if legacy is None:
        legacy = raw.get("interleaved_sliding_window")
    if isinstance(legacy, list):
        values = {v for v in legacy if v is not None}
        if len(values) != 1:
            raise ConfigError(f"{source}: sliding_window = {legacy!r}: expected one window for every sliding layer")
        return values.pop()
    return window if legacy is None else legacy


def _layer_types(raw: dict[str, Any], layers: int, pattern: int, source: str) -> tuple[str, ...]:
    """v5's `layer_types` when present, else PFN's rule: layer i is full iff (i+1) % pattern == 0."""
    given = raw.get("layer_types")
    if given is None:
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(t not in (FULL, SLIDING) for t in given):
        raise ConfigError(
            f"{source}: layer_types must list {layers} entries, each {FULL!r} or {SLIDING!r} (got {given!r:.80})"
        )
    return tuple(given)


def _ropes(raw: dict[str, Any], values: dict[str, Any], source: str) -> tuple[Rope, Rope, bool]:
    """(full-attention RoPE, sliding RoPE, came in v5 form).  v5: `rope_parameters` keyed by layer
    type; v4: `rope_theta` (+ YaRN from `rope_scaling_factor`) on the full layers and
    `rope_local_theta` on the sliding ones (vLLM's two branches give the same model)."""
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):  # was silently ignored: a run without YaRN
            raise ConfigError(f"{source}: {key} = {json.dumps(value)[:60]}: must be an object (or null)")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        odd = sorted(set(params) - {FULL, SLIDING})
        if odd:
            raise ConfigError(
                f"{source}: rope_parameters has {odd[0]!r} beside the layer types {FULL!r} and "
                f"{SLIDING!r}: one form or the other"
            )
        full = _rope_of(params.get(FULL), values["rope_theta"], source, FULL)
        sliding = _rope_of(params.get(SLIDING), values["rope_local_theta"], source, SLIDING)
        return full, sliding, True
    flat = params if isinstance(params, dict) else scaling
    if isinstance(flat, dict) and flat:  # one RoPE dict (transformers' standardised form): the full layers'
        return _rope_of(flat, values["rope_theta"], source, FULL), Rope(values["rope_local_theta"]), False
    factor = values["rope_scaling_factor"]
    full = Rope(values["rope_theta"], factor, values["initial_context_length"] if factor != 1.0 else None)
    return full, Rope(values["rope_local_theta"]), False


def _rope_of(entry: Any, default_theta: float, source: str, what: str) -> Rope:
    if entry is None:
        return Rope(default_theta)
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: rope_parameters[{what!r}] must be an object")
    kind = entry.get("rope_type", "default")
    if not isinstance(kind, str):
        raise ConfigError(f"{source}: rope_parameters[{what!r}].rope_type = {json.dumps(kind)[:40]}: must be a string")
    theta = _float(entry.get("rope_theta", default_theta), source, f"rope_parameters[{what!r}].rope_theta")
    if kind == "default":
        return Rope(theta)
    if kind != "yarn":
        raise ConfigError(f"{source}: rope_parameters[{what!r}].rope_type {kind!r}: only 'default' and 'yarn' are read")
    orig = entry.get("original_max_position_embeddings")
    return Rope(
        theta,
        _float(entry.get("factor", 1.0), source, f"rope_parameters[{what!r}].factor"),
        None if orig is None else _int(orig, source, "original_max_position_embeddings"),
        _float(entry.get("beta_fast", YARN_BETA_FAST), source, "beta_fast"),
        _float(entry.get("beta_slow", YARN_BETA_SLOW), source, "beta_slow"),
        _bool(entry.get("truncate", False), source, "truncate"),
    )


def _rope_dict(r: Rope) -> dict[str, Any]:
    if not r.is_yarn:
        return {"rope_type": "default", "rope_theta": r.theta}
    return {
        "rope_type": "yarn",
        "rope_theta": r.theta,
        "factor": r.yarn_factor,
        "original_max_position_embeddings": r.original_max_positions,
        "beta_fast": r.beta_fast,
        "beta_slow": r.beta_slow,
        "truncate": r.truncate,
    }


def _int(value: Any, source: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: {name} = {json.dumps(value)[:40]}: must be an integer")
    return value


def _float(value: Any, source: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {name} = {json.dumps(value)[:40]}: must be a finite number")
    return float(value)


def _bool(value: Any, source: str, name: str) -> bool:
    if not isinstance(value, bool):  # bool("false") is True: a string here would silently flip it
        raise ConfigError(f"{source}: {name} = {json.dumps(value)[:40]}: must be true or false")
    return value
