"""Runtime throughput (`python -m bench throughput`, kind plamo2-bench-throughput; before the suite
plamo2-bench-runtime from bench/runtime.py and bench/gsm8k.py): decode tokens/s per batch size for
each (kernels, CUDA graphs or eager) pair against the weight-read floor measured in the same run,
prefill tokens/s, and (version 1) the GSM8K wall time that `bench accuracy` now reports.

Files whose records carry no `mode` (the first bench/runtime.py: eager only, no floor) render in
the original one-row-per-record table.
"""

from __future__ import annotations

from typing import Any

from .bench import bench_run, payload, run_line
from .bench_accuracy import gsm8k_summary
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, table

# Decode targets of issue 11 (synthetic plamo-2-1b, bf16, one H200), by batch size: shown for 1b runs on
# an H200 only (another card has another floor: the floor column is the measure there).
DECODE_TARGETS = {1: 800.0, 64: 25_000.0, 256: 50_000.0}
TARGET_CARD = "H200"


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Runtime throughput", ""]
    for doc in docs:
        run = bench_run(doc)
        d, targets = payload(doc), TARGET_CARD in str(run.machine.get("card", ""))
        runs = [r for r in d.get("runs", []) if isinstance(r, dict)]
        lines += [f"### {code(doc.name)}", "", *run_line(doc), _header(d), ""]
        if not any("mode" in r for r in runs):
            lines += _legacy_table(runs) + [""]
            continue
        decode = [r for r in runs if r.get("phase") == "decode"]
        prefill = [r for r in runs if r.get("phase") == "prefill"]
        gsm8k = [r for r in runs if r.get("phase") == "gsm8k"]
        if decode:
            targets = targets and (run.label.endswith("1b") or "1b" in str(d.get("shards", "")))
            lines += _decode_table(decode, d, targets) + [""]
        if prefill:
            lines += _prefill_table(prefill) + [""]
        if gsm8k:
            lines += gsm8k_summary(d) + [""]
        if isinstance(d.get("profile_decode"), dict):
            lines += _profile(d["profile_decode"]) + [""]
    return lines


def _legacy_table(runs: list[dict[str, Any]]) -> list[str]:
    speed = {(r.get("backend"), r.get("phase"), r.get("tokens", r.get("batch"))): r.get("tokens_per_s") for r in runs}
    rows = []
    for (backend, phase, size), tps in sorted(speed.items(), key=lambda kv: (str(kv[0][1]), kv[0][2], str(kv[0][0]))):
        other = speed.get(("torch", phase, size)) if backend != "torch" else None
        what = f"T = {size}" if phase == "prefill" else f"batch {size}"
        ratio = f"{tps / other:.2f}×" if is_number(tps) and is_number(other) and other else ""
        rows.append([phase, what, backend, f"{tps:,.1f}" if is_number(tps) else MISSING, ratio])
    return table(["phase", "size", "kernels", "tokens/s", "vs torch"], rows, right=(3, 4))


def _profile(prof: dict[str, Any]) -> list[str]:
    """Per batch size: kernel time and launches per decode step, and the largest kernels."""
    batches = prof.get("batches") or {}
    lines = ["Where a decode step's GPU time goes" + (f" ({prof['how']})" if prof.get("how") else "") + ":", ""]
    rows = []
    for b, v in batches.items():
        top = v.get("top_kernels") or []
        names = "; ".join(f"{k['name'][:40]} {k['us_per_step']:.0f} µs" for k in top[:4] if isinstance(k, dict))
        us, n = v.get("step_gpu_us"), v.get("launches_per_step")
        rows.append([b, f"{us:,.0f}" if is_number(us) else MISSING, f"{n:.0f}" if is_number(n) else MISSING, names])
    return lines + table(["batch", "kernel µs / step", "launches / step", "largest kernels"], rows, right=(0, 1, 2))


def _header(d: dict[str, Any]) -> str:
    parts = [f"shards {code(d.get('shards', '?'))}"]
    if d.get("torch"):  # version 1; the suite's files name their packages in the run line's machine
        parts.append(f"torch {d['torch']}")
    bw = d.get("copy_bandwidth_GBps")
    if is_number(bw):
        parts.append(f"copy {bw:,.0f} GB/s (read + write)")
    floor = d.get("floor") or {}
    if is_number(floor.get("weight_read_ms")):
        parts.append(f"weight-read floor {floor['weight_read_ms']:.3f} ms/step")
    if is_number(d.get("context")):
        parts.append(f"context {d['context']} + {d.get('decode_steps', '?')} decode steps")
    return " · ".join(parts)


def _column(r: dict[str, Any]) -> str:
    return f"{r.get('backend', '?')} {r.get('mode', 'eager')}"


def _tps(value: Any) -> str:
    return f"{value:,.0f}" if is_number(value) else MISSING


def _decode_table(runs: list[dict[str, Any]], d: dict[str, Any], targets: bool) -> list[str]:
    columns = sorted({_column(r) for r in runs}, key=lambda c: (not c.startswith("triton"), "eager" in c, c))
    by = {(r.get("batch"), _column(r)): r for r in runs}
    batches = sorted({r.get("batch") for r in runs if is_number(r.get("batch"))})
    best = columns[0]
    headers = ["batch", *[f"{c} tok/s" for c in columns], "floor tok/s", f"{best} / floor"]
    headers += [f"{best} / {c}" for c in columns[1:]]
    if targets:
        headers.append("target")
    rows = []
    for b in batches:
        first = by.get((b, best), {})
        row: list[Any] = [b, *[_tps(by.get((b, c), {}).get("tokens_per_s")) for c in columns]]
        floor = next((by[(b, c)].get("floor_tokens_per_s") for c in columns if (b, c) in by), None)
        row.append(_tps(floor))
        top = first.get("tokens_per_s")
        row.append(f"{top / floor:.0%}" if is_number(top) and is_number(floor) and floor else MISSING)
        for c in columns[1:]:
            other = by.get((b, c), {}).get("tokens_per_s")
            row.append(f"{top / other:.1f}×" if is_number(top) and is_number(other) and other else MISSING)
        if len(headers) > len(row):
            target = DECODE_TARGETS.get(b)
            row.append(MISSING if target is None else f"≥ {target:,.0f} {'met' if (top or 0) >= target else 'missed'}")
        rows.append(row)
    return ["Decode tokens/s (all sequences together):", "", *table(headers, rows, right=range(len(headers)))]


def _prefill_table(runs: list[dict[str, Any]]) -> list[str]:
    columns = sorted({r.get("backend", "?") for r in runs})
    by = {(r.get("tokens"), r.get("backend", "?")): r.get("tokens_per_s") for r in runs}
    sizes = sorted({r.get("tokens") for r in runs if is_number(r.get("tokens"))})
    headers = ["prefill T", *[f"{c} tok/s" for c in columns]]
    ratio = "triton" in columns and "torch" in columns
    if ratio:
        headers.append("triton / torch")
    rows = []
    for t in sizes:
        row: list[Any] = [t, *[_tps(by.get((t, c))) for c in columns]]
        if ratio:
            a, b = by.get((t, "triton")), by.get((t, "torch"))
            row.append(f"{a / b:.2f}×" if is_number(a) and is_number(b) and b else MISSING)
        rows.append(row)
    return table(headers, rows, right=range(len(headers)))
