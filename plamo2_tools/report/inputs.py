"""Find the JSON inputs of a report and recognise what each one is by its content.

File names carry no meaning here: lm-eval stamps its results with the time, benchmarks may stream
to any name, and users rename things.  Directories are searched recursively for *.json and *.jsonl
(hidden directories such as .git are left out); anything that is not one of the known kinds is
skipped with a note, never an error.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

log = logging.getLogger(__name__)

SUFFIXES = (".json", ".jsonl")
HEAD_LINES = 5  # a streamed benchmark may start with a few header lines before its records
# lm-eval's results file always has "configs" too; `plamo2-tools eval --json` keeps only these.
LMEVAL_KEYS = ("results", "versions", "n-shot", "config")
KERNEL_RECORD_KEYS = ("kernel", "impl")
KERNEL_LIST_KEYS = ("records", "results", "measurements", "rows", "runs", "data")

# Kind names, in the order the report shows its sections.
LMEVAL = "lm-eval"
VERIFY = "verify"
BENCH_CONVERT = "bench-convert"
BENCH_KERNELS = "bench-kernels"
BENCH_RUNTIME = "bench-runtime"
CONVERT = "convert"
CHECK = "check"
INSPECT = "inspect"
KINDS = (LMEVAL, VERIFY, BENCH_CONVERT, BENCH_KERNELS, BENCH_RUNTIME, CONVERT, CHECK, INSPECT)


@dataclass(frozen=True)
class Doc:
    """One recognised input file: its path, how the report names it, its kind and its data."""

    path: Path
    name: str
    kind: str
    data: Any


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


def find_files(inputs: Iterable[Path]) -> list[tuple[Path, str]]:
    """(path, display name) of every candidate file, sorted by display name, each file once.

    The display name is the input as typed joined with the path below it, so the report shows
    paths the user recognises and stays the same from run to run.
    """
    found: dict[Path, str] = {}
    for given in inputs:
        if not given.exists():
            raise UserError(f"{given}: no such file or directory")
        candidates = [(given, given.as_posix())] if given.is_file() else _walk(given)
        for path, name in candidates:
            found.setdefault(path.resolve(), name)
    return sorted(((p, n) for p, n in found.items()), key=lambda item: item[1])


def _walk(root: Path) -> list[tuple[Path, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(SUFFIXES) and not f.startswith("."):
                path = Path(dirpath) / f
                out.append((path, (root / path.relative_to(root)).as_posix()))
    return out


def load(path: Path) -> Any:
    """JSON, or JSON Lines when the file is not one JSON value (a streamed benchmark).

    A JSON Lines file is only read past its first lines when they hold a kernel measurement or
    header: lm-eval's samples files are JSON Lines too and can be tens of megabytes.
    """
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty file")
    head = [json.loads(line) for line in lines[:HEAD_LINES]]  # a ValueError here means: not JSON at all
    if not any(isinstance(r, dict) and (is_kernel_record(r) or r.get("kind") == "plamo2-bench-kernels") for r in head):
        return head  # enough to tell that it is something else
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A benchmark killed at its time limit leaves a cut last line; keep everything before.
            log.warning("%s: line %d is not JSON, ignored", path, i)
    return records


def classify(data: Any) -> str | None:
    """The kind of one loaded input, or None when it is none of the known ones."""
    if isinstance(data, list):
        return BENCH_KERNELS if kernel_records(data) else None
    if not isinstance(data, dict):
        return None
    kind = data.get("kind")
    if kind == "plamo2-verify":
        return VERIFY
    if (
        kind == "plamo2-bench-convert"
        and isinstance(data.get("baseline"), dict)
        and isinstance(data.get("results"), list)
    ):
        return BENCH_CONVERT
    if kind == "plamo2-bench-runtime" and isinstance(data.get("runs"), list):
        return BENCH_RUNTIME
    if kind == "plamo2-bench-kernels" or (kind is None and kernel_records(data)):
        return BENCH_KERNELS  # bench/kernels.py writes {"env": ..., "records": [...]} without a kind
    if all(k in data for k in LMEVAL_KEYS) and isinstance(data["results"], dict):
        return LMEVAL
    if {"status", "tp", "pp", "ranks"} <= data.keys():
        return CONVERT
    if {"path", "ok", "checks"} <= data.keys() and isinstance(data["checks"], dict):
        return CHECK
    if kind in ("hf", "shards") and {"path", "config", "layers"} <= data.keys():
        return INSPECT
    return None


def all_records(data: Any) -> list[dict[str, Any]]:
    """Every record of a kernel benchmark (measurements and bookkeeping), wherever the file keeps them."""
    if isinstance(data, dict):
        if is_kernel_record(data):
            return [data]
        for key in KERNEL_LIST_KEYS:
            if isinstance(data.get(key), list):
                return all_records(data[key])
        return []
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict)]
    return []


def kernel_records(data: Any) -> list[dict[str, Any]]:
    """The records that name a kernel and an implementation."""
    return [r for r in all_records(data) if is_kernel_record(r)]


def is_kernel_record(d: dict[str, Any]) -> bool:
    return all(k in d for k in KERNEL_RECORD_KEYS)


def collect(inputs: Iterable[Path]) -> tuple[list[Doc], list[Skipped]]:
    """Load and recognise every candidate file; unreadable or unknown ones are noted and skipped."""
    docs: list[Doc] = []
    skipped: list[Skipped] = []
    for path, name in find_files(inputs):
        try:
            data = load(path)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append(_skip(name, f"not readable as JSON ({type(e).__name__})"))
            continue
        kind = classify(data)
        if kind is None:
            skipped.append(_skip(name, "not a recognised results file" + _keys_hint(data)))
        else:
            docs.append(Doc(path, name, kind, data))
    return _dedupe(docs, skipped)


def _dedupe(docs: list[Doc], skipped: list[Skipped]) -> tuple[list[Doc], list[Skipped]]:
    """Drop inputs that add nothing: our eval writes results_<date>.json and a results.json copy,
    bench/kernels.py writes kernels.json and streams the same records to kernels.jsonl."""
    kept: list[Doc] = []
    for doc in docs:
        twin = next((k for k in kept if k.kind == doc.kind and _fingerprint(k) == _fingerprint(doc)), None)
        if twin is None:
            kept.append(doc)
        elif _size(doc) > _size(twin):  # keep the fuller file: lm-eval's own over `eval --json`'s digest
            kept[kept.index(twin)] = doc
            skipped.append(_skip(twin.name, f"same results as {doc.name}"))
        else:
            skipped.append(_skip(doc.name, f"same results as {twin.name}"))
    records = {d.name: _record_set(d) for d in kept if d.kind == BENCH_KERNELS}
    for doc in [d for d in kept if d.name in records]:
        bigger = next((n for n, s in records.items() if n != doc.name and records[doc.name] < s), None)
        if bigger is not None:
            skipped.append(_skip(doc.name, f"all its measurements are also in {bigger}"))
            kept.remove(doc)
            del records[doc.name]
    return kept, skipped


def _fingerprint(doc: Doc) -> str:
    data = doc.data
    if doc.kind == LMEVAL:  # the same run, whatever else the file carries (eval --json keeps less)
        data = {k: data.get(k) for k in ("results", "config", "n-samples", "task_hashes")}
    elif doc.kind == BENCH_KERNELS:
        data = sorted(_record_set(doc))
    return json.dumps(data, sort_keys=True, default=str)


def _size(doc: Doc) -> int:
    return len(doc.data) if isinstance(doc.data, (dict, list)) else 0


def _record_set(doc: Doc) -> frozenset[str]:
    return frozenset(json.dumps(r, sort_keys=True, default=str) for r in all_records(doc.data))


def _skip(name: str, reason: str) -> Skipped:
    log.warning("skipped %s: %s", name, reason)
    return Skipped(name, reason)


def _keys_hint(data: Any) -> str:
    if isinstance(data, dict):
        keys = list(data)[:6]
        return " (keys: " + ", ".join(map(str, keys)) + (", …" if len(data) > 6 else "") + ")"
    return f" (a JSON {type(data).__name__})"
