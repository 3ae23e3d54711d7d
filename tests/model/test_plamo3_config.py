"""PLaMo 3's config: both forms real checkpoints carry describe the same model, PFN's defaults and
legacy names, the layer-type rule, YaRN, and one-line refusals (docs/plamo3.md, "Configuration")."""

from __future__ import annotations

from typing import Any

import pytest

from plamo2_tools.errors import ConfigError
from plamo2_tools.model import config_from_dict, family_of, hf_tensor_shapes, num_parameters
from plamo2_tools.model.plamo3.config import FULL, SLIDING, Plamo3Config, Rope
from plamo2_tools.model.synth import preset_config

V4: dict[str, Any] = {
    "model_type": "plamo3",
    "architectures": ["Plamo3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 700,
    "window_size": 5,
    "sliding_window_pattern": 3,
    "rope_theta": 1e6,
    "rope_local_theta": 10.0,
    "rope_scaling_factor": 2.0,
    "initial_context_length": 32,
}
V5: dict[str, Any] = {
    **{
        k: v
        for k, v in V4.items()
        if k
        not in (
            "rope_theta",
            "rope_local_theta",
            "rope_scaling_factor",
            "initial_context_length",
            "sliding_window_pattern",
        )
    },
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    "rope_parameters": {
        FULL: {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 2.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        SLIDING: {"rope_type": "default", "rope_theta": 10.0},
    },
}


def _model(cfg: Plamo3Config) -> tuple:
    """Everything that decides the computation (not the form it was written in)."""
    return (
        cfg.layer_types,
        cfg.window_size,
        cfg.rope_full,
        cfg.rope_sliding,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
    )


def test_v4_and_v5_forms_are_the_same_model() -> None:
    a, b = config_from_dict(V4), config_from_dict(V5)
    assert isinstance(a, Plamo3Config) and family_of(a).name == "plamo3"
    assert _model(a) == _model(b)
    assert (a.v5, b.v5) == (False, True)
    assert a.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)  # (i + 1) % 3 == 0 is full
    assert a.rope_full == Rope(1e6, 2.0, 32) and a.rope_sliding == Rope(10.0)
    for cfg in (a, b):  # each form writes itself back as it came, and reads back the same
        again = config_from_dict(cfg.to_dict())
        assert _model(again) == _model(cfg) and again.v5 == cfg.v5


def test_defaults_are_pfns_config_class() -> None:
    cfg = config_from_dict({"model_type": "plamo3"})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        4096,
        32,
        32,
        4,
    )
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.window_size) == (128, 13312, 32000, 128)
    assert cfg.rope_full == Rope(150000.0) and cfg.rope_sliding == Rope(10000.0)
    assert cfg.tie_word_embeddings and cfg.sliding_window_pattern == 8
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [7, 15, 23, 31]


def test_detected_by_architectures_when_model_type_is_absent() -> None:
    raw = {k: v for k, v in V4.items() if k != "model_type"}
    assert isinstance(config_from_dict(raw), Plamo3Config)


@pytest.mark.parametrize(
    "legacy, expect",
    [
        ({"rope_global_theta": 7e5}, lambda c: c.rope_full.theta == 7e5),
        ({"rope_local_base_freq": 33.0}, lambda c: c.rope_sliding.theta == 33.0),
        ({"sliding_window": 9}, lambda c: c.window_size == 9),
        ({"sliding_window": [9, None, 9]}, lambda c: c.window_size == 9),  # a uniform per-layer list
        ({"interleaved_sliding_window": [11, 11, None]}, lambda c: c.window_size == 11),
    ],
)
def test_legacy_keys_map_as_pfns_class_maps_them(legacy: dict[str, Any], expect: Any) -> None:
    raw = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_theta", "window_size")} | legacy
    assert expect(config_from_dict(raw))


def test_current_keys_win_over_legacy_ones() -> None:
    cfg = config_from_dict(V4 | {"rope_global_theta": 1.0, "sliding_window": 99})
    assert cfg.rope_full.theta == 1e6 and cfg.window_size == 5


def test_window_conventions_differ_by_one_key_and_full_layers_have_none() -> None:
    cfg = config_from_dict(V4)
    assert cfg.window_keys(0, "hf") == 5 and cfg.window_keys(0, "vllm") == 4
    assert cfg.window_keys(2, "hf") is None and cfg.window_keys(2, "vllm") is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"head_dim": 15}, "must be even"),
        ({"tie_word_embeddings": "false"}, "must be true or false"),
        ({"window_size": 0}, "must be a positive integer"),
        ({"rope_theta": float("nan")}, "finite number"),
        ({"initial_context_length": None}, "initial_context_length"),
        ({"layer_types": [FULL] * 5}, "layer_types must list 6 entries"),
        ({"layer_types": ["chunked_attention"] * 6}, "layer_types must list"),
        ({"sliding_window": [4, 5]}, "expected one window"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_bad_configs_are_one_line(change: dict[str, Any], words: str) -> None:
    raw = {**V4, **change}
    if "sliding_window" in change:
        raw.pop("window_size")
    with pytest.raises(ConfigError, match=words) as e:
        config_from_dict(raw)
    assert "\n" not in str(e.value)


def test_plamo_3_8b_has_its_published_parameter_count() -> None:
    cfg = preset_config("plamo-3-8b")
    assert num_parameters(cfg) == 8_091_348_992  # the model card's exact count (tied embeddings)
    assert sum(t == FULL for t in cfg.layer_types) == 4


def test_untied_head_rows_are_vllms() -> None:
    cfg = preset_config("tiny3-mqa")  # V = 515: pad64 576, round16 528, 576 + 528 - 515 = 589 -> 640
    assert (cfg.padded_vocab, cfg.lm_head_rows) == (576, 640)
    assert hf_tensor_shapes(cfg)["lm_head.weight"] == (515, 48)  # vLLM asserts exactly V rows
