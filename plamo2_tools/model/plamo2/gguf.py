"""PLaMo 2 as llama.cpp holds it (architecture `plamo2`; docs/export.md, "GGUF").

Checked against llama.cpp's own converter and graph as vendored in llama-cpp-python 0.3.36:
`conversion/plamo.py:Plamo2Model` (names, transforms, metadata), `src/models/plamo2.cpp` and
`src/llama-model.cpp` (what the runtime reads).  The tests convert the tiny presets with that
converter and compare every tensor and key.
"""

from __future__ import annotations

from typing import Any

from ..gguf import GGUFArch, GGUFTensor, RuntimeNote, WriterCall, rope_parameters
from .config import Plamo2Config

# The family table's HF names (model/plamo2/tensors.py) -> llama.cpp's.  Some names have no
# ".weight" suffix: llama.cpp's tensor map keys those HF names with the suffix included, and its
# loader asks for them that way (ssm_a, ssm_d, the three SSM norms, the two post norms).
TENSORS = (
    GGUFTensor("model.embed_tokens.weight", "token_embd.weight"),
    GGUFTensor("pre_mixer_norm.weight", "attn_norm.weight"),
    GGUFTensor("post_mixer_norm.weight", "post_attention_norm"),
    GGUFTensor("pre_mlp_norm.weight", "ffn_norm.weight"),
    GGUFTensor("post_mlp_norm.weight", "post_ffw_norm"),
    GGUFTensor("mlp.gate_up_proj.weight", "ffn_up.weight"),  # fused [gate; up], evaluated as SwiGLU
    GGUFTensor("mlp.down_proj.weight", "ffn_down.weight"),
    GGUFTensor("mixer.in_proj.weight", "ssm_in.weight"),  # HF's per-head [z_h; x_h] kept (the graph views it so)
    GGUFTensor("mixer.conv1d.weight", "ssm_conv1d.weight", squeeze=True),
    GGUFTensor("mixer.bcdt_proj.weight", "ssm_x.weight"),
    GGUFTensor("mixer.dt_proj.weight", "ssm_dt.weight"),
    GGUFTensor("mixer.dt_bias", "ssm_dt.bias"),
    GGUFTensor("mixer.A_log", "ssm_a"),  # A = -exp(A_log), the table's transform
    GGUFTensor("mixer.D", "ssm_d"),
    GGUFTensor("mixer.dt_norm_weight", "ssm_dt_norm"),
    GGUFTensor("mixer.B_norm_weight", "ssm_b_norm"),
    GGUFTensor("mixer.C_norm_weight", "ssm_c_norm"),
    GGUFTensor("mixer.out_proj.weight", "ssm_out.weight"),
    GGUFTensor("mixer.qkv_proj.weight", "attn_qkv.weight"),
    GGUFTensor("mixer.q_weight", "attn_q_norm.weight"),  # [Hq, d]: one norm per head
    GGUFTensor("mixer.k_weight", "attn_k_norm.weight"),
    GGUFTensor("mixer.o_proj.weight", "attn_output.weight"),
    GGUFTensor("model.norm.weight", "output_norm.weight"),
    GGUFTensor("lm_head.weight", "output.weight"),
)

# --tensor-type sets with a name (docs/export.md): PFN's known-good recipe keeps the Mamba output
# projection in F16 (pfnet/plamo-translate-cli's llama.cpp benchmark, 2026-10; a quantized ssm_out
# loops or drops content, llama.cpp#24501).
RECIPES = {"ssm-out-f16": {"ssm_out": "f16"}}


# llama.cpp sizes RoPE (n_rot) from layer 0's head count, and only when it is > 0
# (src/llama-model.cpp, `if (hparams.n_head() > 0)`); layer 0 of PLaMo 2 is a Mamba layer, to which the
# converter gives 0 heads, so n_rot = 0: llama.cpp b11318 ran every attention layer without RoPE, and
# llama-cpp-python 0.3.36's CPU kernels never finish a forward at all (measured: an endless loop).  Which
# layers are Mamba llama.cpp decides from head_count_kv alone (`is_recr = n_head_kv(i) == 0`), so we give
# layer 0 the attention head count in head_count and keep head_count_kv 0: n_rot is then the head size
# (key_length), RoPE is on, and the logits equal the reference up to the sliding window (tests/export).
ROPE_FIX = "plamo2.attention.head_count[0] = num_attention_heads (the converter writes 0: n_rot = 0)"


def metadata(cfg: Plamo2Config, raw: dict[str, Any]) -> list[WriterCall]:
    """`Plamo2Model.set_gguf_parameters`, call for call: it reads config.json raw, with its own
    defaults, so these do too; one value differs on purpose (ROPE_FIX)."""
    calls: list[WriterCall] = [("add_vocab_size", (raw["vocab_size"],))]
    if raw.get("mamba_enabled", True):
        kv = [0 if mamba else raw.get("num_key_value_heads", 4) for mamba in cfg.layer_is_mamba]
        q = [0 if mamba else raw.get("num_attention_heads", 32) for mamba in cfg.layer_is_mamba]
        if q and cfg.layer_is_mamba[0] and not all(cfg.layer_is_mamba):
            q[0] = raw.get("num_attention_heads", 32)  # ROPE_FIX: the one value that differs from the converter
        if kv and q:
            calls += [("add_head_count_kv", (kv,)), ("add_head_count", (q,))]
    head = raw.get("hidden_size_per_head", 128)
    calls += [
        ("add_context_length", (raw.get("max_position_embeddings", 2048),)),
        ("add_embedding_length", (raw.get("hidden_size", 4096),)),
        ("add_key_length", (head,)),
        ("add_value_length", (head,)),
        ("add_block_count", (cfg.num_hidden_layers,)),
        ("add_layer_norm_rms_eps", (raw.get("rms_norm_eps", 1e-06),)),
        ("add_rope_freq_base", (rope_parameters(raw).get("rope_theta", 10000),)),
        ("add_ssm_state_size", (raw.get("mamba_d_state", 64),)),
        ("add_ssm_conv_kernel", (raw.get("mamba_d_conv", 4),)),
        ("add_ssm_time_step_rank", (raw.get("mamba_num_heads", 64),)),
        ("add_ssm_inner_size", (raw.get("mamba_num_heads", 64) * head,)),
        ("add_ssm_group_count", (0,)),
        ("add_feed_forward_length", (raw.get("intermediate_size", 13312),)),
        ("add_file_type", ()),
    ]
    return calls


def runtime_notes(cfg: Plamo2Config) -> list[RuntimeNote]:
    """What llama.cpp's `plamo2` graph does differently from the reference for this config."""
    notes = []
    attention = [i for i, mamba in enumerate(cfg.layer_is_mamba) if not mamba]
    windowed = [i for i in attention if cfg.attention_window(i) is not None]
    if windowed:
        notes.append(
            RuntimeNote(
                "window",
                f"no sliding window: llama.cpp's plamo2 attends to every earlier "
                f"token in all attention layers; the reference's layers {windowed} see "
                f"{cfg.attention_window_size} keys before the query, so they differ from "
                f"position {cfg.attention_window_size + 1} on",
            )
        )
    bases = {cfg.rope_base(i) for i in attention}
    if len(bases) > 1 or (bases and bases != {cfg.rope_theta}):
        local = sorted({cfg.rope_base(i) for i in attention if cfg.rope_base(i) != cfg.rope_theta})
        notes.append(
            RuntimeNote(
                "rope",
                f"PLaMo 2.1's per-layer RoPE base is lost: llama.cpp uses rope_theta = "
                f"{cfg.rope_theta:g} in every attention layer, the sliding layers use {local} "
                "(GGUF's plamo2 has no key for it)",
            )
        )
    if not cfg.tie_word_embeddings and cfg.lm_head_rows != cfg.vocab_size:
        notes.append(
            RuntimeNote(
                "vocab",
                f"the untied head has {cfg.lm_head_rows} rows (HF rounds it up to a "
                f"multiple of 16) but llama.cpp expects {cfg.vocab_size}: the file does not "
                "load (real PLaMo 2 vocabularies are multiples of 16)",
            )
        )
    return notes


def differences(cfg: Plamo2Config, raw: dict[str, Any]) -> list[str]:
    return [ROPE_FIX] if cfg.layer_is_mamba[0] and not all(cfg.layer_is_mamba) else []


GGUF = GGUFArch(
    arch="plamo2",
    differences=differences,
    tensors=TENSORS,
    metadata=metadata,
    runtime_notes=runtime_notes,
    recipes=RECIPES,
    keep_f32=("ssm_conv1d.weight",),
)
