"""Lazy access to a Hugging Face checkpoint of any registered family: one `model.safetensors` or an
index over several files.  Only headers are parsed up front; tensors (or row ranges of them) are read on
demand, so nothing ever holds the whole model."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import SAFETENSORS_NAMES as DTYPE_NAMES
from ..dtypes import as_dtype
from ..errors import CheckpointError
from ..jsonio import CONFIG_BYTES, read_json
from ..numerics import to_torch
from ..safe_files import ensure_inside_source, plain_name
from ..safetensors_io import (
    PartialFile,
    SafetensorsFile,
    TensorInfo,
    atomic_write_text,
    plan_file,
    read_array,
    read_header,
    tensor_bytes,
)
from .registry import family_of, hf_tensor_shapes, load_config

if TYPE_CHECKING:  # only the reference forward reads tensors as torch's (read_rows, get)
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpoint:
    """An HF checkpoint directory: config plus lazily read tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.config = load_config(self.path)
        self.family = family_of(self.config)
        self.files: list[SafetensorsFile] = []
        self.tensors: dict[str, TensorInfo] = {}
        self._file_of: dict[str, SafetensorsFile] = {}
        self._fds: dict[Path, int] = {}
        self._fds_lock = threading.Lock()  # convert reads rows from several threads
        for file in self._find_files():
            header = read_header(file)
            self.files.append(header)
            for name, info in header.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{file}: tensor {name!r} also appears in {self._file_of[name].path}")
                self.tensors[name] = info
                self._file_of[name] = header
        self._check_index()

    def _find_files(self) -> list[Path]:
        index = self.path / INDEX_NAME
        if index.exists():
            self._weight_map = _read_index(index)
            names = sorted(set(self._weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(f"{index}: refers to missing file(s): {', '.join(missing)}")
            return [ensure_inside_source(self.path, self.path / n) for n in names]
        self._weight_map = None
        single = self.path / SINGLE_NAME
        if single.is_file():
            return [ensure_inside_source(self.path, single)]
        found = sorted(self.path.glob("*.safetensors"))
        if len(found) == 1:
            return [ensure_inside_source(self.path, found[0])]
        raise CheckpointError(
            f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME}"
            + (f" (found {len(found)} .safetensors files and no index)" if found else "")
        )

    def _check_index(self) -> None:
        if self._weight_map is None:
            return
        problems = [
            f"{name} (index says {file})"
            for name, file in self._weight_map.items()
            if name not in self.tensors or self._file_of[name].path.name != file
        ]
        problems += [f"{name} (not in the index)" for name in self.tensors if name not in self._weight_map]
        if problems:
            raise CheckpointError(f"{self.path / INDEX_NAME} disagrees with the files: " + "; ".join(problems))

    # ---- inventory --------------------------------------------------------------------------
    def inventory_problems(self) -> list[str]:
        """Every missing, unexpected, misshapen or non-float tensor, one line each."""
        expected = hf_tensor_shapes(self.config)
        problems = [
            f"missing tensor {name} {list(shape)}" for name, shape in expected.items() if name not in self.tensors
        ]
        for name, info in self.tensors.items():
            if name not in expected:
                problems.append(f"unexpected tensor {name} {list(info.shape)}")
            elif info.shape not in self.family.accepted_shapes(self.config, name):
                problems.append(f"wrong shape for {name}: {list(info.shape)}, expected {list(expected[name])}")
            elif not info.dtype.is_floating_point:
                problems.append(f"wrong dtype for {name}: {DTYPE_NAMES[info.dtype]}, expected a float type")
        return problems

    def check_inventory(self) -> None:
        problems = self.inventory_problems()
        if problems:
            # Every problem, on one line (the CLI prints errors as one line each).
            head = f"{self.path}: the tensors do not match config.json ({len(problems)} problem(s)): "
            raise CheckpointError(head + "; ".join(problems))

    # ---- reading ----------------------------------------------------------------------------
    def file_of(self, name: str) -> SafetensorsFile:
        return self._file_of[name]

    def _fd(self, path: Path) -> int:
        with self._fds_lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def read_array(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as numpy (`DType.storage`; what convert reads)."""
        info = self.tensors[name]
        path = self._file_of[name].path
        return read_array(self._fd(path), info, start, stop, path)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as a torch tensor (imports torch)."""
        return to_torch(self.read_array(name, start, stop), self.tensors[name].dtype)

    def get(self, name: str) -> torch.Tensor:
        return self.read_rows(name, 0, self.tensors[name].rows).reshape(self.tensors[name].shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_index(index: Path) -> dict[str, str]:
    raw = read_json(index, CONFIG_BYTES)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)")
    # Its file names are opened: each must be a plain name in the checkpoint directory.
    return {str(k): plain_name(v, str(index)) for k, v in weight_map.items()}


# ---- writing ---------------------------------------------------------------------------------------
TensorSpec = tuple[Any, tuple[int, ...]]  # (dtype, shape)
# name -> (first row, rows) in order; rows: numpy already in the spec's dtype (`DType.storage`), or
# a torch tensor (synth's values), cast here.
Chunks = Callable[[str], Iterable[tuple[int, Any]]]


def hf_file_names(count: int) -> list[str]:
    """HF's names: model.safetensors, or model-0000i-of-0000n.safetensors with an index."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_hf_weights(
    out: Path,
    groups: list[list[str]],
    specs: dict[str, TensorSpec],
    chunks: Chunks,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write the weights of an HF checkpoint: one safetensors file per group of tensor names (and
    model.safetensors.index.json when there are several), each file complete or absent."""
    names = hf_file_names(len(groups))
    weight_map: dict[str, str] = {}
    total = 0
    for fname, group in zip(names, groups, strict=True):
        layout = plan_file([(n, *specs[n]) for n in group], {"format": "pt"})
        part = PartialFile(out / fname, layout)
        try:
            for name in group:
                row_bytes = layout.nbytes[name] // specs[name][1][0]
                for first, rows in chunks(name):
                    if not isinstance(rows, np.ndarray):
                        rows = rows.to(as_dtype(specs[name][0]).torch)
                    data = tensor_bytes(rows)
                    part.write_at(layout.offsets[name] + first * row_bytes, data)
                    if progress:
                        progress(len(data))
                weight_map[name] = fname
                total += layout.nbytes[name]
            part.commit()
        except BaseException:
            part.abort()
            raise
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")  # never through a planted link
    return names
