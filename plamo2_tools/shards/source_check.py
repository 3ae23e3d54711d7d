"""`plamo2-tools check SHARDS --source SRC`: every tensor of every rank re-derived from the source.

`check` alone compares the files with the manifest's own digests, which the writer computed from
what it wrote: a writer that copies the wrong bytes (the first window again, a short copy resumed at
the wrong offset) writes a directory that agrees with itself.  This check trusts nothing the writer
recorded about values: it reads the HF checkpoint with the `safetensors` library (not our streaming
reader), cuts each rank's tensors from it with the layout engine's pieces and transforms (the
layout is the model's definition, shared with `check`), and compares the bytes of every tensor
with the shard file's, read with `safetensors` too: bit for bit, except tensors made with exp
(PLaMo 2's A = -exp(A_log)), which no library rounds correctly: those within one unit in the last
place.  The first difference is named (rank, key,
first differing element); the scan goes on to count them all.

Memory: one source tensor and one shard tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import safetensors
import torch

from ..check_report import SourceComparison
from ..dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType, as_dtype
from ..errors import CheckpointError, UserError, os_error
from ..jsonio import CONFIG_BYTES, read_object
from ..kinds import SOURCE_CHECK_KIND, SOURCE_CHECK_SCHEMA_VERSION
from ..model import family_of
from ..model.layout import CONSTANT, OutputTensor, Piece, apply_transforms, rank_tensors
from ..safe_files import plain_name
from .manifest import Manifest, config_sha256, load_manifest

# The float dtypes a PLaMo checkpoint's tensors may have, by safetensors header code.
_SOURCE_DTYPES = {d.code: d for d in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16)}


class SourceCheckReport(SourceComparison):
    KIND, SCHEMA_VERSION = SOURCE_CHECK_KIND, SOURCE_CHECK_SCHEMA_VERSION


def source_files(src: Path) -> dict[str, Path]:
    """HF tensor name -> the file holding it, from the index (sharded checkpoints) or the one
    model.safetensors.  The index's file names are plain names (docs/security.md, rule 1)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_object(index, CONFIG_BYTES, "an HF index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no `weight_map` object: not an HF index")
        return {str(name): src / plain_name(file, f"{index}: weight_map") for name, file in weight_map.items()}
    single = src / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{src}: not an HF checkpoint (no model.safetensors or model.safetensors.index.json)")
    with ExitStack() as stack:
        return {name: single for name in open_source_file(single, stack).keys()}  # noqa: SIM118 (no __iter__)


def open_source_file(path: Path, stack: ExitStack) -> Any:
    """A source file opened by the safetensors library, or one line saying why it cannot be (a
    truncated file was the library's exception, exit 70, in the command meant for damage: issue 28)."""
    try:
        return stack.enter_context(safetensors.safe_open(str(path), "pt"))
    except OSError as e:
        raise os_error(e, f"{path}: cannot read") from None
    except Exception as e:  # noqa: BLE001 - the library's own word on a damaged file is the message
        raise CheckpointError(f"{path}: the safetensors library cannot read it ({e}): truncated or damaged") from None


class _Source:
    """The source checkpoint, opened once per file with the safetensors library."""

    def __init__(self, src: Path, stack: ExitStack) -> None:
        self.where = source_files(src)
        self._open = {p: open_source_file(p, stack) for p in set(self.where.values())}

    def dtypes(self) -> dict[str, DType]:
        out = {}
        for name, path in self.where.items():
            code = self._open[path].get_slice(name).get_dtype()
            if code not in _SOURCE_DTYPES:
                raise CheckpointError(f"{path}: {name} has dtype {code}, not a float dtype a PLaMo checkpoint uses")
            out[name] = _SOURCE_DTYPES[code]
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open[self.where[name]].get_slice(name).get_shape())

    def piece(self, p: Piece) -> torch.Tensor:
        if p.source not in self.where:
            raise CheckpointError(f"source tensor {p.source} is not in the checkpoint")
        sl = self._open[self.where[p.source]].get_slice(p.source)
        return sl[p.start : p.start + p.length] if p.dim == 0 else sl[:, p.start : p.start + p.length]


def expected_tensor(t: OutputTensor, source: _Source) -> torch.Tensor:
    """The tensor a rank must hold: its pieces cut from the source, transformed, concatenated along
    dim 0; zero pieces (vocab padding) are zeros whatever the transforms."""
    if t.source == CONSTANT:
        return apply_transforms(torch.empty(t.shape), t.transforms, t.dtype)
    parts = []
    for p in t.pieces:
        if p.source is None:
            parts.append(torch.zeros((p.length, *t.shape[1:]), dtype=as_dtype(t.dtype).torch))
        else:
            parts.append(apply_transforms(source.piece(p), t.transforms, t.dtype))
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


# Transforms whose result no library rounds correctly: exp differs by one unit in the last place
# between torch, numpy and libm builds, so a tensor made with one is compared within that much.
_NOT_CORRECTLY_ROUNDED = {"neg_exp_f32"}
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def allowed_ulps(t: OutputTensor) -> int:
    return 1 if any(x.name in _NOT_CORRECTLY_ROUNDED for x in t.transforms) else 0


def first_difference(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> str | None:
    """None when the bytes are equal (or, with `ulps`, every element within that many units in the
    last place), else where and how they first differ."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"is {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    if torch.equal(_raw(got), _raw(want)):
        return None
    as_int = _INT_OF[want.element_size()]
    # Same-sign floats of one width are ordered like their bit patterns: the integer distance is
    # the distance in units in the last place (a sign change is a huge distance, as it should be).
    a = got.contiguous().reshape(-1).view(as_int).long()
    b = want.contiguous().reshape(-1).view(as_int).long()
    bad = ((a - b).abs() > ulps).nonzero()
    if not len(bad):
        return None
    i = int(bad[0])
    index = [int(k) for k in torch.unravel_index(torch.tensor(i), want.shape)] if want.dim() else []
    return (
        f"differs from the source at element {index} (byte {i * want.element_size()}): "
        f"{got.reshape(-1)[i].item()!r} instead of {want.reshape(-1)[i].item()!r}"
    )


def _planned(m: Manifest, source: _Source) -> Iterator[tuple[int, OutputTensor]]:
    family = family_of(m.config)
    dtypes = source.dtypes()
    for rank in range(m.mapping.world_size):
        for t in rank_tensors(family, m.config, dtypes, m.mapping, rank, m.out_dtype):
            if t.source == CONSTANT and not m.format.has_constants:  # version 1 had no constants
                continue
            yield rank, t


def check_against_source(
    path: str | Path, src: str | Path, progress: Callable[[int], None] | None = None, stop_at: int | None = None
) -> SourceCheckReport:
    """Compare every tensor of every rank of the shard directory `path` with the tensor re-derived
    from the HF checkpoint `src`; `progress(nbytes)` after each tensor; stop after `stop_at`
    problems (None: scan everything)."""
    path, src = Path(path), Path(src)
    m = load_manifest(path)
    report = SourceCheckReport(path, src)
    if (src / "config.json").is_file() and config_sha256(src) != m.source.config_sha256:
        report.problems.append(f"{src}/config.json is not the config these shards were converted from")
    with ExitStack() as stack:
        source = _Source(src, stack)
        inventory = _inventory_problems(m, source)
        if inventory:  # another model: cutting its tensors by this layout would mean nothing
            report.problems += inventory
            return report
        shard_files: dict[str, Any] = {}
        for rank, t in _planned(m, source):
            entry = m.entries.get(rank, {}).get(t.key)
            if entry is None:
                report.problems.append(f"rank {rank}: {t.key}: missing from the manifest")
            else:
                report.problems += _compare(m, rank, t, entry.file, source, shard_files, stack)
                report.tensors += 1
            if progress is not None:
                progress(t.nbytes)
            if stop_at is not None and len(report.problems) >= stop_at:
                break
    return report


def _inventory_problems(m: Manifest, source: _Source) -> list[str]:
    """The source holds the tensors the shards were cut from, with the recorded shapes."""
    problems = []
    for name, rec in m.source_tensors.items():
        if name not in source.where:
            problems.append(f"source tensor {name} is not in the checkpoint")
        elif source.shape(name) != tuple(rec.shape):
            problems.append(
                f"source tensor {name} is {list(source.shape(name))}, the shards were cut from {list(rec.shape)}"
            )
    return problems


def _compare(
    m: Manifest, rank: int, t: OutputTensor, file: str, source: _Source, opened: dict[str, Any], stack: ExitStack
) -> list[str]:
    if file not in opened:
        try:
            opened[file] = stack.enter_context(safetensors.safe_open(str(m.path / file), "pt"))
        except Exception as e:  # noqa: BLE001 (the library's own word on an unreadable file)
            return [f"rank {rank}: {t.key}: {file} cannot be read ({e})"]
    f = opened[file]
    if t.key not in f.keys():  # noqa: SIM118
        return [f"rank {rank}: {t.key}: not in {file}"]
    found = first_difference(f.get_tensor(t.key), expected_tensor(t, source), allowed_ulps(t))
    return [] if found is None else [f"rank {rank}: {t.key} ({file}) {found}"]
