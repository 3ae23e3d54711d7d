"""PLaMo 3 as llama.cpp holds it (architecture `plamo3`; docs/export.md, "GGUF").

Checked against llama.cpp as vendored in llama-cpp-python 0.3.36: `conversion/plamo.py:Plamo3Model`
and the base class's `TextModel.set_gguf_parameters` (`conversion/base.py`: names, transforms,
metadata), `src/models/plamo3.cpp` and `src/llama-model.cpp` (what the runtime reads: a standard
sliding window of W keys counting the query, the SWA pattern, a second RoPE base for the sliding
layers, YaRN on the full layers' base).  The tests convert the tiny presets with that converter and
compare every tensor and key.
"""

from __future__ import annotations

from typing import Any

from ..gguf import GGUFArch, GGUFTensor, RuntimeNote, WriterCall, find_hparam, rope_parameters
from .config import FULL, YARN_BETA_FAST, YARN_BETA_SLOW, Plamo3Config

TENSORS = (
    GGUFTensor("model.embed_tokens.weight", "token_embd.weight"),
    GGUFTensor("pre_mixer_norm.weight", "attn_norm.weight"),
    GGUFTensor("post_mixer_norm.weight", "post_attention_norm"),
    GGUFTensor("pre_mlp_norm.weight", "ffn_norm.weight"),
    GGUFTensor("post_mlp_norm.weight", "post_ffw_norm"),
    GGUFTensor("mixer.qkv_proj.weight", "attn_qkv.weight"),  # fused [q heads | k heads | v heads]
    GGUFTensor("mixer.q_norm.weight", "attn_q_norm.weight"),  # one [d] vector shared by every head (+1)
    GGUFTensor("mixer.k_norm.weight", "attn_k_norm.weight"),
    GGUFTensor("mixer.o_proj.weight", "attn_output.weight"),
    GGUFTensor("mlp.gate_up_proj.weight", "ffn_up.weight"),  # fused [gate; up], evaluated as SwiGLU
    GGUFTensor("mlp.down_proj.weight", "ffn_down.weight"),
    GGUFTensor("model.norm.weight", "output_norm.weight"),
    GGUFTensor("lm_head.weight", "output.weight"),
)

_CTX_KEYS = ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length")
_FF_KEYS = ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner", "hidden_dim")


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The base class's RoPE parameters plus `Plamo3Model.__init__`'s mirror of the flat YaRN keys."""
    params = rope_parameters(raw)
    factor = raw.get("rope_scaling_factor", 1)
    if factor != 1 and "rope_type" not in params:
        params.update(
            {
                "rope_type": "yarn",
                "factor": float(factor),
                "original_max_position_embeddings": int(raw["initial_context_length"]),
                "beta_fast": YARN_BETA_FAST,
                "beta_slow": YARN_BETA_SLOW,
                "truncate": False,
            }
        )
    return params


def metadata(cfg: Plamo3Config, raw: dict[str, Any]) -> list[WriterCall]:
    """`TextModel.set_gguf_parameters` then `Plamo3Model.set_gguf_parameters`, call for call, from
    config.json raw (the converter reads it so; a key it does not find it does not write)."""
    calls: list[WriterCall] = [("add_block_count", (cfg.num_hidden_layers,))]
    for method, keys in (
        ("add_context_length", _CTX_KEYS),
        ("add_embedding_length", ("hidden_size", "n_embd", "dim")),
        ("add_feed_forward_length", _FF_KEYS),
        ("add_head_count", ("num_attention_heads", "n_head", "n_heads")),
        ("add_head_count_kv", ("num_key_value_heads", "n_kv_heads")),
    ):
        value = find_hparam(raw, keys)
        if value is not None:
            calls.append((method, (value,)))
    if raw.get("is_causal") is False:
        calls.append(("add_causal_attention", (False,)))
    params = _rope_parameters(raw)
    full = params.get("full_attention", params)
    if full.get("rope_type") == "yarn" and full.get("factor") is not None:
        calls += [
            ("add_rope_scaling_type", ("yarn",)),
            ("add_rope_scaling_factor", (full["factor"],)),
            ("add_rope_scaling_orig_ctx_len", (full["original_max_position_embeddings"],)),
        ]
        for key, method in (
            ("extrapolation_factor", "add_rope_scaling_yarn_ext_factor"),
            ("attention_factor", "add_rope_scaling_yarn_attn_factor"),
            ("beta_fast", "add_rope_scaling_yarn_beta_fast"),
            ("beta_slow", "add_rope_scaling_yarn_beta_slow"),
        ):
            value = full.get(key, full.get("attn_factor")) if key == "attention_factor" else full.get(key)
            if value is not None:
                calls.append((method, (value,)))
    if full.get("rope_theta") is not None:
        calls.append(("add_rope_freq_base", (full["rope_theta"],)))
    local = params.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        calls.append(("add_rope_freq_base_swa", (local,)))
    for method, keys in (
        ("add_layer_norm_rms_eps", ("rms_norm_eps", "norm_eps")),
        ("add_layer_norm_eps", ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
    ):
        value = find_hparam(raw, keys)
        if value is not None:
            calls.append((method, (value,)))
    if raw.get("head_dim") is not None:
        calls += [("add_key_length", (raw["head_dim"],)), ("add_value_length", (raw["head_dim"],))]
    calls += [("add_file_type", ()), ("add_vocab_size", (raw["vocab_size"],))]
    window = find_hparam(raw, ("window_size", "sliding_window"))
    if window is not None:
        calls += [("add_sliding_window", (window,)), ("add_sliding_window_pattern", (_swa_pattern(cfg, raw),))]
    return calls


def _pattern_types(cfg: Plamo3Config, pattern: int) -> tuple[str, ...]:
    """llama.cpp's `set_swa_pattern(n)`: every n-th layer dense, the others sliding."""
    return tuple(FULL if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers))


def _swa_pattern(cfg: Plamo3Config, raw: dict[str, Any]) -> int | list[bool]:
    """The converter's sliding_window_pattern (an int) when it says which layers slide; otherwise
    (a transformers-v5 config whose layer_types no period describes, or none at all, where the
    converter fails) the per-layer flags, which llama.cpp reads first (`load_swa_pattern`)."""
    pattern = raw.get("sliding_window_pattern")
    integer = isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0
    if integer and _pattern_types(cfg, pattern) == cfg.layer_types:
        return pattern
    return [t != FULL for t in cfg.layer_types]


def differences(cfg: Plamo3Config, raw: dict[str, Any]) -> list[str]:
    if find_hparam(raw, ("window_size", "sliding_window")) is not None and isinstance(_swa_pattern(cfg, raw), list):
        return [
            "plamo3.attention.sliding_window_pattern written per layer (layer_types follow no period; "
            "llama.cpp's converter writes the config's integer or fails)"
        ]
    return []


def runtime_notes(cfg: Plamo3Config) -> list[RuntimeNote]:
    """What llama.cpp's `plamo3` graph does differently from the reference for this config."""
    notes = []
    if FULL in cfg.layer_types and len(set(cfg.layer_types)) > 1:
        notes.append(
            RuntimeNote(
                "window",
                f"sliding layers see W = {cfg.window_size} keys counting the query "
                "(llama.cpp's standard SWA): vLLM's convention; PFN's HF code sees the query "
                f"and W before it, so the two differ from position {cfg.window_size} on",
                diverges=False,
            )
        )
    if cfg.rope_sliding.is_yarn:
        notes.append(
            RuntimeNote(
                "yarn",
                "YaRN on the sliding layers is not applied: llama.cpp scales only the full-attention layers' RoPE",
            )
        )
    if cfg.scale_embedding:
        notes.append(
            RuntimeNote(
                "embedding",
                "scale_embedding is not applied (llama.cpp's plamo3 does not scale the embedding by sqrt(hidden_size))",
            )
        )
    return notes


GGUF = GGUFArch(
    arch="plamo3",
    tensors=TENSORS,
    metadata=metadata,
    runtime_notes=runtime_notes,
    chat_template=True,
    differences=differences,
    reference_options={"window_convention": "vllm"},
)
