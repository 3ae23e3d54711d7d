"""PLaMo 3's synth presets: the real geometries as far as they are public, and tiny ones that make
bugs visible (docs/plamo3.md §7).

pfnet/plamo-3-nict-8b-base: 32 layers (28 sliding + 4 full, pattern 8) and vocabulary 107,520 are
published; hidden 4096, 32 q / 4 KV heads of 128 and intermediate 16,384 are derived from its exact
parameter count (8,091,348,992, tied).  plamo-3-nict-2b-base: 24 layers, 4 KV heads of 128, window
2048, 4096 positions and hidden 2560 are published; its 20 q heads (2560 / 128) and intermediate
10,240 are inferred.  The window of the 8B and every RoPE base are the config class's defaults
where no public config says otherwise.
"""

from __future__ import annotations

from typing import Any

_8B: dict[str, Any] = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=16384,
    vocab_size=107520,
    window_size=2048,
    sliding_window_pattern=8,
    max_position_embeddings=4096,
    rope_theta=150000.0,
    rope_local_theta=10000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
_2B: dict[str, Any] = dict(
    _8B,
    hidden_size=2560,
    num_hidden_layers=24,
    num_attention_heads=20,
    num_key_value_heads=4,
    intermediate_size=10240,
)

# The tiny presets together cover: both layer types with W smaller than the test prompts, a
# full-attention base far from the sliding one (applying the wrong one shows), GQA with K < TP
# (KV replication), MQA, head_dim * heads != hidden, an untied head with a vocabulary that is not
# a multiple of 16 (vLLM's extra head rows), YaRN, and the transformers-v5 config form.
PRESETS: dict[str, dict[str, Any]] = {
    "plamo-3-2b": _2B,
    "plamo-3-8b": _8B,
    "tiny3": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=700,
        window_size=5,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_theta=10.0,
        max_position_embeddings=512,
        torch_dtype="float32",
    ),
    "tiny3-mqa": dict(
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=80,
        vocab_size=515,
        window_size=6,
        sliding_window_pattern=3,
        tie_word_embeddings=False,
        rope_theta=5e5,
        rope_local_theta=100.0,
        max_position_embeddings=512,
        torch_dtype="float32",
    ),
    "tiny3-yarn": dict(
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=333,
        sliding_window_pattern=2,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        torch_dtype="float32",
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        window_size=4,
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    ),
}
TINY_PRESETS = ("tiny3", "tiny3-mqa", "tiny3-yarn")
