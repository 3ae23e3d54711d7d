"""How a job's return value travels from torchrun rank 0 back to the parent process, without pickle.

Unpickling runs whatever code the file names, so the result is written as data only: tensors in a
safetensors file, everything else as JSON, each tensor's place in the JSON marked by its key in the
safetensors file.  What a job may return: None, bool, int, float, str, lists, tuples, dicts,
tensors, and dataclasses registered with `@result_type`, nested in any way.  Anything else (lm-eval
leaves numpy scalars and the odd object in its results) is stored as lm-eval stores it in its own
JSON files: numpy scalars as numbers, sets as lists, other objects as their str().

Layout, for a result path P: P.safetensors (the tensors; absent when there are none), then P (the
JSON), written last and by rename, so that P existing means the whole result is there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch is imported where a tensor is written or read: registering a type needs none
    import torch

T = TypeVar("T")
# "name" -> class, for dataclasses a job may return (`@result_type`).  An explicit list, so a result
# file can only ever construct these, never a class it names itself.
RESULT_TYPES: dict[str, type] = {}
# JSON objects with one of these keys stand for a value JSON has no type for; a plain dict never
# has a "$" key in the file (such a dict is written as "$items").
TENSOR, TUPLE, ITEMS, DATACLASS = "$tensor", "$tuple", "$items", "$dataclass"


def result_type(cls: type[T]) -> type[T]:
    """Class decorator: lets a job return instances of this dataclass through torchrun ranks."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__}: only dataclasses can travel as results")
    RESULT_TYPES[_type_name(cls)] = cls
    return cls


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def tensors_path(path: Path) -> Path:
    return path.with_name(path.name + ".safetensors")


def save_result(result: Any, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(result, tensors)
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, str(tensors_path(path)))
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(tree), encoding="utf-8")
    os.replace(partial, path)


def load_result(path: Path) -> Any:
    tree = json.loads(path.read_text(encoding="utf-8"))
    where = tensors_path(path)
    if not where.exists():
        return _decode(tree, {})
    from safetensors.torch import load_file

    return _decode(tree, load_file(str(where)))


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    torch = sys.modules.get("torch")  # not imported: nothing here can be a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        # clone: safetensors refuses tensors that share storage (views of one buffer)
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {TENSOR: key}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, tensors) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {ITEMS: [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = _type_name(type(value))
        if RESULT_TYPES.get(name) is not type(value):
            raise TypeError(f"{name} is not a registered result type (@result_type)")
        fields = {f.name: _encode(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}
        return {DATACLASS: name, "fields": fields}
    return _plain(value)


def _plain(value: Any) -> Any:
    """What lm-eval's handle_non_serializable makes of values JSON has no type for."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy scalar
        return value.item()
    if isinstance(value, (set, frozenset)):
        return [_plain(v) if not isinstance(v, (bool, int, float, str)) else v for v in value]
    return str(value)


def _decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [_decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if TENSOR in tree:
        return tensors[tree[TENSOR]]
    if TUPLE in tree:
        return tuple(_decode(v, tensors) for v in tree[TUPLE])
    if ITEMS in tree:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in tree[ITEMS]}
    if DATACLASS in tree:
        cls = RESULT_TYPES.get(tree[DATACLASS])
        if cls is None:
            raise TypeError(f"{tree[DATACLASS]} is not a registered result type (@result_type)")
        return cls(**{k: _decode(v, tensors) for k, v in tree["fields"].items()})
    return {k: _decode(v, tensors) for k, v in tree.items()}
