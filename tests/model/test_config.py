"""Plamo2Config: parsing, every error path, the derived values and the is_mamba layer rule
(docs/model.md §1-2)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from independent import hf_is_mamba
from model_helpers import preset_raw

from plamo2_tools.errors import ConfigError, UserError
from plamo2_tools.model import hf_tensor_shapes, num_parameters
from plamo2_tools.model.plamo2.config import MIN_MAX_POSITIONS, REQUIRED_KEYS, Plamo2Config
from plamo2_tools.model.plamo2.presets import PRESETS
from plamo2_tools.model.synth import preset_config


def parse(**overrides: Any) -> Plamo2Config:
    return Plamo2Config.from_dict(preset_raw("tiny", **overrides))


def parse_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        Plamo2Config.from_dict(raw)
    # A ConfigError is a UserError: the CLI prints it as one line with exit code 2.
    assert isinstance(e.value, UserError) and e.value.exit_code == 2
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- presets and round trips --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_parses_and_round_trips(name: str) -> None:
    cfg = preset_config(name)
    again = Plamo2Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.extra == cfg.extra  # `extra` is excluded from ==, so compare it on its own


def test_unknown_extra_keys_are_kept() -> None:
    # The real 1B config carries many keys inference ignores; they must survive a round trip.
    extra = {
        "capacity_factor": 1.0,
        "linear_type": "fp8",
        "image_feature_size": None,
        "auto_map": {"AutoConfig": "modeling_plamo.PlamoConfig"},
        "sliding_window": 2048,
    }
    raw = preset_raw("tiny") | extra
    cfg = Plamo2Config.from_dict(raw)
    assert cfg.extra == extra
    out = cfg.to_dict()
    assert {k: out[k] for k in extra} == extra


# ---- required keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_required_key(key: str) -> None:
    raw = preset_raw("tiny")
    del raw[key]
    msg = parse_error(raw)
    assert "missing" in msg and key in msg


def test_all_missing_keys_reported_at_once() -> None:
    raw = preset_raw("tiny", mamba_step=None, vocab_size=None, hidden_size=None)
    msg = parse_error(raw)
    assert all(k in msg for k in ("mamba_step", "vocab_size", "hidden_size"))


@pytest.mark.parametrize("value", ["64", 64.5, True, None, [64], {"v": 64}])
@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_required_key_must_be_integer(key: str, value: Any) -> None:
    msg = parse_error(preset_raw("tiny") | {key: value})
    assert key in msg and "integer" in msg


def test_integral_float_is_accepted_as_int() -> None:
    cfg = parse(hidden_size=64.0)
    assert cfg.hidden_size == 64 and type(cfg.hidden_size) is int


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_required_key_must_be_positive(key: str, value: int) -> None:
    assert key in parse_error(preset_raw("tiny") | {key: value})


# ---- impossible values --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"mamba_step": 1}, "mamba_step"),  # the pattern i % step != step // 2 needs step > 1
        ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 query heads
        ({"num_key_value_heads": 8}, "num_key_value_heads"),  # more KV heads than query heads
        ({"hidden_size_per_head": 15}, "hidden_size_per_head"),  # rotate-half needs an even d
        ({"mamba_d_conv": 1}, "mamba_d_conv"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": -10000}, "rope_theta"),
        ({"attention_window_size": 0}, "attention_window_size"),
        ({"mamba_chunk_size": 0}, "mamba_chunk_size"),
        ({"mamba_chunk_size": "256"}, "mamba_chunk_size"),
        ({"attention_window_size": 2.5}, "attention_window_size"),
    ],
)
def test_impossible_values(overrides: dict[str, Any], key: str) -> None:
    assert key in parse_error(preset_raw("tiny", **overrides))


@pytest.mark.parametrize("model_type", ["llama", "mamba2", "plamo3", "", 2])
def test_unknown_model_type(model_type: Any) -> None:
    msg = parse_error(preset_raw("tiny", model_type=model_type))
    assert "model_type" in msg


def test_other_models_config_is_reported_by_model_type() -> None:
    # A Llama config lacks the Mamba keys; the user must hear "not PLaMo 2", not "missing keys".
    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
    msg = parse_error(llama)
    assert "model_type" in msg and "missing" not in msg


def test_absent_model_type_defaults_to_plamo2() -> None:
    assert Plamo2Config.from_dict(preset_raw("tiny", model_type=None)).model_type == "plamo2"


@pytest.mark.parametrize("idx", [[4], [-1], [0, 7], [100]])
def test_full_attention_idx_out_of_range(idx: list[int]) -> None:
    msg = parse_error(preset_raw("tiny", full_attention_idx=idx))  # tiny has 4 layers
    assert "full_attention_idx" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("full_attention_idx", 3),  # not a list
        ("full_attention_idx", ["x"]),
        ("full_attention_idx", [1.5]),
        ("rope_theta", "1e6"),
        ("rms_norm_eps", "1e-6"),
        ("max_position_embeddings", "big"),
        ("mamba_enabled", "false"),  # bool("false") would be True
        ("tie_word_embeddings", "no"),
    ],
)
def test_optional_keys_of_the_wrong_type(key: str, value: Any) -> None:
    # These used to escape as ValueError/TypeError (a traceback in the CLI) or be silently misread.
    assert key in parse_error(preset_raw("tiny", **{key: value}))


# ---- defaults and derived values ------------------------------------------------------------
def test_defaults() -> None:
    cfg = parse()
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 10000.0
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.full_attention_idx == ()
    assert cfg.mamba_enabled is True
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, None)
    assert cfg.max_position_embeddings == 10 * 2**20


def test_explicit_null_means_default() -> None:
    raw = preset_raw("tiny") | {"rope_theta": None, "full_attention_idx": None, "tie_word_embeddings": None}
    cfg = Plamo2Config.from_dict(raw)
    assert (cfg.rope_theta, cfg.full_attention_idx, cfg.tie_word_embeddings) == (10000.0, (), True)


@pytest.mark.parametrize(("given", "expected"), [(None, 10 * 2**20), (2048, 10 * 2**20), (2**24, 2**24)])
def test_max_position_embeddings_forced_to_at_least_10_mi(given: int | None, expected: int) -> None:
    # HF's remote code: max(10 * 2**20, given).
    assert expected == max(MIN_MAX_POSITIONS, given or 0)
    assert parse(max_position_embeddings=given).max_position_embeddings == expected


@pytest.mark.parametrize(("Hm", "d"), [(8, 16), (32, 128), (64, 128), (3, 10)])
def test_mamba_inner_width(Hm: int, d: int) -> None:
    assert parse(mamba_num_heads=Hm, hidden_size_per_head=d).mamba_inner == Hm * d


@pytest.mark.parametrize(("D", "R"), [(64, 64), (1024, 64), (1039, 64), (1040, 65), (2048, 128), (4096, 256)])
def test_time_step_rank(D: int, R: int) -> None:
    assert parse(hidden_size=D).dt_rank == R


@pytest.mark.parametrize(
    ("V", "Vp", "head_rows"),
    [
        (1, 64, 16),
        (64, 64, 64),
        (65, 128, 80),
        (300, 320, 304),
        (515, 576, 528),
        (100000, 100032, 100000),
        (100032, 100032, 100032),
    ],
)
def test_padded_vocab(V: int, Vp: int, head_rows: int) -> None:
    cfg = parse(vocab_size=V)
    assert cfg.padded_vocab == Vp == math.ceil(V / 64) * 64
    assert cfg.lm_head_rows == head_rows  # HF rounds an untied lm_head to 16 rows


# ---- the is_mamba rule ----------------------------------------------------------------------
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("step", range(2, 8))
@pytest.mark.parametrize("L", range(1, 13))
def test_layer_rule_matches_hf_is_mamba(L: int, step: int, enabled: bool) -> None:
    raw = preset_raw("tiny", num_hidden_layers=L, mamba_step=step, mamba_enabled=enabled)
    cfg = Plamo2Config.from_dict(raw)
    assert cfg.layer_is_mamba == tuple(hf_is_mamba(raw, i) for i in range(L))
    assert cfg.layer_kinds == tuple("mamba" if m else "attention" for m in cfg.layer_is_mamba)


@pytest.mark.parametrize(
    ("L", "step", "kinds"),
    [
        (16, 2, "MA" * 8),  # plamo-2-1b: even layers Mamba, odd attention
        (5, 3, "MAMMA"),  # i % 3 != 1
        (1, 2, "A"),  # edge case L <= step // 2: the single layer is the last, hence attention
        (2, 5, "MA"),  # edge case: all Mamba but the last
        (3, 6, "MMA"),  # edge case, L == step // 2
        (4, 6, "MMMA"),  # just past the edge: the regular rule (i % 6 != 3) happens to agree
        (4, 7, "MMMA"),  # regular rule, step // 2 = 3
        (8, 4, "MMAMMMAM"),
    ],
)
def test_layer_rule_examples(L: int, step: int, kinds: str) -> None:
    cfg = parse(num_hidden_layers=L, mamba_step=step)
    assert "".join("M" if m else "A" for m in cfg.layer_is_mamba) == kinds


def test_mamba_disabled_means_all_attention_even_with_step_1() -> None:
    # HF returns False before asserting mamba_step > 1, so step 1 is fine without Mamba.
    cfg = parse(mamba_enabled=False, mamba_step=1, num_hidden_layers=3)
    assert cfg.layer_kinds == ("attention",) * 3
    assert not any("mixer.in_proj" in n for n in hf_tensor_shapes(cfg))


def test_attention_window_per_layer() -> None:
    cfg = Plamo2Config.from_dict(preset_raw("tiny-gqa"))  # window 10, full attention in layer 4
    assert cfg.attention_window(1) == 10
    assert cfg.attention_window(4) is None


# ---- tensor inventory and parameter counts (spec section 3 and the cross-check of 1.2) -------------
def test_inventory_counts_per_layer_kind() -> None:
    for name in ("tiny", "tiny-gqa", "tiny-edge"):
        cfg = preset_config(name)
        kinds = cfg.layer_kinds
        expected = 17 * kinds.count("mamba") + 10 * kinds.count("attention") + 2 + (not cfg.tie_word_embeddings)
        assert len(hf_tensor_shapes(cfg)) == expected


def test_plamo_2_1b_numbers() -> None:
    cfg = preset_config("plamo-2-1b")
    shapes = hf_tensor_shapes(cfg)
    assert num_parameters(cfg) == 1_291_441_920
    assert num_parameters(cfg) * 4 == 5_165_767_680  # 5.166 GB float32
    assert len(shapes) == 218
    assert (cfg.mamba_inner, cfg.dt_rank, cfg.padded_vocab) == (4096, 128, 100032)
    assert "lm_head.weight" not in shapes
    layer0, layer1 = "model.layers.layers.0.mixer.", "model.layers.layers.1.mixer."
    assert shapes[layer0 + "in_proj.weight"] == (8192, 2048)
    assert shapes[layer0 + "conv1d.weight"] == (4096, 1, 4)
    assert shapes[layer0 + "bcdt_proj.weight"] == (256, 4096)
    assert shapes[layer0 + "dt_proj.weight"] == (32, 128)
    assert shapes[layer1 + "qkv_proj.weight"] == (2304, 2048)
    assert shapes[layer1 + "k_weight"] == (1, 128)


def test_plamo_2_8b_and_translate_numbers() -> None:
    cfg = preset_config("plamo-2-8b")
    assert num_parameters(cfg) == 9_118_372_864  # tied, V = 100000
    assert len(hf_tensor_shapes(cfg)) == 434
    assert (cfg.mamba_inner, cfg.dt_rank) == (8192, 256)
    translate = dataclasses.replace(cfg, tie_word_embeddings=False, vocab_size=100032)
    assert num_parameters(translate) == 9_528_235_008  # llama.cpp's "9.53 B"
    assert len(hf_tensor_shapes(translate)) == 435  # GGUF tensor count


# ---- from_file ------------------------------------------------------------------------------
def test_from_file_accepts_dir_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_raw("tiny")))
    assert Plamo2Config.from_file(tmp_path) == Plamo2Config.from_file(tmp_path / "config.json")


@pytest.mark.parametrize(("text", "why"), [(None, "not found"), ("{nope", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_from_file_errors(tmp_path: Path, text: str | None, why: str) -> None:
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=why):
        Plamo2Config.from_file(tmp_path)
