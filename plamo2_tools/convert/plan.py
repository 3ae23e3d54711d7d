"""The conversion plan: every output file, its header and the byte offset of every tensor, worked
out from the source headers and config alone before a single payload byte is written."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..dtypes import FLOAT_DTYPES, DType, dtype_name
from ..errors import UserError, os_error
from ..model import family_of, hf_tensor_shapes
from ..model.layout import CONSTANT, OutputTensor, make_mapping, rank_tensors
from ..parallel import Mapping
from ..safetensors_io import FileLayout, plan_file
from ..shards.manifest import FORMAT_VERSION, file_metadata, file_name
from ..version import __version__
from .sources import Source

OUT_DTYPES: dict[str, DType | None] = {"auto": None, **FLOAT_DTYPES}
DEFAULT_MAX_PART_SIZE = 5 * 2**30


@dataclass(frozen=True)
class FilePlan:
    name: str
    rank: int
    part: int
    tensors: tuple[OutputTensor, ...]
    layout: FileLayout


@dataclass(frozen=True)
class Plan:
    mapping: Mapping
    out_dtype: DType | None
    max_part_size: int
    files: tuple[FilePlan, ...]
    fingerprint: str

    @property
    def units(self) -> list[list[FilePlan]]:
        """Files written together: the TP ranks of one (PP stage, part), in stage order, so a
        stage's files are finished (and survive an interruption) before the next stage starts."""
        groups: dict[tuple[int, int], list[FilePlan]] = {}
        for f in self.files:
            groups.setdefault((self.mapping.ranks(f.rank)[1], f.part), []).append(f)
        return [groups[k] for k in sorted(groups)]

    @property
    def total_bytes(self) -> int:
        return sum(f.layout.size for f in self.files)

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for f in self.files for t in f.tensors)

    def rank_files(self, rank: int) -> list[str]:
        return [f.name for f in self.files if f.rank == rank]


MAX_SIZE = 2**50  # 1 PiB: any larger --max-part-size is a typo


def parse_size(text: str) -> int:
    """'5GiB', '500MB', '1e9', '4096' -> bytes."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    try:
        scaled = float(number) * units[s[len(number) :]]
    except (ValueError, KeyError):
        raise UserError(f"cannot read size {text!r} (examples: 5GiB, 500MB, 1000000)") from None
    # "inf", "nan" and 1e400 read as floats but are no size (int() of them raised a bug exit).
    if not math.isfinite(scaled) or scaled > MAX_SIZE:
        raise UserError(f"size {text!r} must be a finite number of bytes, at most {MAX_SIZE} (1 PiB)")
    value = int(scaled)
    if value <= 0:
        raise UserError(f"size {text!r} must be positive")
    return value


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


SizedT = TypeVar("SizedT", bound=_Sized)


def split_parts(tensors: list[SizedT], max_part_size: int) -> list[list[SizedT]]:
    """Greedy in key order, like vLLM's save_sharded_state (also export mlx's files)."""
    parts: list[list[SizedT]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.nbytes > max_part_size:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return parts


def fingerprint(source: Source, mapping: Mapping, out_dtype: DType | None, max_part_size: int) -> str:
    """Identifies (input, options, tool version): resume and 'already done' compare it."""
    inputs = []
    for path in source.input_files() + [source.path / "config.json"]:
        try:
            st = path.stat()
        except OSError as e:  # a file the source lists is gone: the user's to fix, not a crash
            raise os_error(e, f"{path}: cannot read an input file") from None
        inputs.append([path.name, st.st_size, st.st_mtime_ns])
    key = {
        "version": __version__,
        "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "config_sha256": hashlib.sha256((source.path / "config.json").read_bytes()).hexdigest(),
        "tp": mapping.tp,
        "pp": mapping.pp,
        "stages": mapping.stages,
        "dtype": dtype_name(out_dtype) if out_dtype else "auto",
        "max_part_size": max_part_size,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def canonical_order(cfg: Any) -> dict[str, int]:
    """HF tensor name -> position in the model's own order (embedding, layers, norm, head).

    Sources are streamed and output files laid out in this order, which does not depend on how
    the source checkpoint happens to be split into files."""
    order = {name: i for i, name in enumerate(hf_tensor_shapes(cfg))}
    order[CONSTANT] = len(order)  # a family's constants (vLLM's scale buffers, `Family.extras`) come last
    return order


def make_plan(
    source: Source,
    tp: int,
    pp: int,
    pp_layers: list[int] | None = None,
    dtype: str = "auto",
    max_part_size: int = DEFAULT_MAX_PART_SIZE,
) -> Plan:
    if dtype not in OUT_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of: {', '.join(OUT_DTYPES)}")
    out_dtype = OUT_DTYPES[dtype]
    family = family_of(source.config)
    mapping = make_mapping(family, source.config, tp, pp, pp_layers)
    src_dtypes = {n: t.dtype for n, t in source.tensors.items()}
    order = canonical_order(source.config)
    files = []
    for rank in range(mapping.world_size):
        meta = file_metadata(mapping, rank)
        tensors = rank_tensors(family, source.config, src_dtypes, mapping, rank, out_dtype)
        for part, group in enumerate(split_parts(tensors, max_part_size)):
            # Laid out in the order the engine streams sources, so every file is written front to
            # back and hashed on the fly (see engine.stream_order).
            group = sorted(group, key=lambda t: order[t.source])
            layout = plan_file([(t.key, t.dtype, t.shape) for t in group], meta, keep_order=True)
            files.append(FilePlan(file_name(rank, part), rank, part, tuple(group), layout))
    return Plan(mapping, out_dtype, max_part_size, tuple(files), fingerprint(source, mapping, out_dtype, max_part_size))


def output_path_problems(source_path: Path, out: Path) -> list[str]:
    src, dst = source_path.resolve(), out.resolve()
    if src == dst:
        return [f"output {out} is the source directory; choose another one"]
    if src in dst.parents:
        return [f"output {out} is inside the source directory; choose another one"]
    return []
