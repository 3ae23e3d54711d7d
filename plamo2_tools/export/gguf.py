"""`plamo2-tools export gguf`: a PLaMo checkpoint as the GGUF file llama.cpp (Ollama, LM Studio) loads,
tensor for tensor and key for key what llama.cpp's own `convert_hf_to_gguf.py` writes, verified
against the reference when written (docs/export.md, "GGUF").

What is written: `gguf_plan.py` (names, shapes, types, the bytes of each tensor), `gguf_meta.py`
(the keys), through the `gguf` package's `GGUFWriter` for the header, keys and tensor index; the
tensor data streams row chunks straight from the checkpoint (memory: one chunk, not the model).
K-quants and i-quants go through llama.cpp's own `llama-quantize` when it is on PATH.

The file is written as `OUT.partial`, created fresh (a planted link there is replaced, never
followed), fsync'd, verified, and renamed over OUT only then, after the side file
`OUT.plamo2-export.json` that records its digest and the verification figures: an interrupted
export leaves nothing that looks complete.  An existing OUT is replaced only when it is ours (a GGUF
carrying our key `plamo2_tools.export`) and `--force` is given; anything else standing there is
the user's and is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..digest import XXH3_128, new_hash
from ..errors import EnvironmentLimitError, OutputExistsError, UserError, os_error
from ..jsonio import CONFIG_BYTES, read_json
from ..kinds import EXPORT_GGUF_KIND, EXPORT_GGUF_SCHEMA_VERSION
from ..model.checkpoint import HFCheckpoint
from ..outputs import check_free_space, ensure_complete
from ..safe_files import create_fresh, write_error
from ..safetensors_io import atomic_write_text, fsync_dir
from ..shards.lock import ensure_not_being_written
from .gguf_meta import OWN_KEY, call, model_card, own_value, vocab
from .gguf_plan import (
    FILE_TYPES,
    LLAMA_QUANTIZE_TYPES,
    Override,
    PlannedTensor,
    parse_overrides,
    plan_tensors,
    row_chunks,
)
from .gguf_plan import tensor_bytes as planned_bytes

GGUF_EXPORT_KIND, GGUF_EXPORT_SCHEMA_VERSION = EXPORT_GGUF_KIND, EXPORT_GGUF_SCHEMA_VERSION
SIDE_SUFFIX = ".plamo2-export.json"
PARTIAL_SUFFIX = ".partial"


def side_file(out: Path) -> Path:
    return out.with_name(out.name + SIDE_SUFFIX)


# ---- what stands at OUT ----------------------------------------------------------------------------
def _is_ours(path: Path) -> bool:
    """A regular GGUF file carrying our key (read with the gguf package; anything unreadable is not)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # not GGUF, truncated, hostile: not ours, whatever the reason
        return False
    return OWN_KEY in reader.fields


def check_output(out: Path, force: bool) -> None:
    """Refuse before any work: a directory or a link at OUT, a file that is not ours, or ours
    without --force (exit 2, one line); the side file follows the same rule."""
    parent = out.parent
    if not parent.is_dir():
        raise UserError(f"{out}: the directory {parent} does not exist")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise OutputExistsError(f"{out}: is a symbolic link; plamo2-tools writes only its own files: move it away")
        if not stat.S_ISREG(st.st_mode):
            raise OutputExistsError(f"{out}: exists and is not a regular file: move it away")
        if not _is_ours(out):
            raise OutputExistsError(f"{out}: exists and was not written by plamo2-tools: move it away")
        if not force:
            raise OutputExistsError(f"{out}: exists (use --force to replace this export of plamo2-tools)")
    side = side_file(out)
    if side.exists() or side.is_symlink():
        record = None
        if side.is_file() and not side.is_symlink():
            try:
                record = read_json(side, CONFIG_BYTES)
            except Exception:
                record = None
        if not (isinstance(record, dict) and record.get("kind") == GGUF_EXPORT_KIND):
            raise OutputExistsError(f"{side}: exists and was not written by plamo2-tools: move it away")
        if st is None and not force:
            raise OutputExistsError(f"{side}: exists (use --force to replace this export of plamo2-tools)")


# ---- writing ------------------------------------------------------------------------------------------
class _HashingFile:
    """What GGUFWriter writes through (write, flush, tell): the fd of our fresh temporary, hashed as
    written, with one-line errors (a full disk names the filesystem)."""

    def __init__(self, fd: int, path: Path, shown: Path) -> None:
        self.fd, self.path, self.shown = fd, path, shown
        self.pos = 0
        self.hasher = new_hash(XXH3_128)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.write(self.fd, view)
                self.hasher.update(view[:n])
                self.pos += n
                view = view[n:]
        except OSError as e:
            raise write_error(e, self.shown) from None
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def pad(self, alignment: int) -> None:
        self.write(bytes(-self.pos % alignment))


@dataclass
class ExportResult:
    out: Path
    type: str
    tensors: int
    bytes: int
    digest: str
    seconds: float
    notes: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    verify: dict[str, Any] | None = None

    def diverged(self) -> bool:
        return self.verify is not None and self.verify["verdict"] != "pass"

    def summary(self) -> dict[str, Any]:
        return {
            "kind": GGUF_EXPORT_KIND,
            "schema_version": GGUF_EXPORT_SCHEMA_VERSION,
            "file": self.out.name,
            "type": self.type,
            "tensor_types": self.overrides,
            "tensors": self.tensors,
            "bytes": self.bytes,
            XXH3_128: self.digest,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
            "verify": self.verify,
        }


def _open_source(src: Path) -> HFCheckpoint:
    ensure_not_being_written(src)
    ensure_complete(src)
    ckpt = HFCheckpoint(src)
    ckpt.check_inventory()
    if ckpt.family.gguf is None:
        ckpt.close()
        raise UserError(f"{src}: {ckpt.family.description} has no llama.cpp architecture")
    return ckpt


def _auto_type(ckpt: HFCheckpoint) -> str:
    """The converter's `--outtype auto`: the first 2-D tensor's dtype (bf16 or f16), else f16."""
    for info in ckpt.tensors.values():
        if len(info.shape) >= 2:
            return {"bfloat16": "bf16", "float16": "f16"}.get(info.dtype.name, "f16")
    return "f16"


def build_header(
    ckpt: HFCheckpoint,
    src: Path,
    type_name: str,
    overrides: list[Override],
    planned: list[PlannedTensor],
    recorded: tuple[str, list[Override]] | None = None,
) -> tuple[gguf.GGUFWriter, list[str]]:
    """A GGUFWriter holding every key (in the converter's order, then ours) and the tensor index.
    `recorded`: the type and overrides our key records when they are not these (the base file of
    a llama-quantize export records the final type)."""
    arch = ckpt.family.gguf
    assert arch is not None
    ftype = FILE_TYPES[type_name][1] if type_name in FILE_TYPES else None
    writer = gguf.GGUFWriter(path=None, arch=arch.arch)
    for t in planned:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    raw = read_json(src / "config.json", CONFIG_BYTES)
    card, notes = model_card(src, src.name or src.resolve().name, writer.get_total_parameter_count())
    writer.add_type(gguf.GGUFType.MODEL)
    card.set_gguf_meta_model(writer)
    for method, args in arch.metadata(ckpt.config, raw):
        if method != "add_file_type":
            call(writer, method, args)
        elif ftype is not None:  # llama-quantize sets its own
            writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    words = vocab(src, ckpt.config.vocab_size, arch)
    for method, args in words.calls + words.additions:
        call(writer, method, args)
    kind, rules = recorded or (type_name, overrides)
    writer.add_string(OWN_KEY, own_value(kind, [(o.pattern, o.type) for o in rules], src.name))
    fallbacks = [
        f"{t.name}: rows of {t.shape[-1]} do not split into {type_name} blocks: F16 (llama.cpp's fallback)"
        for t in planned
        if t.fallback
    ]
    notes += arch.differences(ckpt.config, raw) + words.notes + fallbacks
    return writer, notes


def expected_keys(src: Path, recipe: dict[str, Any]) -> dict[str, tuple[Any, list[int]]]:
    """The keys an export of `src` with `recipe` (our key's JSON) writes: {key: (contents, types)},
    as the `gguf` package reads them back (`check` compares a file with these)."""
    type_name = recipe["type"]
    overrides = [Override(*spec.split("=", 1)) for spec in recipe.get("tensor_types") or []]
    with HFCheckpoint(src) as ckpt:
        arch = ckpt.family.gguf
        assert arch is not None
        planned = plan_tensors(ckpt, arch, FILE_TYPES.get(type_name, FILE_TYPES["f32"])[0], overrides)
        writer, _ = build_header(ckpt, src, type_name, overrides, planned)
    writer.tensors = [{}]  # keys only: a file without tensors reads back on its own
    with tempfile.TemporaryDirectory(prefix="plamo2-gguf-keys-") as tmp:
        path = Path(tmp) / "keys.gguf"
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        reader = gguf.GGUFReader(str(path))
        return {
            k: (plain(f.contents()), [int(t) for t in f.types])
            for k, f in reader.fields.items()
            if not k.startswith("GGUF.")
        }


def plain(value: Any) -> Any:
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, list) and value and isinstance(value[0], float):
        return [float(np.float32(v)) for v in value]
    return value


def write_gguf(
    ckpt: HFCheckpoint,
    src: Path,
    partial: Path,
    shown: Path,
    type_name: str,
    overrides: list[Override],
    progress: Callable[[int], None] | None = None,
    recorded: tuple[str, list[Override]] | None = None,
) -> tuple[int, int, str, list[str]]:
    """Write the whole file to `partial` (created fresh, fsync'd): (tensors, bytes, digest, notes)."""
    arch = ckpt.family.gguf
    assert arch is not None
    planned = plan_tensors(ckpt, arch, FILE_TYPES[type_name][0], overrides)
    writer, notes = build_header(ckpt, src, type_name, overrides, planned, recorded)
    header = sum(len(k) + 64 for k in writer.kv_data[0]) + sum(len(t.name) + 64 for t in planned)
    tokens = writer.kv_data[0][gguf.Keys.Tokenizer.LIST].value
    check_free_space(
        shown.parent,
        header + sum(t.nbytes + 32 for t in planned) + sum(len(t) + 8 for t in tokens),
        f"the {type_name} GGUF",
    )
    fd = create_fresh(partial, os.O_WRONLY)
    try:
        f = _HashingFile(fd, partial, shown)
        writer.fout = [f]  # type: ignore[list-item]  # our fd: created fresh, never through a link
        writer.state = gguf.gguf_writer.WriterState.EMPTY
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        f.pad(writer.data_alignment)
        for t in planned:
            for start, stop in row_chunks(t):
                data = planned_bytes(ckpt, t, start, stop)
                f.write(data.data if data.flags.c_contiguous else data.tobytes())
                if progress:  # in source bytes, the total on_plan announced
                    progress((stop - start) * ckpt.tensors[t.source].row_bytes)
            f.pad(writer.data_alignment)
        try:
            os.fsync(fd)
        except OSError as e:
            raise write_error(e, shown) from None
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    return len(planned), f.pos, f.hasher.hexdigest(), notes


def _llama_quantize(base: Path, partial: Path, shown: Path, type_name: str, overrides: list[Override]) -> None:
    """llama.cpp's own quantizer: `llama-quantize [--tensor-type P=T ...] base partial TYPE`."""
    tool = shutil.which("llama-quantize")
    assert tool is not None
    args = [tool] + [a for o in overrides for a in ("--tensor-type", f"{o.pattern}={o.type}")]
    partial.unlink(missing_ok=True)
    proc = subprocess.run([*args, str(base), str(partial), type_name.upper()], capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EnvironmentLimitError(f"{shown}: llama-quantize {type_name} failed (exit {proc.returncode}): {tail[0]}")
    if partial.is_symlink() or not partial.is_file():
        raise EnvironmentLimitError(f"{shown}: llama-quantize wrote no file")


def export_gguf(
    src: Path,
    out: Path,
    type_name: str = "auto",
    tensor_types: list[str] | None = None,
    recipe: str | None = None,
    force: bool = False,
    verify: bool = True,
    verify_prompts: int = 4,
    verify_tokens: int = 48,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write SRC as OUT (module doc).  The verification's verdict is in the result (`diverged()`):
    the file is written either way, it is what llama.cpp's converter writes."""
    start = time.perf_counter()
    type_name = type_name.lower()
    via_quantize = type_name in LLAMA_QUANTIZE_TYPES
    if type_name not in FILE_TYPES and type_name != "auto" and not via_quantize:
        raise UserError(
            f"--type {type_name!r}: one of auto, {', '.join(FILE_TYPES)}, or a llama-quantize type "
            f"({', '.join(LLAMA_QUANTIZE_TYPES[:6])}, ...)"
        )
    if via_quantize and shutil.which("llama-quantize") is None:
        raise EnvironmentLimitError(
            f"--type {type_name}: needs llama.cpp's llama-quantize on PATH (not found); "
            f"the types written without it: {', '.join(FILE_TYPES)}"
        )
    check_output(out, force)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    ckpt = _open_source(src)
    try:
        arch = ckpt.family.gguf
        assert arch is not None
        overrides = parse_overrides(tensor_types or [], arch.recipes, recipe)
        if type_name == "auto":
            type_name = _auto_type(ckpt)
        # llama-quantize starts from the checkpoint's own precision (bf16 stays exact; else f32)
        base_type = "bf16" if _auto_type(ckpt) == "bf16" else "f32"
        if on_plan:
            on_plan(sum(info.nbytes for info in ckpt.tensors.values()))
        if via_quantize:
            with tempfile.TemporaryDirectory(prefix=".plamo2-gguf-", dir=out.parent) as tmp:
                base = Path(tmp) / "base.gguf"
                write_gguf(ckpt, src, base, out, base_type, [], progress, recorded=(type_name, overrides))
                _llama_quantize(base, partial, out, type_name, overrides)
            tensors, size, digest, notes = _describe_quantized(partial)
        else:
            tensors, size, digest, notes = write_gguf(ckpt, src, partial, out, type_name, overrides, progress)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        ckpt.close()
    result = ExportResult(
        out, type_name, tensors, size, digest, 0.0, notes, [f"{o.pattern}={o.type}" for o in overrides]
    )
    try:
        if verify:
            from .gguf_verify import verify_gguf

            result.verify = verify_gguf(partial, src, type_name, verify_prompts, verify_tokens, device=device)
        result.seconds = time.perf_counter() - start
        atomic_write_text(side_file(out), json.dumps(result.summary(), indent=2) + "\n")
        _commit(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return result


def _describe_quantized(path: Path) -> tuple[int, int, str, list[str]]:
    hasher = new_hash(XXH3_128)
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            hasher.update(chunk)
    reader = gguf.GGUFReader(str(path))
    return len(reader.tensors), path.stat().st_size, hasher.hexdigest(), ["quantized by llama-quantize"]


def _commit(partial: Path, out: Path) -> None:
    """Rename the verified temporary over OUT, then make the rename durable."""
    try:
        os.replace(partial, out)
        fsync_dir(out.parent)
    except OSError as e:
        raise os_error(e, f"{out}: cannot write") from None
