"""The independent PLaMo 3 oracle (tests/model/plamo3_independent.py) checked against itself, by hand and against vLLM.

The pure tests are fast and run in CI. The last test is opt-in (`-m vllm`): it runs bench/plamo3_vllm_forward.py in
vLLM 0.26.0's own venv, which builds vLLM's Plamo3ForCausalLM on CPU and compares its logits, rotary tables and
per-rank loaded state with this oracle (the committed result: reports/vllm/plamo3_forward.json).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plamo3_independent", Path(__file__).with_name("plamo3_independent.py"))
assert _spec is not None and _spec.loader is not None
p3 = importlib.util.module_from_spec(_spec)
sys.modules["plamo3_independent"] = p3
_spec.loader.exec_module(p3)

FULL, SLIDING = p3.FULL, p3.SLIDING

# 5 layers, pattern 3: layers 2 full, 0, 1, 3, 4 sliding; window 3 < the 12-token prompt; GQA 4 over 2 heads.
V4 = {
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 40,
    "vocab_size": 97,
    "rms_norm_eps": 1e-6,
    "window_size": 3,
    "sliding_window_pattern": 3,
    "rope_theta": 150000,
    "rope_local_theta": 10000,
    "tie_word_embeddings": True,
}
V5 = {
    **{
        k: v
        for k, v in V4.items()
        if k not in ("window_size", "sliding_window_pattern", "rope_theta", "rope_local_theta")
    },
    "sliding_window": 3,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING],
    "rope_parameters": {
        FULL: {"rope_type": "default", "rope_theta": 150000},
        SLIDING: {"rope_type": "default", "rope_theta": 10000},
    },
}
IDS = [5, 17, 3, 96, 0, 42, 42, 8, 61, 30, 77, 1]


def random_weights(cfg: dict, seed: int = 0, untied_rows: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, L, H, K = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, F, V = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    w = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": r(D, s=0.1)}
    for i in range(L):
        p = f"model.layers.layers.{i}."
        w |= {
            p + "pre_mixer_norm.weight": r(D, s=0.1),
            p + "mixer.qkv_proj.weight": r((H + 2 * K) * d, D, s=D**-0.5),
            p + "mixer.q_norm.weight": r(d, s=0.1),
            p + "mixer.k_norm.weight": r(d, s=0.1),
            p + "mixer.o_proj.weight": r(D, H * d, s=(H * d) ** -0.5),
            p + "post_mixer_norm.weight": r(D, s=0.1),
            p + "pre_mlp_norm.weight": r(D, s=0.1),
            p + "mlp.gate_up_proj.weight": r(2 * F, D, s=D**-0.5),
            p + "mlp.down_proj.weight": r(D, F, s=F**-0.5),
            p + "post_mlp_norm.weight": r(D, s=0.1),
        }
    if untied_rows is not None:
        w["lm_head.weight"] = r(untied_rows, D, s=0.5)
    return w


W = random_weights(V4)


# ----------------------------------------------------------------------------------------------------------------
# config forms
# ----------------------------------------------------------------------------------------------------------------


def test_v4_and_v5_configs_describe_the_same_model_and_give_identical_logits() -> None:
    a, b = p3.read_config(V4), p3.read_config(V5)
    assert a == b
    assert a.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING)
    assert torch.equal(p3.independent_logits(V4, W, IDS, "vllm"), p3.independent_logits(V5, W, IDS, "vllm"))
    assert torch.equal(p3.independent_logits(V4, W, IDS, "hf"), p3.independent_logits(V5, W, IDS, "hf"))


@pytest.mark.parametrize(
    "legacy",
    [
        {"window_size": None, "sliding_window": 3},  # legacy int
        {"window_size": 128, "sliding_window": [3, 3, None, 3, 3]},  # legacy per-layer list overrides window_size
        {"rope_theta": None, "rope_global_theta": 150000},
        {"rope_theta": 150000, "rope_global_theta": 150000},
        {"rope_local_theta": None, "rope_local_base_freq": 10000},
        # what transformers' standardisation leaves for a v4 config: a flat dict for the full layers
        {"rope_parameters": {"rope_type": "default", "rope_theta": 150000}, "rope_theta": None},
        # the older remote config also saves its derived per-layer windows
        {"interleaved_sliding_window": [3, 3, None, 3, 3]},
        # the older remote config's nested rope_scaling dict
        {
            "rope_scaling": {
                FULL: {"rope_type": "default", "rope_theta": 150000},
                SLIDING: {"rope_type": "default", "rope_theta": 10000},
            }
        },
    ],
)
def test_legacy_spellings_read_as_the_canonical_config(legacy: dict) -> None:
    cfg = {k: v for k, v in {**V4, **legacy}.items() if v is not None}
    assert p3.read_config(cfg) == p3.read_config(V4)


def test_defaults_are_pfns_newest_remote_config() -> None:
    s = p3.read_config({})
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab) == (
        4096,
        32,
        32,
        4,
        128,
        13312,
        32000,
    )
    assert (s.eps, s.tied, s.window) == (1e-6, True, 128)
    assert s.layer_types == tuple(FULL if (i + 1) % 8 == 0 else SLIDING for i in range(32))
    assert s.rope == {FULL: p3.Rope(theta=150000.0), SLIDING: p3.Rope(theta=10000.0)}
    assert not s.scale_embedding


def test_rope_scaling_factor_builds_yarn_on_full_layers_only() -> None:
    s = p3.read_config({**V4, "rope_scaling_factor": 4.0, "initial_context_length": 64})
    assert s.rope[FULL] == p3.Rope(
        theta=150000.0, yarn=True, factor=4.0, original_max=64, beta_fast=32.0, beta_slow=1.0, truncate=False
    )
    assert s.rope[SLIDING] == p3.Rope(theta=10000.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": [FULL] * 5}, "disagrees with sliding_window_pattern"),
        ({"layer_types": [SLIDING] * 4}, "must list 5"),
        ({"rope_scaling_factor": 2.0}, "needs initial_context_length"),
        ({"initial_context_length": 64}, "rope_scaling_factor is 1"),
        ({"sliding_window": [3, 4, None, 3, 3]}, "more than one window"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"interleaved_sliding_window": [3, 3, 3, 3, 3]}, "interleaved_sliding_window disagrees"),
        (
            {"rope_parameters": {FULL: {"rope_type": "default"}, SLIDING: {"rope_type": "default", "rope_theta": 1}}},
            "no rope_theta",
        ),
        (
            {
                "rope_parameters": {
                    FULL: {
                        "rope_type": "yarn",
                        "rope_theta": 1,
                        "factor": 2,
                        "original_max_position_embeddings": 8,
                        "attention_factor": 0.5,
                    },
                    SLIDING: {"rope_type": "default", "rope_theta": 1},
                }
            },
            "does not implement",
        ),
        (
            {
                "rope_parameters": {
                    FULL: {"rope_type": "linear", "rope_theta": 1, "factor": 2},
                    SLIDING: {"rope_type": "default", "rope_theta": 1},
                }
            },
            "not implemented",
        ),
        ({"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1}}}, "no entry for"),
    ],
)
def test_ambiguous_or_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p3.read_config({**V4, **change})


# ----------------------------------------------------------------------------------------------------------------
# sliding window conventions
# ----------------------------------------------------------------------------------------------------------------


def test_sees_by_hand() -> None:
    # W = 2. "vllm": the query and 1 earlier token (2 keys); "hf": the query and 2 earlier tokens (3 keys).
    rows = {conv: [[int(p3.sees(q, k, True, 2, conv)) for k in range(5)] for q in range(5)] for conv in ("vllm", "hf")}
    assert rows["vllm"] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert rows["hf"] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert all(p3.sees(q, k, False, 2, "vllm") == (k <= q) for q in range(5) for k in range(5))


def test_window_conventions_agree_before_the_window_and_differ_after() -> None:
    window = p3.read_config(V4).window
    hf, vllm = p3.independent_logits(V4, W, IDS, "hf"), p3.independent_logits(V4, W, IDS, "vllm")
    # Positions 0 .. W-1 see the same keys under both rules: the very same arithmetic.
    assert torch.equal(hf[:window], vllm[:window])
    # From position W on, "hf" sees one key more in every sliding layer.
    gap = (hf[window:] - vllm[window:]).abs().amax(-1)
    assert bool((gap > 1e-3).all()), gap


def test_window_conventions_agree_everywhere_without_sliding_layers() -> None:
    cfg = {**V4, "sliding_window_pattern": 1}  # every layer full
    assert torch.equal(p3.independent_logits(cfg, W, IDS, "hf"), p3.independent_logits(cfg, W, IDS, "vllm"))


def test_window_as_long_as_the_prompt_is_full_attention_under_the_hf_rule() -> None:
    # "hf" with W = T - 1 sees every earlier token (T keys at the last position), like full attention (with the
    # same RoPE base on both layer types, so that only the masks differ).
    same_base = {**V4, "rope_local_theta": V4["rope_theta"]}
    full = {**same_base, "sliding_window_pattern": 1}
    wide = {**same_base, "window_size": len(IDS) - 1}
    assert torch.allclose(
        p3.independent_logits(wide, W, IDS, "hf"), p3.independent_logits(full, W, IDS, "hf"), rtol=0, atol=1e-12
    )
    assert not torch.allclose(p3.independent_logits(wide, W, IDS, "vllm"), p3.independent_logits(full, W, IDS, "hf"))


def test_unknown_window_convention_is_refused() -> None:
    with pytest.raises(ValueError, match="window_convention"):
        p3.independent_logits(V4, W, IDS, "W")


# ----------------------------------------------------------------------------------------------------------------
# RoPE and YaRN
# ----------------------------------------------------------------------------------------------------------------


def test_rope_rotation_by_hand() -> None:
    # d = 4, base 100: inverse frequencies 100**0 = 1 and 100**(-1/2) = 0.1; NeoX pairs dims (0, 2) and (1, 3).
    rope = p3.Rope(theta=100.0)
    assert p3.inverse_frequencies(rope, 4) == pytest.approx([1.0, 0.1], abs=1e-15)
    cos, sin = p3.cos_sin(rope, 4, [0, 3])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert torch.equal(p3.rotate(x, cos[0], sin[0]), x)  # position 0: identity
    c1, s1, c2, s2 = math.cos(3.0), math.sin(3.0), math.cos(0.3), math.sin(0.3)
    expected = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    assert p3.rotate(x, cos[1], sin[1]).tolist() == pytest.approx(expected, abs=1e-15)


def test_yarn_by_hand() -> None:
    # d = 8, base 10000, factor 4, original context 2048, beta_fast 32, beta_slow 1.
    # correction dim(r) = d ln(2048 / (2 pi r)) / (2 ln 10000): low = dim(32) ~ 1.008, high = dim(1) ~ 2.513.
    low = 8 * math.log(2048 / (2 * math.pi * 32)) / (2 * math.log(10000))
    high = 8 * math.log(2048 / (2 * math.pi)) / (2 * math.log(10000))
    assert (round(low, 3), round(high, 3)) == (1.008, 2.513)
    plain = [1.0, 0.1, 0.01, 0.001]  # 10000 ** (-2i / 8)
    # ramp(i) = clamp((i - low) / (high - low), 0, 1); the unscaled frequency keeps weight 1 - ramp.
    # i = 0, 1: ramp 0 (fast dims, kept); i = 3: ramp 1 (divided by 4); i = 2: ramp (2 - low) / (high - low).
    r2 = (2 - low) / (high - low)
    untruncated = [1.0, 0.1, 0.01 * (1 - r2) + 0.01 / 4 * r2, 0.001 / 4]
    rope = p3.Rope(theta=10000.0, yarn=True, factor=4.0, original_max=2048, truncate=False)
    assert p3.inverse_frequencies(rope, 8) == pytest.approx(untruncated, rel=1e-14)
    # truncate=True rounds the range out to [1, 3]: ramp(2) = 1/2.
    truncated = [1.0, 0.1, 0.01 / 2 + 0.01 / 8, 0.001 / 4]
    assert p3.inverse_frequencies(dataclasses.replace(rope, truncate=True), 8) == pytest.approx(truncated, rel=1e-14)
    assert p3.inverse_frequencies(p3.Rope(theta=10000.0), 8) == pytest.approx(plain, rel=1e-15)
    # magnitude 0.1 ln 4 + 1 on cos and sin
    assert p3.magnitude(rope) == pytest.approx(1.1386294361119890, abs=1e-15)
    cos, sin = p3.cos_sin(rope, 8, [5])
    assert cos[0].tolist() == pytest.approx([math.cos(5 * f) * p3.magnitude(rope) for f in untruncated], abs=1e-14)
    assert sin[0].tolist() == pytest.approx([math.sin(5 * f) * p3.magnitude(rope) for f in untruncated], abs=1e-14)


def test_yarn_clamp_can_invert_the_range_as_vllm_does() -> None:
    # vLLM clamps low to >= 0 and high to <= d - 1 separately, so a range outside the head comes out reversed.
    # Original context 4: both dims negative (-1.70, -0.20) -> low 0, high -0.20: ramp(i) = i / -0.20 <= 0 -> 0,
    # every frequency keeps its unscaled value (only the magnitude changes).
    short = p3.Rope(theta=10000.0, yarn=True, factor=2.0, original_max=4, truncate=False)
    assert p3.inverse_frequencies(short, 8) == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-14)
    # Original context 1e12: both dims past the head (9.7, 11.2) -> low 9.7, high 7: ramp(i) = (i - 9.7) / -2.7 >= 1,
    # every frequency is divided by the factor.
    long = p3.Rope(theta=10000.0, yarn=True, factor=2.0, original_max=10**12, truncate=False)
    assert p3.inverse_frequencies(long, 8) == pytest.approx([1.0 / 2, 0.1 / 2, 0.01 / 2, 0.001 / 2], rel=1e-14)


def test_yarn_with_factor_one_is_plain_rope() -> None:
    yarn1 = p3.Rope(theta=150000.0, yarn=True, factor=1.0, original_max=64, truncate=False)
    assert p3.inverse_frequencies(yarn1, 16) == pytest.approx(
        p3.inverse_frequencies(p3.Rope(theta=150000.0), 16), rel=1e-15
    )
    assert p3.magnitude(yarn1) == 1.0
    cfg = {
        **V5,
        "rope_parameters": {
            **V5["rope_parameters"],
            FULL: {
                "rope_type": "yarn",
                "rope_theta": 150000,
                "factor": 1.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    }
    assert p3.read_config(cfg).rope[FULL].yarn
    torch.testing.assert_close(
        p3.independent_logits(cfg, W, IDS, "vllm"), p3.independent_logits(V5, W, IDS, "vllm"), rtol=0, atol=1e-12
    )


def test_yarn_changes_only_the_full_layers() -> None:
    yarn = {**V4, "rope_scaling_factor": 4.0, "initial_context_length": 4}
    plain = p3.independent_logits(V4, W, IDS, "vllm")
    assert not torch.allclose(p3.independent_logits(yarn, W, IDS, "vllm"), plain)
    no_full = {**V4, "sliding_window_pattern": 99}  # 5 layers, none full: YaRN has nothing to act on
    torch.testing.assert_close(
        p3.independent_logits({**no_full, "rope_scaling_factor": 4.0, "initial_context_length": 4}, W, IDS, "vllm"),
        p3.independent_logits(no_full, W, IDS, "vllm"),
        rtol=0,
        atol=0,
    )


# ----------------------------------------------------------------------------------------------------------------
# the forward by hand, and symmetries it must have
# ----------------------------------------------------------------------------------------------------------------


def test_tiny_forward_by_hand() -> None:
    # One layer, D = d = 2, one head, F = 1, V = 3, eps 0, every norm weight 0 (so the offsets are the multipliers:
    # pre 1, post-mixer 1/5, pre-MLP 1, post-MLP 5**-1.5, final 1), one token (id 2) at position 0.
    cfg = {
        "hidden_size": 2,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "intermediate_size": 1,
        "vocab_size": 3,
        "rms_norm_eps": 0.0,
        "window_size": 1,
        "sliding_window_pattern": 1,
    }
    t = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    p = "model.layers.layers.0."
    w = {"model.embed_tokens.weight": t([[1, 0], [0, 1], [1, 1]]), "model.norm.weight": t([0, 0])}
    w |= {
        p + n: t([0, 0])
        for n in (
            "pre_mixer_norm.weight",
            "post_mixer_norm.weight",
            "pre_mlp_norm.weight",
            "post_mlp_norm.weight",
            "mixer.q_norm.weight",
            "mixer.k_norm.weight",
        )
    }
    w[p + "mixer.qkv_proj.weight"] = t([[1, 0], [0, 1], [1, 0], [0, 1], [2, 0], [0, -1]])  # q = k = a, v = (2a0, -a1)
    w[p + "mixer.o_proj.weight"] = t([[1, 0], [0, 1]])
    w[p + "mlp.gate_up_proj.weight"] = t([[1, 0], [0, 1]])  # gate = b0, up = b1
    w[p + "mlp.down_proj.weight"] = t([[1], [1]])
    # h0 = (1, 1); RMS(h0) = (1, 1); one key: attention output = v = (2, -1), RMS(v) = (2, -1) / sqrt(2.5)
    # h1 = h0 + (2, -1) / (5 sqrt 2.5)                                   = (1.2529822128, 0.8735088936)
    # b = RMS(h1) = h1 / sqrt((h1_0^2 + h1_1^2) / 2)                     = (1.1601234084, 0.8087729455)
    # c = silu(b0) * b1 = 0.7143615779 > 0, MLP out (c, c), RMS -> (1, 1); h2 = h1 + 5**-1.5 (1, 1)
    #                                                                    = (1.3424249319, 0.9629516127)
    # n = RMS(h2) = (1.1491400593, 0.8243040240); logits = E n = (n0, n1, n0 + n1)
    logits = p3.independent_logits(cfg, w, [2], "vllm")
    assert logits.shape == (1, 3)
    assert logits[0].tolist() == pytest.approx([1.1491400593, 0.8243040240, 1.9734440834], abs=1e-9)
    # the same arithmetic in scalars
    s = math.sqrt(2.5)
    h1 = (1 + 2 / (5 * s), 1 - 1 / (5 * s))
    r1 = math.sqrt((h1[0] ** 2 + h1[1] ** 2) / 2)
    b = (h1[0] / r1, h1[1] / r1)
    assert b[0] / (1 + math.exp(-b[0])) * b[1] > 0
    h2 = (h1[0] + 5**-1.5, h1[1] + 5**-1.5)
    r2 = math.sqrt((h2[0] ** 2 + h2[1] ** 2) / 2)
    assert logits[0].tolist() == pytest.approx([h2[0] / r2, h2[1] / r2, (h2[0] + h2[1]) / r2], abs=1e-14)


def test_gqa_groups_consecutive_query_heads() -> None:
    # Query head h reads KV head h // (H / K). Swapping KV heads 0 and 1 together with query-head blocks {0, 1} and
    # {2, 3} (and o_proj's columns) is then a relabelling and leaves the logits unchanged; the interleaved mapping
    # h % K would not see it as one.
    H, K, d = V4["num_attention_heads"], V4["num_key_value_heads"], V4["head_dim"]
    q_perm, kv_perm = [2, 3, 0, 1], [1, 0]
    w = dict(W)
    for i in range(V4["num_hidden_layers"]):
        p = f"model.layers.layers.{i}.mixer."
        qkv = W[p + "qkv_proj.weight"]
        q, k, v = qkv[: H * d].reshape(H, d, -1), qkv[H * d : (H + K) * d].reshape(K, d, -1), qkv[(H + K) * d :]
        v = v.reshape(K, d, -1)
        w[p + "qkv_proj.weight"] = torch.cat(
            (q[q_perm].flatten(0, 1), k[kv_perm].flatten(0, 1), v[kv_perm].flatten(0, 1))
        )
        o = W[p + "o_proj.weight"].reshape(-1, H, d)
        w[p + "o_proj.weight"] = o[:, q_perm].flatten(1)
    torch.testing.assert_close(
        p3.independent_logits(V4, w, IDS, "vllm"), p3.independent_logits(V4, W, IDS, "vllm"), rtol=0, atol=1e-12
    )


def test_untied_head_and_its_padding_rows() -> None:
    V = V4["vocab_size"]
    w = random_weights(V4, untied_rows=-(-V // 16) * 16)  # the HF code rounds an untied head up to 16 rows
    untied = {**V4, "tie_word_embeddings": False}
    logits = p3.independent_logits(untied, w, IDS, "vllm")
    assert logits.shape == (len(IDS), V)
    exact = dict(w, **{"lm_head.weight": w["lm_head.weight"][:V]})
    assert torch.equal(logits, p3.independent_logits(untied, exact, IDS, "vllm"))
    # tied: lm_head.weight, if present, is ignored (vLLM skips lm_head.* when tie_word_embeddings)
    without_head = {k: v for k, v in w.items() if k != "lm_head.weight"}
    assert torch.equal(p3.independent_logits(V4, w, IDS, "vllm"), p3.independent_logits(V4, without_head, IDS, "vllm"))
    with pytest.raises(KeyError, match="lm_head"):
        p3.independent_logits(untied, W, IDS, "vllm")


def test_scale_embedding_scales_the_input_not_the_tied_head() -> None:
    D = V4["hidden_size"]
    scaled = p3.independent_logits({**V4, "scale_embedding": True}, W, IDS, "vllm")
    manual = dict(
        W,
        **{
            "model.embed_tokens.weight": W["model.embed_tokens.weight"] * math.sqrt(D),
            "lm_head.weight": W["model.embed_tokens.weight"],
        },
    )
    torch.testing.assert_close(
        scaled, p3.independent_logits({**V4, "tie_word_embeddings": False}, manual, IDS, "vllm"), rtol=0, atol=1e-12
    )


def test_wrong_shapes_and_missing_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        p3.independent_logits(V4, dict(W, **{"model.norm.weight": torch.zeros(3)}), IDS, "vllm")
    with pytest.raises(KeyError, match="q_norm"):
        p3.independent_logits(V4, {k: v for k, v in W.items() if "0.mixer.q_norm" not in k}, IDS, "vllm")
    with pytest.raises(ValueError, match="ids"):
        p3.independent_logits(V4, W, [V4["vocab_size"]], "vllm")


# ----------------------------------------------------------------------------------------------------------------
# opt-in: vLLM 0.26.0 itself
# ----------------------------------------------------------------------------------------------------------------

VLLM_VENV = Path(os.environ.get("PLAMO2_VLLM_VENV", Path.home() / ".cache" / "plamo2-tools" / "vllm-0.26.0"))
VLLM_READY = (VLLM_VENV / ".plamo2-vllm-ready").is_file() and (VLLM_VENV / "bin" / "python").exists()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_READY, reason=f"no vLLM 0.26.0 venv at {VLLM_VENV} (bench/vllm_compat.sh --install-only)")
def test_vllm_plamo3_forward_matches_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "plamo3_forward.json"
    proc = subprocess.run(
        [
            str(VLLM_VENV / "bin" / "python"),
            str(REPO / "bench" / "plamo3_vllm_forward.py"),
            "--out",
            str(out),
            "--flex",
            "eager",
            "--parallel",
            "4x1,1x4",
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), f"no result (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["vllm_version"] == "0.26.0"
    assert report["summary"]["fail"] == 0, proc.stdout
    for case in report["cases"]:
        lg = case["logits"]
        assert lg["max_abs_diff_vs_oracle_vllm"] <= 2e-4, case["case"]
        assert lg["max_abs_diff_vs_oracle_hf_before_window"] <= 2e-4, case["case"]
        assert lg["max_abs_diff_vs_oracle_hf_from_window"] > 1e-2, case["case"]
        assert not case["state"]["mismatches"], case["case"]
    assert proc.returncode == 0, proc.stdout
