"""An independent float64 forward of PLaMo 3 (`Plamo3ForCausalLM`), written from docs/plamo3.md.

This file is a test oracle. It imports nothing from `plamo2_tools` (only torch and the standard library) so
that a bug in the project's converter or runtime cannot leak into the reference it is checked against. It
favours being obviously right over being fast: attention is an explicit loop over query positions and heads,
RoPE and YaRN are computed frequency by frequency with Python floats, and every tensor is float64.

    independent_logits(config, weights, ids, window_convention) -> (T, V) float64 logits

`config` is a raw `config.json` dict, in either form:

* transformers-v4 keys, as PFN's remote `Plamo3Config` stores them: `window_size`, `sliding_window_pattern`,
  `rope_theta`, `rope_local_theta`, `rope_scaling_factor`, `initial_context_length` (legacy spellings
  `rope_global_theta`, `sliding_window` as an int or a per-layer list, `rope_local_base_freq` accepted);
* transformers-v5 keys: `layer_types` and `rope_parameters` keyed by layer type (`sliding_window` the window).

`weights` are the HF checkpoint's tensors by HF name (`model.layers.layers.{i}.mixer.qkv_proj.weight`, ...).
`window_convention` says how many keys a sliding layer's query sees: "vllm" = W (itself and W - 1 earlier
tokens: vLLM, llama.cpp, PFN's SGLang port), "hf" = W + 1 (itself and W earlier: PFN's HF code, mlx-lm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"
WINDOW_CONVENTIONS = ("hf", "vllm")

# RMSNorm weight offsets: the checkpoint stores w, the layer multiplies by (w + offset).
OFFSET_PRE_MIXER = 1.0
OFFSET_POST_MIXER = 1.0 / 5
OFFSET_PRE_MLP = 1.0
OFFSET_POST_MLP = 1.0 / 5**1.5
OFFSET_FINAL = 1.0
OFFSET_QK = 1.0

# Defaults of PFN's newest remote Plamo3Config (configuration_plamo.py); docs/plamo3.md section 1.
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
    "window_size": 128,
    "sliding_window_pattern": 8,
    "rope_theta": 150_000,
    "rope_local_theta": 10_000,
    "rope_scaling_factor": 1,
    "initial_context_length": None,
    "scale_embedding": False,
}

# Keys of one layer type's RoPE entry this oracle understands (vLLM's names for YaRN's options).
_ROPE_KEYS = {
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "extrapolation_factor",
    "attn_factor",
    "apply_yarn_scaling",
    "partial_rotary_factor",
}


@dataclass(frozen=True)
class Rope:
    """One layer type's rotary embedding: plain RoPE of base `theta`, or YaRN when `yarn` is set."""

    theta: float
    yarn: bool = False
    factor: float = 1.0
    original_max: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    extrapolation_factor: float = 1.0
    attn_factor: float = 1.0
    apply_yarn_scaling: bool = True


@dataclass(frozen=True)
class Spec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    tied: bool
    window: int
    layer_types: tuple[str, ...]
    rope: dict[str, Rope] = field(default_factory=dict)
    scale_embedding: bool = False


# ----------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------


def _get(cfg: dict, key: str) -> Any:
    return cfg[key] if cfg.get(key) is not None else DEFAULTS[key]


def _window(cfg: dict) -> int:
    """`window_size`, overridden by a legacy `sliding_window` (an int, or a list whose non-null entries agree),
    as PFN's newest Plamo3Config does; a v5 config carries only `sliding_window`."""
    legacy = cfg.get("sliding_window")
    if isinstance(legacy, bool):
        raise ValueError(f"sliding_window must be an int or a list, got {legacy!r}")
    if isinstance(legacy, int):
        return legacy
    if isinstance(legacy, list):
        sizes = {w for w in legacy if w is not None}
        if len(sizes) == 1:
            return sizes.pop()
        if len(sizes) > 1:
            raise ValueError(f"sliding_window lists more than one window size: {sorted(sizes)}")
    return int(_get(cfg, "window_size"))


def _layer_types(cfg: dict, layers: int) -> tuple[str, ...]:
    """Layer i is full attention iff (i + 1) % sliding_window_pattern == 0; an explicit `layer_types` is used
    as given, and must agree with an explicit `sliding_window_pattern`."""
    pattern = int(_get(cfg, "sliding_window_pattern"))
    if pattern < 1:
        raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
    by_rule = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    given = cfg.get("layer_types")
    if given is None:
        return by_rule
    given = tuple(given)
    if len(given) != layers or not set(given) <= {FULL, SLIDING}:
        raise ValueError(f"layer_types must list {layers} of {FULL!r}/{SLIDING!r}, got {list(given)}")
    if cfg.get("sliding_window_pattern") is not None and given != by_rule:
        raise ValueError("layer_types disagrees with sliding_window_pattern")
    return given


def _rope_entry(entry: dict, where: str) -> Rope:
    unknown = set(entry) - _ROPE_KEYS
    if unknown:
        raise ValueError(f"{where}: RoPE keys this oracle does not implement: {sorted(unknown)}")
    if float(entry.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial rotary embeddings are not PLaMo 3")
    kind = entry.get("rope_type", entry.get("type", "default"))
    if entry.get("rope_theta") is None:
        # vLLM's get_rope would take 10000, transformers' standardisation the config's top-level rope_theta
        raise ValueError(f"{where}: no rope_theta")
    theta = float(entry["rope_theta"])
    if kind == "default":
        return Rope(theta=theta)
    if kind != "yarn":
        raise ValueError(f"{where}: rope_type {kind!r} is not implemented")
    return Rope(
        theta=theta,
        yarn=True,
        factor=float(entry["factor"]),
        original_max=int(entry["original_max_position_embeddings"]),
        beta_fast=float(entry.get("beta_fast", 32)),
        beta_slow=float(entry.get("beta_slow", 1)),
        # vLLM's YaRNScalingRotaryEmbedding defaults truncate to True; PFN's config always writes False.
        truncate=bool(entry.get("truncate", True)),
        extrapolation_factor=float(entry.get("extrapolation_factor", 1)),
        attn_factor=float(entry.get("attn_factor", 1)),
        apply_yarn_scaling=bool(entry.get("apply_yarn_scaling", True)),
    )


def _v4_rope(cfg: dict) -> dict[str, Rope]:
    """What PFN's newest Plamo3Config derives from its own keys (its `rope_parameters` property)."""
    theta = cfg.get("rope_theta")
    legacy = cfg.get("rope_global_theta")
    if legacy is not None and (theta is None or theta == DEFAULTS["rope_theta"]):
        theta = legacy  # PFN's rule: the legacy key wins over rope_theta's default value
    theta = DEFAULTS["rope_theta"] if theta is None else theta
    local = cfg.get("rope_local_theta", cfg.get("rope_local_base_freq"))
    local = DEFAULTS["rope_local_theta"] if local is None else local
    factor = float(_get(cfg, "rope_scaling_factor"))
    initial = cfg.get("initial_context_length")
    if factor == 1:
        if initial is not None:
            raise ValueError("initial_context_length is set but rope_scaling_factor is 1")
        full = Rope(theta=float(theta))
    else:
        if initial is None:
            raise ValueError("rope_scaling_factor != 1 needs initial_context_length")
        full = Rope(
            theta=float(theta),
            yarn=True,
            factor=factor,
            original_max=int(initial),
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        )
    return {FULL: full, SLIDING: Rope(theta=float(local))}


def _rope(cfg: dict, layer_types: tuple[str, ...]) -> dict[str, Rope]:
    nested = None
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict) and value and set(value) <= {FULL, SLIDING}:
            nested = value
            break
    if nested is not None:  # v5: one entry per layer type
        missing = set(layer_types) - set(nested)
        if missing:
            raise ValueError(f"rope_parameters has no entry for {sorted(missing)}")
        return {t: _rope_entry(nested[t], f"rope_parameters[{t!r}]") for t in set(layer_types)}
    flat = cfg.get("rope_parameters")
    if isinstance(flat, dict) and flat:  # v4 standardised by transformers: full layers only
        derived = _v4_rope(cfg)
        return {FULL: _rope_entry(flat, "rope_parameters"), SLIDING: derived[SLIDING]}
    return _v4_rope(cfg)


def read_config(cfg: dict) -> Spec:
    """The model a raw config.json describes (docs/plamo3.md section 1)."""
    layers = int(_get(cfg, "num_hidden_layers"))
    layer_types = _layer_types(cfg, layers)
    spec = Spec(
        hidden=int(_get(cfg, "hidden_size")),
        layers=layers,
        heads=int(_get(cfg, "num_attention_heads")),
        kv_heads=int(_get(cfg, "num_key_value_heads")),
        head_dim=int(_get(cfg, "head_dim")),
        intermediate=int(_get(cfg, "intermediate_size")),
        vocab=int(_get(cfg, "vocab_size")),
        eps=float(_get(cfg, "rms_norm_eps")),
        tied=bool(_get(cfg, "tie_word_embeddings")),
        window=_window(cfg),
        layer_types=layer_types,
        rope=_rope(cfg, layer_types),
        scale_embedding=bool(_get(cfg, "scale_embedding")),
    )
    saved = cfg.get("interleaved_sliding_window")  # the older remote config saves its derived list too
    if saved is not None and list(saved) != [None if t == FULL else spec.window for t in layer_types]:
        raise ValueError("interleaved_sliding_window disagrees with the window and layer types")
    if spec.heads % spec.kv_heads:
        raise ValueError(f"num_attention_heads {spec.heads} is not a multiple of num_key_value_heads")
    if spec.head_dim % 2:
        raise ValueError(f"head_dim {spec.head_dim} must be even for RoPE")
    if spec.window < 1:
        raise ValueError(f"window {spec.window} must be >= 1")
    return spec


# ----------------------------------------------------------------------------------------------------------
# RoPE and YaRN
# ----------------------------------------------------------------------------------------------------------


def _correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    """The (fractional) dimension index whose wavelength fits `rotations` turns into `original_max` positions:
    frequency i has wavelength 2*pi*base**(2i/dim), so i = dim*ln(original_max / (2*pi*rotations)) / (2 ln base)."""
    return dim * math.log(original_max / (2 * math.pi * rotations)) / (2 * math.log(base))


def inverse_frequencies(rope: Rope, dim: int) -> list[float]:
    """theta_i for i in [0, dim/2): base**(-2i/dim), or YaRN's blend of it with base**(-2i/dim)/factor."""
    half = dim // 2
    plain = [rope.theta ** (-(2 * i) / dim) for i in range(half)]
    if not rope.yarn:
        return plain
    assert rope.original_max is not None
    low = _correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max)
    high = _correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(half):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0 below `low` (fast dims), 1 above `high`
        keep = (1.0 - ramp) * rope.extrapolation_factor  # weight of the unscaled frequency
        out.append(plain[i] / rope.factor * (1.0 - keep) + plain[i] * keep)
    return out


def magnitude(rope: Rope) -> float:
    """YaRN's factor on cos and sin (so on q.k twice): (0.1 ln f + 1) * attn_factor for f > 1."""
    if not rope.yarn:
        return 1.0
    if not rope.apply_yarn_scaling:
        return rope.attn_factor
    scale = 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0
    return scale * rope.attn_factor


def cos_sin(rope: Rope, dim: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(len(positions), dim/2) float64 tables, magnitude included, one angle at a time."""
    inv = inverse_frequencies(rope, dim)
    m = magnitude(rope)
    cos = torch.empty(len(positions), len(inv), dtype=torch.float64)
    sin = torch.empty_like(cos)
    for r, p in enumerate(positions):
        for i, f in enumerate(inv):
            cos[r, i] = math.cos(p * f) * m
            sin[r, i] = math.sin(p * f) * m
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE over the whole head: dimension i pairs with i + d/2. x (..., d), cos/sin (d/2,)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, offset: float, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (weight + offset) over the last dimension."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.to(torch.float64) + offset)


def sees(query: int, key: int, sliding: bool, window: int, convention: str) -> bool:
    """Whether the query at position `query` attends to the key at position `key`."""
    if key > query:
        return False
    if not sliding:
        return True
    reach = window if convention == "hf" else window - 1  # how many earlier tokens it sees
    return query - key <= reach


def _w(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in weights:
        raise KeyError(f"checkpoint has no {name}")
    t = weights[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    return t.to(torch.float64)


def _attention(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool, conv: str):
    """q (T, H, d), k/v (T, K, d) -> (T, H*d): one softmax per query position and head."""
    steps, group = q.shape[0], spec.heads // spec.kv_heads
    scale = spec.head_dim**-0.5
    out = torch.zeros(steps, spec.heads, spec.head_dim, dtype=torch.float64)
    for t in range(steps):
        keys = [j for j in range(steps) if sees(t, j, sliding, spec.window, conv)]
        for h in range(spec.heads):
            g = h // group  # query heads h*K/H .. share kv head g (GQA)
            scores = torch.stack([q[t, h] @ k[j, g] * scale for j in keys])
            p = torch.softmax(scores, dim=0)
            out[t, h] = sum(p[n] * v[j, g] for n, j in enumerate(keys))
    return out.reshape(steps, spec.heads * spec.head_dim)


def independent_logits(
    config: dict, weights: dict[str, torch.Tensor], ids: list[int], window_convention: str
) -> torch.Tensor:
    """Logits (len(ids), vocab_size) of a PLaMo 3 checkpoint, float64, prefill from position 0."""
    if window_convention not in WINDOW_CONVENTIONS:
        raise ValueError(f"window_convention must be one of {WINDOW_CONVENTIONS}, got {window_convention!r}")
    s = read_config(config)
    D, H, K, d, F, V = s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab
    if not ids or min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"ids must be non-empty and in [0, {V})")
    steps = len(ids)
    positions = list(range(steps))
    tables = {t: cos_sin(s.rope[t], d, positions) for t in set(s.layer_types)}

    embed = _w(weights, "model.embed_tokens.weight", (V, D))
    h = embed[torch.tensor(ids)]
    if s.scale_embedding:  # PFN's SGLang port; vLLM 0.26 ignores the key
        h = h * math.sqrt(D)

    for i, kind in enumerate(s.layer_types):
        p = f"model.layers.layers.{i}."
        a = rms_norm(h, _w(weights, p + "pre_mixer_norm.weight", (D,)), OFFSET_PRE_MIXER, s.eps)
        qkv = a @ _w(weights, p + "mixer.qkv_proj.weight", ((H + 2 * K) * d, D)).T
        q = qkv[:, : H * d].reshape(steps, H, d)
        k = qkv[:, H * d : (H + K) * d].reshape(steps, K, d)
        v = qkv[:, (H + K) * d :].reshape(steps, K, d)
        q = rms_norm(q, _w(weights, p + "mixer.q_norm.weight", (d,)), OFFSET_QK, s.eps)
        k = rms_norm(k, _w(weights, p + "mixer.k_norm.weight", (d,)), OFFSET_QK, s.eps)
        cos, sin = tables[kind]
        q = torch.stack([rotate(q[t], cos[t], sin[t]) for t in positions])
        k = torch.stack([rotate(k[t], cos[t], sin[t]) for t in positions])
        o = _attention(s, q, k, v, kind == SLIDING, window_convention)
        o = o @ _w(weights, p + "mixer.o_proj.weight", (D, H * d)).T
        h = h + rms_norm(o, _w(weights, p + "post_mixer_norm.weight", (D,)), OFFSET_POST_MIXER, s.eps)

        b = rms_norm(h, _w(weights, p + "pre_mlp_norm.weight", (D,)), OFFSET_PRE_MLP, s.eps)
        gu = b @ _w(weights, p + "mlp.gate_up_proj.weight", (2 * F, D)).T
        gate, up = gu[:, :F], gu[:, F:]
        m = (gate * torch.sigmoid(gate) * up) @ _w(weights, p + "mlp.down_proj.weight", (D, F)).T
        h = h + rms_norm(m, _w(weights, p + "post_mlp_norm.weight", (D,)), OFFSET_POST_MLP, s.eps)

    h = rms_norm(h, _w(weights, "model.norm.weight", (D,)), OFFSET_FINAL, s.eps)
    if s.tied:
        head = embed
    else:
        if "lm_head.weight" not in weights:
            raise KeyError("untied checkpoint has no lm_head.weight")
        lm = weights["lm_head.weight"]
        if lm.ndim != 2 or lm.shape[1] != D or lm.shape[0] < V:
            raise ValueError(f"lm_head.weight: shape {tuple(lm.shape)}, expected ({V} or more, {D})")
        head = lm[:V].to(torch.float64)  # rows past vocab_size (the HF code rounds up to 16) are never logits
    return h @ head.T
