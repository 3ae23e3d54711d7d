"""Lazy access to a Hugging Face PLaMo 2 checkpoint: one `model.safetensors` or an index over
several files.  Only headers are parsed up front; tensors (or row ranges of them) are read on
demand, so nothing ever holds the whole model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import Plamo2Config
from .errors import CheckpointError
from .safetensors_io import DTYPE_NAMES, SafetensorsFile, TensorInfo, read_header, read_rows

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpoint:
    """An HF checkpoint directory: config plus lazily read tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.config = Plamo2Config.from_file(self.path)
        self.files: list[SafetensorsFile] = []
        self.tensors: dict[str, TensorInfo] = {}
        self._file_of: dict[str, SafetensorsFile] = {}
        self._fds: dict[Path, int] = {}
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
            return [self.path / n for n in names]
        self._weight_map = None
        single = self.path / SINGLE_NAME
        if single.is_file():
            return [single]
        found = sorted(self.path.glob("*.safetensors"))
        if len(found) == 1:
            return found
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
        expected = self.config.hf_tensor_shapes()
        problems = [
            f"missing tensor {name} {list(shape)}" for name, shape in expected.items() if name not in self.tensors
        ]
        for name, info in self.tensors.items():
            if name not in expected:
                problems.append(f"unexpected tensor {name} {list(info.shape)}")
            elif info.shape != expected[name]:
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
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.tensors[name]
        path = self._file_of[name].path
        return read_rows(self._fd(path), info, start, stop, path)

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
    try:
        raw = json.loads(index.read_text())
        weight_map = raw["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
    return {str(k): str(v) for k, v in weight_map.items()}
