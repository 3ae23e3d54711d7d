"""PLaMo 2's synth presets: real geometries (for benchmarks) and tiny ones that make bugs visible.

Raw config.json values; `plamo2-tools synth --preset NAME` writes a random checkpoint of any of them
(model/synth.py).  Where a real config is not public, docs/research/plamo2-configs.json says what is
confirmed, derived or inferred.
"""

from __future__ import annotations

from typing import Any

_1B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=1,
    hidden_size_per_head=128,
    mamba_d_state=64,
    mamba_d_conv=4,
    mamba_num_heads=32,
    mamba_step=2,
    intermediate_size=8192,
    vocab_size=100000,
    attention_window_size=2048,
    torch_dtype="float32",
)
_8B: dict[str, Any] = dict(
    _1B,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=4,
    mamba_num_heads=64,
    intermediate_size=16384,
    torch_dtype="bfloat16",
)

# PLaMo 2.1 (docs/research/plamo2-configs.json): the 2B geometry is mlx-vlm's plamo2vl text-config
# defaults (32 x 2048 confirmed by llama.cpp's size table); the 8B one is plamo-2-8b's plus the
# 2.1 keys.  Neither config.json is public: full_attention_idx and rope_local_theta are the port's
# defaults, which only matter for values, not shapes.
_2_1_2B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=4,
    hidden_size_per_head=128,
    mamba_d_state=64,
    mamba_d_conv=4,
    mamba_num_heads=64,
    mamba_step=2,
    intermediate_size=5632,
    vocab_size=100032,
    attention_window_size=32768,
    rope_theta=1e6,
    rope_local_theta=1e6,
    torch_dtype="bfloat16",
)
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
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        hidden_size_per_head=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_num_heads=8,
        mamba_step=2,
        intermediate_size=96,
        vocab_size=1000,
        attention_window_size=12,
    ),
    "tiny-gqa": dict(
        hidden_size=96,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size_per_head=16,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_num_heads=16,
        mamba_step=3,
        intermediate_size=160,
        vocab_size=515,
        attention_window_size=10,
        full_attention_idx=[4],
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "plamo-2.1-2b": _2_1_2B,
    "plamo-2.1-8b": _2_1_8B,
    # PLaMo 2.1 in small: attention layers 1, 3, 5; layer 3 full attention with rope_theta, the
    # others windowed with a very different rope_local_theta (the mlx-vlm comparison).
    "tiny-2.1": dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size_per_head=16,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_num_heads=8,
        mamba_step=2,
        intermediate_size=112,
        vocab_size=700,
        attention_window_size=9,
        full_attention_idx=[3],
        rope_theta=1e6,
        rope_local_theta=10.0,
    ),
    "tiny-edge": dict(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size_per_head=8,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_num_heads=4,
        mamba_step=5,
        intermediate_size=40,
        vocab_size=300,
        attention_window_size=6,
        tie_word_embeddings=False,
    ),
}
TINY_PRESETS = ("tiny", "tiny-gqa", "tiny-edge", "tiny-2.1")
