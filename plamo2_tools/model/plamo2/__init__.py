"""PLaMo 2 (docs/model.md): hybrid Mamba2 + attention, `Plamo2ForCausalLM`; PLaMo 2.1 is a variant
(a RoPE base per layer).  The family's facts are its config (`config.py`), its table
(`tensors.py`) and its presets (`presets.py`); its reference forward (`reference.py`) and rank
forward (`layers.py`) are imported only when a command runs the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..family import Family, Variant
from ..layout import kind_of, layer_of
from ..plamo import FINAL_NORM_OFFSET, NORM_OFFSETS
from . import tensors as table
from .config import Plamo2Config
from .gguf import GGUF
from .presets import PRESETS, TINY_PRESETS

PLAMO2_1 = Variant(
    "plamo2.1",
    "PLaMo 2.1 (plamo-2.1-2b-cpt, plamo-2.1-8b-cpt, the language model of plamo-2.1-*-vl): RoPE base per layer, "
    "rope_theta on full_attention_idx layers, rope_local_theta on the others",
)


class Plamo2Family(Family):
    name = "plamo2"
    description = "PLaMo 2 (plamo-2-1b, plamo-2-8b, plamo-2-translate)"
    model_types = ("plamo2", "plamo")
    architectures = ("Plamo2ForCausalLM",)
    config_class = Plamo2Config
    tensors = table.TENSORS
    extras = table.VLLM_EXTRAS
    gguf = GGUF
    fp8_quantized = table.FP8_QUANTIZED
    fp8_kept = table.FP8_KEPT
    presets = PRESETS
    tiny_presets = TINY_PRESETS
    kind_names = {"mamba": "Mamba", "attention": "attention"}

    def variant(self, cfg: Plamo2Config) -> Variant:
        return PLAMO2_1 if cfg.rope_local_theta is not None else Variant(self.name, self.description)

    def preset_raw(self, name: str) -> dict[str, Any]:
        raw = super().preset_raw(name)
        raw.setdefault("attention_window_size", 2048)
        raw["sliding_window"] = raw["attention_window_size"]  # the remote config writes it "for vLLM"
        return raw

    def summary(self, cfg: Plamo2Config) -> dict[str, Any]:
        return {
            "model_type": cfg.model_type,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "hidden_size_per_head": cfg.hidden_size_per_head,
            "mamba_num_heads": cfg.mamba_num_heads,
            "mamba_d_state": cfg.mamba_d_state,
            "mamba_d_conv": cfg.mamba_d_conv,
            "mamba_step": cfg.mamba_step,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "padded_vocab": cfg.padded_vocab,
            "mamba_inner": cfg.mamba_inner,
            "dt_rank": cfg.dt_rank,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "rope_theta": cfg.rope_theta,
            "rope_local_theta": cfg.rope_local_theta,
            "variant": self.variant(cfg).name,
            "attention_window_size": cfg.attention_window_size,
            "full_attention_idx": list(cfg.full_attention_idx),
            "rms_norm_eps": cfg.rms_norm_eps,
            "torch_dtype": cfg.torch_dtype,
        }

    def describe(self, cfg: Plamo2Config) -> str:
        c = self.summary(cfg)
        return (
            f"D={c['hidden_size']} L={c['num_hidden_layers']} Hq={c['num_attention_heads']} "
            f"Hkv={c['num_key_value_heads']} d={c['hidden_size_per_head']} Hm={c['mamba_num_heads']} "
            f"N={c['mamba_d_state']} K={c['mamba_d_conv']} F={c['intermediate_size']} V={c['vocab_size']} "
            f"(padded {c['padded_vocab']}) I={c['mamba_inner']} R={c['dt_rank']} tied={c['tie_word_embeddings']} "
            f"rope_theta={c['rope_theta']:g} window={c['attention_window_size']} variant={c['variant']}"
        )

    def layer_map(self, cfg: Plamo2Config) -> list[dict[str, Any]]:
        """Per layer: Mamba or attention, and for attention its window (None = full) and RoPE base."""
        return [
            {"index": i, "kind": kind}
            if kind == "mamba"
            else {"index": i, "kind": kind, "window": cfg.attention_window(i), "rope_base": cfg.rope_base(i)}
            for i, kind in enumerate(cfg.layer_kinds)
        ]

    def tp_problems(self, cfg: Plamo2Config, tp: int) -> list[str]:
        return table.tp_problems(cfg, tp)

    def tp_notes(self, cfg: Plamo2Config, tp: int) -> list[str]:
        return table.tp_notes(cfg, tp)

    def accepted_shapes(self, cfg: Plamo2Config, name: str) -> tuple[tuple[int, ...], ...]:
        """An untied lm_head may also hold exactly `vocab_size` rows (HF's remote code rounds up to
        16; other exports do not).  Rows beyond V are never used, so both convert to the same shards."""
        shape = kind_of(self, name).shape(cfg)
        if name == self.head_name:
            return (shape, (cfg.vocab_size, cfg.hidden_size))
        return (shape,)

    def rank_sizes(self, cfg: Plamo2Config, tp: int, r: int) -> table.RankSizes:
        return table.rank_sizes(cfg, tp, r)

    def norm_offset(self, cfg: Plamo2Config, name: str) -> float:
        norm = layer_of(name, self.layer_prefix)[1].removesuffix(".weight")
        return NORM_OFFSETS.get(norm, FINAL_NORM_OFFSET)

    def mlx_layout(self) -> Any:
        from .mlx import LAYOUT

        return LAYOUT

    def reference_logits(
        self, ckpt: Any, sequences: Sequence[Sequence[int]], dtype: Any, device: Any = "cpu", **options: Any
    ) -> Any:
        from .reference import reference_logits

        return reference_logits(ckpt, sequences, dtype, device)

    def rank_model(
        self, cfg: Plamo2Config, stage: tuple[int, int], weights: dict[str, Any], ops: Any, comm: Any, **options: Any
    ) -> Any:
        from .layers import build_rank_model

        return build_rank_model(self, cfg, stage, weights, ops, comm, **options)


FAMILY = Plamo2Family()
