"""What a model family is to the rest of the package (docs/architecture.md, "Add a model family").

A family is one subclass of `Family`, living in its own folder `model/<family>/` and registered in
`model/registry.py`: its config class, its tensor table, its TP rules, its presets for `synth`, and
three things loaded only when used (so that commands that only move bytes never import them): the
reference forward, synth's initial values and the rank forward the runtime runs.  Everything
downstream (convert, shards, runtime, inspect, synth, eval) asks the registry for the family of a
config and then asks the family; nothing downstream names a family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .layout import TensorKind, kind_of

if TYPE_CHECKING:
    import torch

    from ..parallel import Mapping
    from .forward import Comm, RankModel
    from .gguf import GGUFArch


class ModelConfig(Protocol):
    """What every family's typed config provides (the rest is the family's own business)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int
    rms_norm_eps: float

    @property
    def padded_vocab(self) -> int: ...

    @property
    def layer_kinds(self) -> tuple[str, ...]: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Variant:
    """A member of a family that differs in behaviour, not in tensors (e.g. PLaMo 2.1)."""

    name: str
    description: str  # what differs from the family's base


@dataclass(frozen=True)
class RuntimeOption:
    """A choice a family's forward offers the user, as vLLM passes model-owned options through one
    dict: `--option NAME=VALUE` on every command that runs the model, `NAME=VALUE` in lm-eval's
    model args, `forward_options` in the library.  The family's reference and rank forwards get
    the value as the keyword `name`."""

    name: str
    choices: tuple[str, ...]  # the values it takes; the first is the default
    help: str  # one line: what it changes

    @property
    def default(self) -> str:
        return self.choices[0]

    def describe(self) -> str:
        """One line for `--help`: name, values, default and what it changes."""
        return f"{self.name}={'|'.join(self.choices)} (default {self.default}): {self.help}"


class Family:
    """The base every family subclasses; class attributes are the facts, methods the rules."""

    name: ClassVar[str]
    description: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json model_type values this family reads
    architectures: ClassVar[tuple[str, ...]]  # config.json architectures values (HF class names)
    config_class: ClassVar[type]  # from_dict(raw, source) -> config, to_dict()
    tensors: ClassVar[tuple[TensorKind, ...]]  # THE table (model/<family>/tensors.py)
    extras: ClassVar[tuple[TensorKind, ...]] = ()  # constants vLLM's state holds beyond the weights
    # FP8 exports (export/fp8.py): the layer linears (table `hf` names) quantized, and those a consumer builds
    # quantizable that stay in the source dtype (named in the checkpoint's `ignore` list).
    fp8_quantized: ClassVar[tuple[str, ...]] = ()
    fp8_kept: ClassVar[tuple[str, ...]] = ()
    presets: ClassVar[dict[str, dict[str, Any]]] = {}  # synth presets: raw config.json values
    tiny_presets: ClassVar[tuple[str, ...]] = ()  # the presets tests run every layout of
    layer_prefix: ClassVar[str] = "model.layers.layers.{}."
    embed_name: ClassVar[str] = "model.embed_tokens.weight"
    final_norm_name: ClassVar[str] = "model.norm.weight"
    head_name: ClassVar[str] = "lm_head.weight"
    # The tensor whose dtype is the activation dtype of a converted model (older manifests).
    activation_tensor: ClassVar[str] = "mlp.gate_up_proj.weight"
    runtime_options: ClassVar[tuple[RuntimeOption, ...]] = ()  # what `--option` may choose
    # Which PLaMo tokenizer its checkpoints carry when their tokenizer_config.json names no class
    # (tokenizer.FLAVOURS: "plamo2" or "plamo3"); synth writes this one.
    tokenizer_flavour: ClassVar[str] = "plamo2"
    # What the family is as a GGUF file for llama.cpp (model/<family>/gguf.py; None: no llama.cpp
    # architecture for it): names, metadata, what llama.cpp's graph does differently.
    gguf: ClassVar[GGUFArch | None] = None

    # ---- config --------------------------------------------------------------------------------
    def matches(self, raw: dict[str, Any]) -> bool:
        """Does this config.json belong to the family (model_type first, else architectures)?"""
        if "model_type" in raw:
            return raw["model_type"] in self.model_types
        archs = raw.get("architectures")
        return isinstance(archs, list) and any(a in self.architectures for a in archs)

    def config(self, raw: dict[str, Any], source: str = "config.json") -> Any:
        return self.config_class.from_dict(raw, source)  # type: ignore[attr-defined]

    def variant(self, cfg: Any) -> Variant:
        return Variant(self.name, self.description)

    def summary(self, cfg: Any) -> dict[str, Any]:
        """The config as `inspect` shows it: every key that matters, derived values included."""
        raise NotImplementedError

    def layer_map(self, cfg: Any) -> list[dict[str, Any]]:
        """Per layer, what `inspect` shows: its kind and (for attention) window and RoPE."""
        return [{"index": i, "kind": k} for i, k in enumerate(cfg.layer_kinds)]

    def describe(self, cfg: Any) -> str:
        """One line of geometry for `inspect`'s text output."""
        s = self.summary(cfg)
        return " ".join(f"{k}={v}" for k, v in s.items() if not isinstance(v, (list, dict)))

    # ---- layout --------------------------------------------------------------------------------
    def tp_problems(self, cfg: Any, tp: int) -> list[str]:
        """Why `tp` cannot split this model (empty when it can)."""
        raise NotImplementedError

    def tp_notes(self, cfg: Any, tp: int) -> list[str]:
        """Valid splits that deserve a word of warning."""
        return []

    def accepted_shapes(self, cfg: Any, name: str) -> tuple[tuple[int, ...], ...]:
        """Shapes a checkpoint may hold for `name` (the canonical one unless a family says more)."""
        return (kind_of(self, name).shape(cfg),)

    def holds_globals(self, cfg: Any, mapping: Mapping, stage: int) -> set[str]:
        """Which of "embed", "norm", "head" a PP stage holds.  vLLM's rule for PLaMo 2: the first
        stage the embedding, the last the final norm and head; with PP = 1 and tied embeddings
        vLLM's state_dict keeps only the lexicographically smaller alias, lm_head.weight."""
        first, last = stage == 0, stage == mapping.pp - 1
        out = set()
        if first and not (cfg.tie_word_embeddings and mapping.pp == 1):
            out.add("embed")
        if last:
            out |= {"norm", "head"}
        return out

    def rank_sizes(self, cfg: Any, tp: int, r: int) -> Any:
        """What one TP rank holds of each split dimension (the runtime allocates from these)."""
        raise NotImplementedError

    def vocab_rows(self, cfg: Any, tp: int, r: int, head: bool = False) -> tuple[int, int]:
        """(first row, rows) of the padded vocabulary on TP rank r (of the head when `head`)."""
        n = cfg.padded_vocab // tp
        return r * n, n

    # ---- loaded when used ------------------------------------------------------------------------
    def reference_logits(
        self,
        ckpt: Any,
        sequences: Sequence[Sequence[int]],
        dtype: torch.dtype,
        device: Any = "cpu",
        **options: Any,
    ) -> list[torch.Tensor]:
        """The float reference forward on the unsharded checkpoint: float32 CPU logits per sequence."""
        raise NotImplementedError

    def norm_offset(self, cfg: Any, name: str) -> float:
        """The offset a stored norm delta is added to (synth scales its random deltas by it)."""
        return 1.0

    def preset_raw(self, name: str) -> dict[str, Any]:
        """A synth preset as the config.json a real checkpoint of the family would carry."""
        return {"model_type": self.model_types[0], "architectures": [self.architectures[0]], **self.presets[name]}

    def rank_model(
        self, cfg: Any, stage: tuple[int, int], weights: dict[str, Any], ops: Any, comm: Comm, **options: Any
    ) -> RankModel:
        """One rank's forward over its stage's layers with its TP-sharded weights (the runtime's)."""
        raise NotImplementedError

    def mlx_layout(self) -> Any:
        """How mlx-lm holds this family (a `model.mlx.MLXLayout`, from `model/<family>/mlx.py`), or
        None when mlx-lm has no model for it (`export mlx` refuses then)."""
        return None

    def check_runtime_options(self, options: dict[str, Any]) -> dict[str, str]:
        """Every declared option with its value (the given one, else its default); an unknown
        option or value is one line (exit 2).  Values are strings (`--option KEY=VALUE`, lm-eval's
        model args); any other value is compared as its text."""
        from ..errors import UserError

        known = {o.name: o for o in self.runtime_options}
        for key, value in options.items():
            if key not in known:
                has = f" (it has {', '.join(known)})" if known else " (it has none)"
                raise UserError(f"{self.description}: no forward option {key!r}{has}")
            if str(value) not in known[key].choices:
                raise UserError(f"{key} {str(value)!r} is not one of {', '.join(known[key].choices)}")
        return {name: str(options.get(name, o.default)) for name, o in known.items()}

    def __repr__(self) -> str:
        return f"<family {self.name}>"
