"""PLaMo 3 as mlx-lm 0.32.2 loads it (`mlx_lm/models/plamo3.py`, model_type "plamo3"; docs/export.md).

Names and values as in the HF checkpoint (norm offsets, q/k norms' +1 included, are added by
mlx-lm at run time; its `sanitize` drops `lm_head.weight` of a tied model, which the HF
checkpoint does not hold anyway).  The config needs care: mlx-lm's ModelArgs reads only the flat
keys `rope_theta` (full layers), `rope_local_theta` (sliding ones), `window_size` (or
`sliding_window`, which wins) and `sliding_window_pattern` (a layer is full when
(i + 1) % pattern == 0), and falls back to its own defaults (1e6, 1e4) where a key is missing.  A
transformers-v5 config (`rope_parameters` per layer type, `layer_types`) has none of the flat
keys, so the export writes them from the typed config.

`--mixed` keeps PFN's split for the tensors PLaMo 3 has (plamo-translate-cli's MLX loader: the
MLPs at --bits, everything else at 8 bits); PLaMo 3 has no Mamba tensors to keep unquantized.

What mlx-lm 0.32.2 computes differently from the HF reference (`differences`):
* no YaRN (`nn.RoPE` with a plain base): a config with rope scaling differs from position 1 on;
* layer types come from the pattern rule only: explicit `layer_types` that break it differ;
* `scale_embedding` is not read (no sqrt(hidden) scaling of the embedding);
* the window: a full forward masks with window_size + 1 (the query and W keys before it, the
  reference's "hf" convention), but decoding keeps W keys in a `RotatingKVCache(max_size=W)`,
  the query included ("vllm"): greedy continuations past the window follow neither exactly.
"""

from __future__ import annotations

from typing import Any

from ..mlx import BASE, BULK, Difference, MLXLayout, mlx_table
from .config import FULL, Plamo3Config
from .tensors import TENSORS

TABLE = mlx_table(
    TENSORS,
    linear={
        "model.embed_tokens.weight": BASE,
        "lm_head.weight": BASE,
        "mixer.qkv_proj.weight": BASE,
        "mixer.o_proj.weight": BASE,
        "mlp.gate_up_proj.weight": BULK,
        "mlp.down_proj.weight": BULK,
    },
)


def pattern_is_full(cfg: Plamo3Config, layer: int) -> bool:
    """mlx-lm's rule (plamo3.py `is_full_attention`)."""
    return not (layer + 1) % cfg.sliding_window_pattern


def mlx_config(raw: dict[str, Any], cfg: Plamo3Config) -> dict[str, Any]:
    out = dict(raw)
    out.update(
        {
            "rope_theta": cfg.rope_full.theta,
            "rope_local_theta": cfg.rope_sliding.theta,
            "window_size": cfg.window_size,
            "sliding_window_pattern": cfg.sliding_window_pattern,
            "head_dim": cfg.head_dim,
        }
    )
    if "sliding_window" in out:  # mlx-lm prefers it over window_size: the same value, or none at all
        out["sliding_window"] = cfg.window_size
    return out


def differences(cfg: Plamo3Config) -> list[Difference]:
    out: list[Difference] = []
    for kind, rope in (("full", cfg.rope_full), ("sliding", cfg.rope_sliding)):
        if rope.is_yarn:
            out.append(
                Difference(
                    "yarn",
                    f"the {kind}-attention layers use {rope.describe()}, but mlx-lm has no "
                    "YaRN (plain RoPE with the base alone)",
                    1,
                )
            )
    mismatched = [i for i in range(cfg.num_hidden_layers) if (cfg.layer_types[i] == FULL) != pattern_is_full(cfg, i)]
    if mismatched:
        rule = f"(i + 1) % {cfg.sliding_window_pattern} == 0 is full"
        out.append(
            Difference(
                "layer_types",
                f"layer(s) {mismatched} have a type that mlx-lm's pattern rule ({rule}) does not give them",
                1,
            )
        )
    if cfg.scale_embedding:
        out.append(
            Difference(
                "scale_embedding",
                "scale_embedding is set, but mlx-lm does not scale the embedding by sqrt(hidden_size)",
                0,
            )
        )
    if any(t != FULL for t in cfg.layer_types):
        w = cfg.window_size
        out.append(
            Difference(
                "window_decode",
                f"mlx-lm scores a sequence with the reference's window (the query and "
                f"{w} keys before it) but decodes with a cache of {w} keys in all, the query included: "
                f"greedy continuations past position {w} follow the other convention",
            )
        )
    return out


LAYOUT = MLXLayout("plamo3", TABLE, mlx_config, differences, "0.32.2")
