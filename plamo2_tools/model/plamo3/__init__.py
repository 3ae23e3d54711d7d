"""PLaMo 3 (docs/plamo3.md): attention only, interleaved sliding-window and full layers with a
RoPE per layer type (YaRN on the full layers when configured), `Plamo3ForCausalLM`.  The family's
facts are its config (`config.py`), its table (`tensors.py`) and presets (`presets.py`); the
reference forward (`reference.py`) and rank forward (`layers.py`) load only when the model runs.

The sliding window is a real difference between implementations: PFN's HF modeling code lets a
query see itself and the W keys before it, vLLM (and llama.cpp, PFN's SGLang port) W keys in all.
The runtime option `window_convention` ("hf", the default, or "vllm"; `--option
window_convention=vllm`) selects one, for the reference and the runtime alike, so a user can
reproduce either's numbers exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...parallel import Mapping
from ..family import Family, RuntimeOption, Variant
from ..layout import block, layer_of
from ..plamo import FINAL_NORM_OFFSET, NORM_OFFSETS
from . import tensors as table
from .config import FULL, QK_NORM_OFFSET, Plamo3Config
from .gguf import GGUF
from .presets import PRESETS, TINY_PRESETS

WINDOW_CONVENTION = RuntimeOption(
    "window_convention",
    ("hf", "vllm"),
    "how many keys a sliding-window layer sees, hf (the query and W before it, PFN's modeling code) "
    "or vllm (W in all, as vLLM and llama.cpp)",
)


class Plamo3Family(Family):
    name = "plamo3"
    description = "PLaMo 3 (plamo-3-nict-2b/8b/31b-base)"
    model_types = ("plamo3",)
    architectures = ("Plamo3ForCausalLM",)
    config_class = Plamo3Config
    tensors = table.TENSORS
    extras = table.VLLM_EXTRAS
    gguf = GGUF
    fp8_quantized = table.FP8_QUANTIZED
    presets = PRESETS
    tiny_presets = TINY_PRESETS
    kind_names = {FULL: "full attention", "sliding_attention": "sliding-window attention"}
    runtime_options = (WINDOW_CONVENTION,)
    tokenizer_flavour = "plamo3"

    def variant(self, cfg: Plamo3Config) -> Variant:
        return Variant("plamo3", self.description)

    def summary(self, cfg: Plamo3Config) -> dict[str, Any]:
        return {
            "model_type": cfg.model_type,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "padded_vocab": cfg.padded_vocab,
            "lm_head_rows": None if cfg.tie_word_embeddings else cfg.lm_head_rows,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "window_size": cfg.window_size,
            "sliding_window_pattern": cfg.sliding_window_pattern,
            "full_attention_layers": [i for i in range(cfg.num_hidden_layers) if cfg.is_full(i)],
            "rope_theta": cfg.rope_full.theta,
            "rope_local_theta": cfg.rope_sliding.theta,
            "rope_scaling": cfg.rope_full.describe(),
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            "config_form": "transformers v5" if cfg.v5 else "transformers v4",
            "variant": self.variant(cfg).name,
            "torch_dtype": cfg.torch_dtype,
        }

    def describe(self, cfg: Plamo3Config) -> str:
        c = self.summary(cfg)
        head = "tied" if cfg.tie_word_embeddings else f"untied ({c['lm_head_rows']} padded head rows)"
        return (
            f"D={c['hidden_size']} L={c['num_hidden_layers']} H={c['num_attention_heads']} "
            f"K={c['num_key_value_heads']} d={c['head_dim']} F={c['intermediate_size']} V={c['vocab_size']} "
            f"(padded {c['padded_vocab']}) {head} window={c['window_size']} pattern={c['sliding_window_pattern']} "
            f"rope_theta={c['rope_theta']:g} ({c['rope_scaling']}) rope_local_theta={c['rope_local_theta']:g} "
            f"config={c['config_form']}"
        )

    def layer_map(self, cfg: Plamo3Config) -> list[dict[str, Any]]:
        """Per layer: its type, window (None = full causal) and RoPE base and scaling."""
        out = []
        for i, kind in enumerate(cfg.layer_types):
            rope = cfg.rope(i)
            window = None if cfg.is_full(i) else cfg.window_size
            scaling = rope.describe() if rope.is_yarn else None
            out.append({"index": i, "kind": kind, "window": window, "rope_base": rope.theta, "rope_scaling": scaling})
        return out

    def tp_problems(self, cfg: Plamo3Config, tp: int) -> list[str]:
        return table.tp_problems(cfg, tp)

    def tp_notes(self, cfg: Plamo3Config, tp: int) -> list[str]:
        return table.tp_notes(cfg, tp)

    def holds_globals(self, cfg: Plamo3Config, mapping: Mapping, stage: int) -> set[str]:
        """vLLM's Plamo3ForCausalLM builds the embedding, the final norm and the head on every PP
        stage; a tied head is the embedding, saved once as lm_head.weight (state_dict dedup)."""
        return {"norm", "head"} | (set() if cfg.tie_word_embeddings else {"embed"})

    def rank_sizes(self, cfg: Plamo3Config, tp: int, r: int) -> table.RankSizes:
        return table.rank_sizes(cfg, tp, r)

    def vocab_rows(self, cfg: Plamo3Config, tp: int, r: int, head: bool = False) -> tuple[int, int]:
        if head and not cfg.tie_word_embeddings:
            return r * (cfg.lm_head_rows // tp), cfg.lm_head_rows // tp
        return block(cfg.padded_vocab, tp, r)

    def norm_offset(self, cfg: Plamo3Config, name: str) -> float:
        rest = layer_of(name, self.layer_prefix)[1].removesuffix(".weight")
        if rest in ("mixer.q_norm", "mixer.k_norm"):
            return QK_NORM_OFFSET
        return NORM_OFFSETS.get(rest, FINAL_NORM_OFFSET)

    def mlx_layout(self) -> Any:
        from .mlx import LAYOUT

        return LAYOUT

    def reference_logits(
        self,
        ckpt: Any,
        sequences: Sequence[Sequence[int]],
        dtype: Any,
        device: Any = "cpu",
        window_convention: str = "hf",
        **options: Any,
    ) -> Any:
        from .reference import reference_logits

        return reference_logits(ckpt, sequences, dtype, device, window_convention)

    def rank_model(
        self, cfg: Plamo3Config, stage: tuple[int, int], weights: dict[str, Any], ops: Any, comm: Any, **options: Any
    ) -> Any:
        from .layers import build_rank_model

        return build_rank_model(self, cfg, stage, weights, ops, comm, **options)


FAMILY = Plamo3Family()
