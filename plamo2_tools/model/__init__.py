"""The model's home (docs/model.md, docs/architecture.md): the registry of model families, the
layout engine that turns a family's tensor table into per-rank tensors, the HF checkpoint
reader/writer, the float64 operation oracles, synthetic checkpoints, and one folder per family
(`plamo2/`).  Nothing here imports the converter, the shard format or the runtime."""

from .family import Family, ModelConfig, RuntimeOption, Variant
from .registry import (
    FAMILIES,
    config_from_dict,
    family_for,
    family_named,
    family_of,
    hf_tensor_shapes,
    load_config,
    num_parameters,
    register,
)

__all__ = [
    "FAMILIES",
    "Family",
    "ModelConfig",
    "RuntimeOption",
    "Variant",
    "config_from_dict",
    "family_for",
    "family_named",
    "family_of",
    "hf_tensor_shapes",
    "load_config",
    "num_parameters",
    "register",
]
