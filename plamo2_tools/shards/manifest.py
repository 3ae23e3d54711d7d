"""The shard format in one module (docs/shard-format.md): file names, header metadata, and the
manifest `plamo2_shards.json`, its writer and its reader.  The manifest is written last; its
presence means the conversion is complete.  Everything that reads shards (check, merge, reshard,
the runtime, eval, inspect) goes through `load_manifest`, which parses a directory's manifest once
per process into a typed `Manifest`: nothing outside this package reads the JSON itself.

What differs between format versions (where digests are recorded, how a file digest is built,
which tensors the layout held) is the version's object in `formats.py`."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtypes import DType, dtype_name, parse_dtype
from ..errors import CheckpointError
from ..jsonio import CONFIG_BYTES, MANIFEST_BYTES, read_object
from ..parallel import Mapping
from ..safe_files import plain_name, read_regular
from ..safetensors_io import atomic_write_text
from ..version import __version__
from .formats import FORMAT, HASH, WRITTEN, ShardFormat, format_of
from .journal import JOURNAL_NAME
from .lock import ensure_not_being_written

if TYPE_CHECKING:
    from ..model.family import Family
    from ..model.layout import OutputTensor, Piece

# The model package (families, tensor tables, layout) is imported where a manifest is read or
# written, not with this module: a command refusing a directory that holds no manifest, which
# imports this for the names above, stays as fast as one that only moves bytes (issue 33).

MANIFEST_NAME = "plamo2_shards.json"
FORMAT_VERSION = WRITTEN.version  # what convert writes

__all__ = ["FORMAT", "FORMAT_VERSION", "HASH", "JOURNAL_NAME", "MANIFEST_NAME", "Manifest", "TensorEntry"]


def file_name(rank: int, part: int) -> str:
    return f"model-rank-{rank}-part-{part}.safetensors"


def file_metadata(mapping: Mapping, rank: int) -> dict[str, str]:
    """The safetensors header metadata of every file of a rank (vLLM's loaders want format=pt)."""
    tp_rank, pp_rank = mapping.ranks(rank)
    return {
        "format": "pt",
        "plamo2_tools_version": __version__,
        "tp_rank": str(tp_rank),
        "tp_size": str(mapping.tp),
        "pp_rank": str(pp_rank),
        "pp_size": str(mapping.pp),
    }


# ---- the typed view ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    """One output tensor as the manifest records it."""

    rank: int
    file: str
    tensor: OutputTensor
    digest: str  # of the tensor's data bytes, in the manifest's algorithm (Manifest.hash)


@dataclass(frozen=True)
class FileRecord:
    size: int
    digest: str  # of the whole file, in the manifest's algorithm by its version's rule
    rank: int
    part: int


@dataclass(frozen=True)
class SourceTensorRecord:
    dtype: DType
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SourceRecord:
    """The checkpoint the shards were made from."""

    path: str
    kind: str  # "hf" | "shards"
    files: dict[str, dict[str, Any]]  # name -> {size, digest[, sha256]}
    config_sha256: str
    tensors: dict[str, SourceTensorRecord]  # HF name -> dtype, shape


@dataclass(frozen=True)
class SideRecord:
    """A file copied into the shard directory (version 3): its size and digest (H of its bytes)."""

    size: int
    digest: str


@dataclass(frozen=True)
class Options:
    dtype: str  # convert's --dtype ("auto": the source's)
    max_part_size: int
    tied_embeddings: bool
    padded_vocab: int


@dataclass(frozen=True)
class RankRecord:
    rank: int
    tp_rank: int
    pp_rank: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    path: Path  # the shard directory
    format: ShardFormat
    hash: str  # the algorithm of every digest this manifest records
    tool_version: str | None
    fingerprint: str
    source: SourceRecord
    config: Any  # the typed config of the model's family (model/registry.py)
    mapping: Mapping
    ranks: tuple[RankRecord, ...]
    options: Options
    copied_files: tuple[str, ...]
    side_files: dict[str, SideRecord]  # version 3: every copied file's size and digest (else empty)
    files: dict[str, FileRecord]
    entries: dict[int, dict[str, TensorEntry]]  # rank -> key -> entry

    @property
    def version(self) -> int:
        return self.format.version

    @property
    def family(self) -> Family:
        from ..model import family_of

        return family_of(self.config)

    def file_digest(self, name: str) -> str:
        """The recorded digest of one shard file."""
        return self.files[name].digest

    def digests_of(self, path: Path, pool: Executor | None = None) -> tuple[str, dict[str, str]]:
        """(file digest, {tensor key: digest}) of a file on disk, computed the way this manifest's
        version defines them (what `check`, resume and the runtime compare)."""
        return self.format.digests(path, self.hash, pool)

    def rank_files(self, rank: int) -> list[str]:
        return list(self.ranks[rank].files)

    @property
    def source_tensors(self) -> dict[str, SourceTensorRecord]:
        return self.source.tensors

    @property
    def out_dtype(self) -> DType | None:
        """convert's --dtype (None: "auto", every tensor kept its source dtype)."""
        return None if self.options.dtype == "auto" else parse_dtype(self.options.dtype)

    @property
    def activation_dtype(self) -> DType:
        """The dtype the runtime computes in: convert's --dtype, or with "auto" that of the family's
        activation tensor (its decoder weights) as converted."""
        if self.out_dtype is not None:
            return self.out_dtype
        suffix = self.family.activation_tensor
        for entries in self.entries.values():
            for key, e in entries.items():
                if key.endswith(suffix):
                    return e.tensor.dtype
        raise CheckpointError(f"{self.path}: no {suffix} in the manifest: cannot tell the activation dtype")


# ---- writing --------------------------------------------------------------------------------------
def tensor_record(t: OutputTensor, file: str, digest: str) -> dict[str, Any]:
    return {
        "file": file,
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "digest": digest,
        "source": t.source,
        "transforms": [str(x) for x in t.transforms],
        "pieces": [[p.source, p.dim, p.start, p.length] for p in t.pieces],
    }


def build_manifest(
    *,
    fingerprint: str,
    source: dict[str, Any],
    config: Any,
    mapping: Mapping,
    out_dtype: DType | None,
    max_part_size: int,
    files: list[tuple[str, int, int, dict[str, Any]]],
    tensors: list[tuple[int, str, OutputTensor, str]],
    copied: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of a finished conversion.

    `source`: path, kind, files ({name: {size, digest[, sha256]}}), config_sha256, tensors
    ({name: {dtype, shape}}); `files`: (name, rank, part, {size, digest}); `tensors`: (rank, file,
    tensor, digest); `copied`: {side file: {size, digest}}.  Every `digest` is in the algorithm
    HASH, named in the manifest."""
    from ..model import family_of

    records: dict[str, dict[str, Any]] = {}
    for rank, file, t, digest in tensors:
        records.setdefault(str(rank), {})[t.key] = tensor_record(t, file, digest)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "hash": HASH,
        "plamo2_tools_version": __version__,
        "family": family_of(config).name,
        "fingerprint": fingerprint,
        "source": source,
        "mapping": {
            "tp_size": mapping.tp,
            "pp_size": mapping.pp,
            "world_size": mapping.world_size,
            "stages": [list(s) for s in mapping.stages],
            "ranks": [
                {
                    "rank": r,
                    "tp_rank": mapping.ranks(r)[0],
                    "pp_rank": mapping.ranks(r)[1],
                    "files": [name for name, rank, _, _ in files if rank == r],
                }
                for r in range(mapping.world_size)
            ],
        },
        "options": {
            "dtype": dtype_name(out_dtype) if out_dtype else "auto",
            "max_part_size": max_part_size,
            "tied_embeddings": config.tie_word_embeddings,
            "padded_vocab": config.padded_vocab,
        },
        "copied_files": sorted(copied),
        "side_files": {name: {"size": rec["size"], "digest": rec["digest"]} for name, rec in sorted(copied.items())},
        "tensors": records,
        "files": {
            name: {"size": rec["size"], "digest": rec["digest"], "rank": rank, "part": part}
            for name, rank, part, rec in files
        },
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees no manifest or the whole one."""
    atomic_write_text(directory / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def config_sha256(directory: Path) -> str:
    return hashlib.sha256(read_regular(directory / "config.json", CONFIG_BYTES)).hexdigest()


# ---- reading --------------------------------------------------------------------------------------
_CACHE: dict[tuple[str | int, ...], Manifest] = {}
_CACHE_LOCK = threading.Lock()


def load_manifest(directory: str | Path) -> Manifest:
    """The typed view of a shard directory's manifest, parsed once per process (re-parsed when
    the file changes on disk)."""
    directory = Path(directory)
    ensure_not_being_written(directory)  # every reader comes through here: none reads a half-written directory
    path = directory / MANIFEST_NAME
    key = (str(directory.resolve()), *_stamp(path), *_stamp(directory / "config.json"))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = _parse_manifest(directory, path)
        return _CACHE[key]


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


def _parse_manifest(directory: Path, path: Path) -> Manifest:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: {'not a directory' if directory.exists() else 'no such directory'}")
    if not path.exists():
        hint = " (an unfinished conversion: run convert again to resume)" if (directory / JOURNAL_NAME).exists() else ""
        raise CheckpointError(f"{directory}: no {MANIFEST_NAME}: not a complete plamo2-tools shard directory{hint}")
    raw = read_object(path, MANIFEST_BYTES, f"a {FORMAT} manifest")
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    fmt = format_of(raw.get("format_version"), str(path))
    try:
        return _typed(directory, raw, fmt)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, ZeroDivisionError) as e:
        raise CheckpointError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None


def _typed(directory: Path, raw: dict[str, Any], fmt: ShardFormat) -> Manifest:
    from ..model import load_config
    from ..model.layout import OutputTensor, parse_transform

    algorithm = fmt.hash_of(raw)
    config = load_config(directory / "config.json")
    m = raw["mapping"]
    mapping = Mapping(
        _count(m["tp_size"], 1), _count(m["pp_size"], 1), tuple((_count(a), _count(b)) for a, b in _list(m["stages"]))
    )
    _check_stages(mapping, int(config.num_hidden_layers))
    ranks = tuple(
        RankRecord(
            _count(r["rank"]),
            _count(r["tp_rank"]),
            _count(r["pp_rank"]),
            tuple(plain_name(f, "mapping.ranks.files") for f in _list(r["files"])),
        )
        for r in _list(m["ranks"])
    )
    if len(ranks) != mapping.world_size or any(r.rank != i for i, r in enumerate(ranks)):
        raise CheckpointError(f"mapping.ranks lists {len(ranks)} ranks, not ranks 0..{mapping.world_size - 1}")
    key = fmt.digest_key
    files = {
        plain_name(name, "files"): FileRecord(
            _count(rec["size"]), str(rec[key]), _count(rec["rank"]), _count(rec["part"])
        )
        for name, rec in _dict(raw["files"]).items()
    }
    entries: dict[int, dict[str, TensorEntry]] = {}
    for rank_str, tensors in _dict(raw["tensors"]).items():
        rank = _count(int(rank_str))
        entries[rank] = {}
        for tkey, rec in _dict(tensors).items():
            shape, pieces = _shape(rec["shape"]), tuple(_piece(p) for p in _list(rec["pieces"]))
            cut = max((p.dim for p in pieces), default=-1)
            if cut >= len(shape):  # along an axis the tensor lacks: IndexError resharding (fuzz, issue 28)
                raise ValueError(f"tensor {tkey}: a piece cut along dim {cut} of its {len(shape)}-d shape")
            t = OutputTensor(
                key=tkey,
                source=_str(rec["source"]),
                shape=shape,
                dtype=parse_dtype(rec["dtype"]),
                pieces=pieces,
                transforms=tuple(parse_transform(x) for x in _list(rec["transforms"])),
            )
            entries[rank][tkey] = TensorEntry(
                rank, plain_name(rec["file"], f"tensors.{rank}.{tkey}.file"), t, str(rec[key])
            )
    src = raw["source"]
    source = SourceRecord(
        path=str(src["path"]),
        kind=str(src["kind"]),
        files={plain_name(n, "source.files"): dict(r) for n, r in _dict(src["files"]).items()},
        config_sha256=str(src["config_sha256"]),
        tensors=_source_tensors(_dict(src["tensors"]), config),
    )
    o = raw["options"]
    options = Options(
        str(o["dtype"]), _count(o["max_part_size"], 1), _flag(o["tied_embeddings"]), _count(o["padded_vocab"], 1)
    )
    return Manifest(
        path=directory,
        format=fmt,
        hash=algorithm,
        tool_version=raw.get("plamo2_tools_version"),
        fingerprint=str(raw["fingerprint"]),
        source=source,
        config=config,
        mapping=mapping,
        ranks=ranks,
        options=options,
        copied_files=tuple(plain_name(x, "copied_files") for x in _list(raw.get("copied_files") or [])),
        side_files=_side_files(raw, fmt),
        files=files,
        entries=entries,
    )


def _check_stages(mapping: Mapping, layers: int) -> None:
    """`mapping.stages` must cut the config's layers into `pp_size` consecutive non-empty ranges: the
    runtime builds each stage's layers from it (a stage past the last layer was exit 70; one short
    of it silently ran fewer layers: issue 28)."""
    bounds = [0, *(b for _, b in mapping.stages)]
    starts = [a for a, _ in mapping.stages]
    if (
        mapping.tp < 1
        or len(mapping.stages) != mapping.pp
        or starts != bounds[:-1]
        or bounds[-1] != layers
        or any(a >= b for a, b in mapping.stages)
    ):
        shown = json.dumps([list(x) for x in mapping.stages])[:80]
        raise CheckpointError(
            f"mapping.stages {shown} does not split the {layers} layers of config.json into "
            f"pp_size = {mapping.pp} consecutive non-empty ranges: malformed manifest"
        )


def _side_files(raw: dict[str, Any], fmt: ShardFormat) -> dict[str, SideRecord]:
    if not fmt.side_digests:
        return {}
    return {
        plain_name(name, "side_files"): SideRecord(_count(rec["size"]), str(rec["digest"]))
        for name, rec in _dict(raw["side_files"]).items()
    }


def _source_tensors(raw: dict[str, Any], config: Any) -> dict[str, SourceTensorRecord]:
    """The HF inventory the shards were cut from: exactly the names the config has (merge and
    resharding look each one up).  Shapes are typed here and compared with the config by `check`
    (a changed config.json is its finding, not a refusal to read)."""
    from ..model import hf_tensor_shapes

    out = {name: SourceTensorRecord(parse_dtype(rec["dtype"]), _shape(rec["shape"])) for name, rec in raw.items()}
    expected = set(hf_tensor_shapes(config))
    if set(out) != expected:
        odd = sorted(set(out) ^ expected)
        raise CheckpointError(
            f"source.tensors does not list the tensors of config.json ({len(odd)} differ, e.g. {odd[0]!r}): "
            "was config.json changed since the conversion?"
        )
    return out


def _str(value: Any) -> str:
    if not isinstance(value, str):  # a list here was unhashable later (found by bench/fuzz.py)
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _count(value: Any, least: int = 0) -> int:
    """A JSON integer >= `least`: not a bool (JSON's true is no count), not a float, not negative."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{value!r} is not a count" + (f" >= {least}" if least else ""))
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):  # bool("false") is True
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(_count(x) for x in _list(value))


def _piece(value: Any) -> Piece:
    """[source | null, dim, start, length]: typed before any slicing uses it."""
    from ..model.layout import Piece

    source, dim, start, length = _list(value)
    if not (source is None or isinstance(source, str)) or dim not in (0, 1) or isinstance(dim, bool):
        raise ValueError(f"piece {value!r}")
    return Piece(source, dim, _count(start), _count(length))


def _dict(value: Any) -> dict[str, Any]:
    """A manifest field that must be an object (a list or a string there is malformed, not a crash)."""
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected an array, got {type(value).__name__}")
    return value
