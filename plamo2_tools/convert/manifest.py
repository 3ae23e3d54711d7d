"""The manifest `plamo2_shards.json` (shard-format.md): written last, its presence means the
conversion is complete.  Everything that reads shards (check, merge, reshard, the runtime) goes
through `load_manifest`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..config import Plamo2Config
from ..errors import CheckpointError
from .layout import Mapping, OutputTensor, Piece, Transform

MANIFEST_NAME = "plamo2_shards.json"
JOURNAL_NAME = ".plamo2_convert.journal.jsonl"
FORMAT = "plamo2-shards"
FORMAT_VERSION = 1


def file_name(rank: int, part: int) -> str:
    return f"model-rank-{rank}-part-{part}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in manifest")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """One output tensor as the manifest records it."""

    rank: int
    file: str
    tensor: OutputTensor
    sha256: str


@dataclass(frozen=True)
class Manifest:
    path: Path  # the shard directory
    raw: dict[str, Any]
    config: Plamo2Config
    mapping: Mapping
    entries: dict[int, dict[str, TensorEntry]]  # rank -> key -> entry

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.raw["files"]

    def rank_files(self, rank: int) -> list[str]:
        return self.raw["mapping"]["ranks"][rank]["files"]

    @property
    def source_tensors(self) -> dict[str, dict[str, Any]]:
        """HF name -> {dtype, shape} of the checkpoint the shards were made from."""
        return self.raw["source"]["tensors"]


def tensor_record(t: OutputTensor, file: str, sha256: str) -> dict[str, Any]:
    return {
        "file": file,
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "sha256": sha256,
        "source": t.source,
        "transforms": [str(x) for x in t.transforms],
        "pieces": [[p.source, p.dim, p.start, p.length] for p in t.pieces],
    }


def _parse_transform(text: str) -> Transform:
    if "(" not in text:
        return Transform(text)
    name, arg = text[:-1].split("(", 1)
    value: float | int | str = arg
    if name == "add_offset":
        value = float(arg)
    elif name == "pad_vocab":
        value = int(arg)
    return Transform(name, value)


def load_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        hint = " (an unfinished conversion: run convert again to resume)" if (directory / JOURNAL_NAME).exists() else ""
        raise CheckpointError(f"{directory}: no {MANIFEST_NAME}: not a complete plamo2-tools shard directory{hint}")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a {FORMAT} manifest")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {raw.get('format_version')} is not supported (this is {__version__}, "
                f"format {FORMAT_VERSION})"
            )
        config = Plamo2Config.from_file(directory / "config.json")
        m = raw["mapping"]
        mapping = Mapping(m["tp_size"], m["pp_size"], tuple(tuple(s) for s in m["stages"]))
        entries: dict[int, dict[str, TensorEntry]] = {}
        for rank_str, tensors in raw["tensors"].items():
            rank = int(rank_str)
            entries[rank] = {}
            for key, rec in tensors.items():
                t = OutputTensor(
                    key=key,
                    source=rec["source"],
                    shape=tuple(rec["shape"]),
                    dtype=parse_dtype(rec["dtype"]),
                    pieces=tuple(Piece(*p) for p in rec["pieces"]),
                    transforms=tuple(_parse_transform(x) for x in rec["transforms"]),
                )
                entries[rank][key] = TensorEntry(rank, rec["file"], t, rec["sha256"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    return Manifest(directory, raw, config, mapping, entries)
