"""What a family looks like as a GGUF file for llama.cpp (docs/export.md, "GGUF"), model-independent.

llama.cpp's converter (`convert_hf_to_gguf.py`, one class per architecture in its `conversion/`
folder) is the specification: each family's `model/<family>/gguf.py` declares, like that class, the
llama.cpp architecture name, the GGUF name of every row of the family's tensor table, the
metadata calls the converter makes (as `gguf.GGUFWriter` method names with their arguments, in the
converter's order) and what a llama.cpp run of that architecture does differently from the
reference.  The value transforms are the family table's own (norm offsets, A = -exp(A_log)):
llama.cpp folds the same constants; the vLLM layout transforms (vocab padding, PLaMo 2's in_proj
regrouping) do not apply, GGUF keeps the Hugging Face layout.

Nothing here imports the `gguf` package: the family modules stay data, `export/gguf.py` turns them
into a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .layout import TensorKind, Transform

# The family table's transforms GGUF keeps; the others (pad_vocab, regroup_in_proj, cast, fill)
# are vLLM's layout, which llama.cpp does not use.
GGUF_VALUE_TRANSFORMS = ("add_offset", "neg_exp_f32")

WriterCall = tuple[str, tuple[Any, ...]]  # (GGUFWriter method, arguments)


@dataclass(frozen=True)
class GGUFTensor:
    """One row of a family's table as llama.cpp names it."""

    hf: str  # the table row's `hf` name (layer rows relative to the layer prefix)
    name: str  # llama.cpp's name; layer rows without their "blk.{i}." prefix
    squeeze: bool = False  # drop the size-1 dims (PLaMo 2's conv1d [I, 1, K] -> [I, K])


@dataclass(frozen=True)
class RuntimeNote:
    """Something a llama.cpp run of this architecture does differently from the reference, for a
    given config: what (one line for the report) and the kind of fact it concerns."""

    fact: str  # "rope", "window", "eot", "bos", "yarn", "vocab", ...
    text: str
    diverges: bool = True  # False: a note that changes nothing the logits show (e.g. a stop token)


@dataclass(frozen=True)
class GGUFArch:
    """A family's GGUF facts (one instance per family, in `model/<family>/gguf.py`)."""

    arch: str  # llama.cpp's architecture name (general.architecture)
    tensors: tuple[GGUFTensor, ...]
    # config, raw config.json -> the converter's `set_gguf_parameters` calls, in its order
    metadata: Callable[[Any, dict[str, Any]], list[WriterCall]]
    # config -> what llama.cpp gets wrong for it (the metadata lint's static part)
    runtime_notes: Callable[[Any], list[RuntimeNote]]
    # named --tensor-type sets (documented recipes), pattern -> type
    recipes: dict[str, dict[str, str]] = field(default_factory=dict)
    # GGUF names of tensors the converter always keeps in F32 (besides 1-D tensors, norms and
    # non-".weight" names, which is llama.cpp's generic rule)
    keep_f32: tuple[str, ...] = ()
    # writes the chat template from tokenizer_config.json / chat_template.jinja (PLaMo 3 does)
    chat_template: bool = False
    # runtime options of the family's reference forward that match llama.cpp's graph
    reference_options: dict[str, Any] = field(default_factory=dict)
    # config, raw config.json -> what the export writes differently from llama.cpp's converter, and
    # why (for the report)
    differences: Callable[[Any, dict[str, Any]], list[str]] = lambda cfg, raw: []

    def by_hf(self) -> dict[str, GGUFTensor]:
        return {t.hf: t for t in self.tensors}


def value_transforms(kind: TensorKind, cfg: Any) -> tuple[Transform, ...]:
    """The family table row's value transforms that the GGUF file carries (see the module doc)."""
    return tuple(t for t in kind.transforms(cfg) if t.name in GGUF_VALUE_TRANSFORMS)


def layer_name(prefix: str, index: int | None, name: str) -> str:
    """'blk.3.ssm_a' for a layer row, the name itself for a global one."""
    return name if index is None else f"{prefix.format(index)}{name}"


BLOCK_PREFIX = "blk.{}."


# ---- llama.cpp's converter reads config.json raw: the same lookups, so the same values -----------
def find_hparam(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` present in config.json (llama.cpp's `find_hparam`)."""
    return next((raw[k] for k in keys if k in raw), None)


ROPE_THETA_KEYS = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
LOCAL_ROPE_THETA_KEYS = (
    "local_rope_theta",
    "rope_local_theta",
    "rope_theta_local",
    "swa_rope_theta",
    "rope_local_base_freq",
)


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The converter's `TextModel.rope_parameters`: config.json's `rope_parameters` (or
    `rope_scaling`), with the flat keys mirrored into it when it is not keyed by layer type."""
    found = raw.get("rope_parameters", raw.get("rope_scaling")) or {}
    params = dict(found) if isinstance(found, dict) else {}
    if "full_attention" not in params and "sliding_attention" not in params:
        local = find_hparam(raw, LOCAL_ROPE_THETA_KEYS)
        theta = find_hparam(raw, ROPE_THETA_KEYS)
        if local is not None:
            params["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in params and theta is not None:
            params["rope_theta"] = theta
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
        for keys, name in (
            (("partial_rotary_factor", "rope_pct", "rope_percent"), "partial_rotary_factor"),
            (("original_max_position_embeddings",), "original_max_position_embeddings"),
        ):
            value = find_hparam(raw, keys)
            if name not in params and value is not None:
                params[name] = value
    return params
