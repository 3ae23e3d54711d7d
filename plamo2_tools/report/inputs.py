"""Find the JSON inputs of a report and recognise what each one is.

Our own result files say what they are: each carries `"kind"` and `"schema_version"`, named in
one leaf module, plamo2_tools/kinds.py, which their writers import too (so the report loads none of
the code that writes them), and that is all the report goes by; a file of ours in a version this
report does not read is skipped with a note saying so.  lm-eval's own results files are the one
external format: they are recognised by the structure lm-eval 0.4 documents for them.
File names carry no meaning (lm-eval stamps its results with the time, users rename things).
Directories are searched recursively for *.json and *.jsonl (hidden directories such as .git are
left out); anything else is skipped with a note, never an error.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import Plamo2Error, UserError
from ..jsonio import MAX_DEPTH, RESULT_BYTES, depth
from ..kinds import (
    BENCH_ACCURACY_KIND,
    BENCH_CONVERT_KIND,
    BENCH_E2E_KIND,
    BENCH_EXPORT_FP8_KIND,
    BENCH_EXPORT_GGUF_KIND,
    BENCH_EXPORT_MLX_KIND,
    BENCH_FUZZ_KIND,
    BENCH_KERNELS_KIND,
    BENCH_LM_EVAL_PARTS_KIND,
    BENCH_LOAD_KIND,
    BENCH_RUNTIME_KIND,
    BENCH_SCHEMA_VERSION,
    BENCH_SERVE_KIND,
    BENCH_SERVING_KIND,
    BENCH_STARTUP_KIND,
    BENCH_THROUGHPUT_KIND,
    BENCH_TOKENIZER_KIND,
    BENCH_TUNE_KIND,
    CHECK_KIND,
    CONVERT_KIND,
    EVAL_KIND,
    EXPORT_FP8_KIND,
    EXPORT_GGUF_KIND,
    EXPORT_MLX_KIND,
    INSPECT_KIND,
    KILL_RESUME_KIND,
    MUTANTS_KIND,
    VERIFY_KIND,
    VERIFY_TARGETS_KIND,
    VLLM_COMPAT_KIND,
    VLLM_FORWARD_KIND,
)
from ..safe_files import read_regular

log = logging.getLogger(__name__)

SUFFIXES = (".json", ".jsonl")
KERNEL_RECORD_KEYS = ("kernel", "impl")
KERNEL_LIST_KEYS = ("records",)  # where a kernels.json keeps its records

# Report sections, in the order the report shows them (the names appear in "Read as" and --json).
LMEVAL = "lm-eval"
VERIFY = "verify"
BENCH_CONVERT = "bench-convert"
BENCH_KERNELS = "bench-kernels"
BENCH_THROUGHPUT = "bench-throughput"
BENCH_SERVING = "bench-serving"
BENCH_ACCURACY = "bench-accuracy"
BENCH_E2E = "bench-e2e"
BENCH_STARTUP = "bench-startup"  # start-up and one-time costs (issue 33): startup, load, lm-eval parts, tune
CONVERT = "convert"
CHECK = "check"
INSPECT = "inspect"
VLLM_COMPAT = "vllm-compat"
VLLM_FORWARD = "vllm-forward"
BENCH_TOKENIZER = "bench-tokenizer"
KILL_RESUME = "kill-resume"
BENCH_FUZZ = "bench-fuzz"
MUTANTS = "mutants"
EXPORT_MLX = "export-mlx"
EXPORT_FP8 = "export-fp8"
BENCH_EXPORT_MLX = "bench-export-mlx"
BENCH_EXPORT_FP8 = "bench-export-fp8"
EXPORT_GGUF = "export-gguf"
BENCH_EXPORT_GGUF = "bench-export-gguf"
KINDS = (
    LMEVAL,
    VERIFY,
    BENCH_CONVERT,
    BENCH_KERNELS,
    BENCH_THROUGHPUT,
    BENCH_SERVING,
    BENCH_ACCURACY,
    BENCH_E2E,
    BENCH_STARTUP,
    VLLM_COMPAT,
    VLLM_FORWARD,
    BENCH_TOKENIZER,
    KILL_RESUME,
    BENCH_FUZZ,
    MUTANTS,
    EXPORT_MLX,
    EXPORT_FP8,
    BENCH_EXPORT_MLX,
    BENCH_EXPORT_FP8,
    EXPORT_GGUF,
    BENCH_EXPORT_GGUF,
    CONVERT,
    CHECK,
    INSPECT,
)


@dataclass(frozen=True)
class Schema:
    """One kind of our files as this report reads it: the section that renders it, the schema
    versions that section was written for (a writer that bumps its version must add it here once
    the section reads it), and the top-level fields the section needs, with their JSON types.  A
    benchmark of the suite (version BENCH_SCHEMA_VERSION) must also have the envelope's fields, and
    its `fields` are those of the envelope's `results` (what version 1 held at the top level)."""

    section: str
    versions: tuple[int, ...]
    fields: Mapping[str, type | tuple[type, ...]]


SUITE = BENCH_SCHEMA_VERSION
SCHEMAS: dict[str, Schema] = {
    EVAL_KIND: Schema(LMEVAL, (1,), {"results": dict}),
    VERIFY_KIND: Schema(VERIFY, (1,), {"layouts": list}),
    VERIFY_TARGETS_KIND: Schema(VERIFY, (1,), {"targets": list}),  # `verify TARGET...` (deploy/verify.py)
    BENCH_CONVERT_KIND: Schema(BENCH_CONVERT, (1, SUITE), {"baseline": dict, "results": list}),
    BENCH_KERNELS_KIND: Schema(BENCH_KERNELS, (1, SUITE), {"records": list}),  # v1 kernels.jsonl: lines are records
    BENCH_THROUGHPUT_KIND: Schema(BENCH_THROUGHPUT, (SUITE,), {"runs": list}),
    BENCH_RUNTIME_KIND: Schema(BENCH_THROUGHPUT, (1,), {"runs": list}),  # bench/runtime.py and gsm8k.py before
    BENCH_SERVING_KIND: Schema(BENCH_SERVING, (SUITE,), {"runs": list, "config": dict}),
    BENCH_SERVE_KIND: Schema(BENCH_SERVING, (1,), {"runs": list, "config": dict}),  # bench/serve.py before
    BENCH_ACCURACY_KIND: Schema(BENCH_ACCURACY, (SUITE,), {"split_seconds": dict, "metrics": dict}),
    BENCH_E2E_KIND: Schema(BENCH_E2E, (SUITE,), {"steps": list, "records": list}),
    CONVERT_KIND: Schema(CONVERT, (1,), {"tp": int, "pp": int, "ranks": list}),
    CHECK_KIND: Schema(CHECK, (1,), {"path": str, "ok": bool, "checks": dict}),
    INSPECT_KIND: Schema(INSPECT, (1,), {"path": str, "config": dict, "layers": list}),
    VLLM_COMPAT_KIND: Schema(VLLM_COMPAT, (1,), {"summary": dict, "cases": list}),
    VLLM_FORWARD_KIND: Schema(VLLM_FORWARD, (1,), {"summary": dict, "cases": list}),
    BENCH_TOKENIZER_KIND: Schema(BENCH_TOKENIZER, (1,), {"summary": dict}),
    KILL_RESUME_KIND: Schema(KILL_RESUME, (1,), {"trials": list, "all_identical": bool}),
    BENCH_FUZZ_KIND: Schema(BENCH_FUZZ, (1,), {"targets": dict, "inputs": int, "contract_broken": int}),
    MUTANTS_KIND: Schema(MUTANTS, (1,), {"mutants": list, "total": int, "caught": int}),
    BENCH_STARTUP_KIND: Schema(BENCH_STARTUP, (1,), {"cases": list}),
    BENCH_LOAD_KIND: Schema(BENCH_STARTUP, (1,), {"kinds": dict}),
    BENCH_LM_EVAL_PARTS_KIND: Schema(BENCH_STARTUP, (1,), {"parts_seconds": dict}),
    BENCH_TUNE_KIND: Schema(BENCH_STARTUP, (SUITE,), {"table": dict}),
    EXPORT_MLX_KIND: Schema(EXPORT_MLX, (1, 3), {"model_type": str, "known_differences": list}),
    EXPORT_FP8_KIND: Schema(EXPORT_FP8, (1, 3), {"format": str, "quantized": list}),
    BENCH_EXPORT_MLX_KIND: Schema(BENCH_EXPORT_MLX, (1,), {"presets": dict}),
    BENCH_EXPORT_FP8_KIND: Schema(BENCH_EXPORT_FP8, (1,), {"baseline": dict, "results": list}),
    EXPORT_GGUF_KIND: Schema(EXPORT_GGUF, (1,), {"type": str, "tensors": int}),
    BENCH_EXPORT_GGUF_KIND: Schema(BENCH_EXPORT_GGUF, (1,), {"preset": str, "cp": dict, "ours": dict}),
}
# The suite's envelope (bench/common.py): what every benchmark file of version BENCH_SCHEMA_VERSION has.
ENVELOPE_FIELDS: Mapping[str, type | tuple[type, ...]] = {
    "benchmark": str,
    "machine": dict,
    "command": str,
    "started_at": str,
    "complete": bool,
    "results": dict,
}
# lm-eval 0.4's aggregated results file (EvaluationTracker.save_results_aggregated): these keys,
# each a JSON object, are always there; "configs" tells it from a digest of it.
LMEVAL_FIELDS = ("results", "configs", "versions", "n-shot", "config")


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

    A JSON Lines file is read past its first line only when that line declares a kind of ours:
    lm-eval's samples files are JSON Lines too and can be tens of megabytes.
    """
    text = read_regular(path, RESULT_BYTES).decode("utf-8")  # bounded; a FIFO refused, not waited on
    try:
        return _line(text)
    except json.JSONDecodeError:
        pass
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty file")
    head = _line(lines[0])  # a ValueError here means: not JSON at all
    if not (isinstance(head, dict) and "kind" in head):
        return [head]  # enough to tell that it is something else
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(_line(line))
        except json.JSONDecodeError:
            # A benchmark killed at its time limit leaves a cut last line; keep everything before.
            log.warning("%s: line %d is not JSON, ignored", path, i)
    return records


def _line(text: str) -> Any:
    """json.loads, bounded in depth (jsonio.MAX_DEPTH): too deep is a ValueError like bad JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if depth(value) > MAX_DEPTH:
        raise ValueError("nested too deeply")
    return value


def classify(data: Any) -> tuple[str | None, str]:
    """(report section, "") for a file this report reads, else (None, why it is skipped)."""
    if isinstance(data, list):  # JSON Lines: the first line is the stream's header
        header = data[0] if data and isinstance(data[0], dict) and "kind" in data[0] else None
        if header is None:
            return None, f"not a recognised results file (a JSON {type(data).__name__})"
        return _by_kind(header, [r for r in data if isinstance(r, dict) and "kind" in r], stream=True)
    if not isinstance(data, dict):
        return None, f"not a recognised results file (a JSON {type(data).__name__})"
    if "kind" in data:
        return _by_kind(data, [data], stream=False)
    if all(isinstance(data.get(k), dict) for k in LMEVAL_FIELDS):
        return LMEVAL, ""
    return None, "not a recognised results file" + _keys_hint(data)


def _by_kind(first: dict[str, Any], headers: list[dict[str, Any]], stream: bool) -> tuple[str | None, str]:
    """Recognise one of our files by its kind and version; `headers` are every declaration in the
    file (a benchmark stream that was appended to by a rerun starts each run with one)."""
    kind = first["kind"]
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        return None, f"kind {kind!r} is not one this report reads"
    if any(h.get("kind") != kind for h in headers):
        return None, f"{kind} stream holds more than one kind"
    versions = sorted({repr(h.get("schema_version")) for h in headers})
    if any(h.get("schema_version") not in schema.versions for h in headers):
        known = ", ".join(map(str, schema.versions))
        return None, f"{kind} schema_version {', '.join(versions)}: this plamo2-tools reads version {known}"
    if stream:
        if kind != BENCH_KERNELS_KIND:
            return None, f"{kind} as JSON Lines: only {BENCH_KERNELS_KIND} streams its records"
        return schema.section, ""
    missing = [name for name, t in schema.fields.items() if not _is(first.get(name), t)]
    if first["schema_version"] == BENCH_SCHEMA_VERSION:
        missing = [name for name, t in ENVELOPE_FIELDS.items() if not _is(first.get(name), t)]
        results = first.get("results") if isinstance(first.get("results"), dict) else {}
        missing += [f"results.{name}" for name, t in schema.fields.items() if not _is(results.get(name), t)]
    if missing:
        return None, f"{kind} version {first['schema_version']} without a valid {', '.join(missing)}"
    return schema.section, ""


def _is(value: Any, types: type | tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a JSON true is no count, though Python's bool is an int
        return bool in (types if isinstance(types, tuple) else (types,))
    return isinstance(value, types)


def all_records(data: Any) -> list[dict[str, Any]]:
    """Every record of a kernel benchmark (measurements and bookkeeping) but the kind headers."""
    if isinstance(data, dict):
        if isinstance(data.get("results"), dict) and data.get("schema_version") == BENCH_SCHEMA_VERSION:
            return all_records(data["results"])  # the suite's envelope
        for key in KERNEL_LIST_KEYS:
            if isinstance(data.get(key), list):
                return all_records(data[key])
        return []
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict) and "kind" not in r]
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
        except (OSError, UnicodeDecodeError, ValueError, Plamo2Error) as e:
            skipped.append(_skip(name, f"not readable as JSON ({type(e).__name__})"))
            continue
        kind, reason = classify(data)
        if kind is None:
            skipped.append(_skip(name, reason))
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
        elif _size(doc) > _size(twin):  # keep the fullest: results.json, lm-eval's own, `eval --json`'s digest
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
    # Not a warning per file: the report's Inputs table and --json list every skipped file, and
    # the command's last line counts them (the README promises one line).
    log.info("skipped %s: %s", name, reason)
    return Skipped(name, reason)


def _keys_hint(data: Any) -> str:
    if isinstance(data, dict):
        keys = list(data)[:6]
        return " (keys: " + ", ".join(map(str, keys)) + (", …" if len(data) > 6 else "") + ")"
    return f" (a JSON {type(data).__name__})"
