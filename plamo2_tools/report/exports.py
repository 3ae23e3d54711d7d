"""Exports (issue 31): what `plamo2-tools export` wrote and measured (`plamo2_export.json` beside each export:
the verification figures of the output against its source), and the export benchmark (bench/export_fp8.py)."""

from __future__ import annotations

from typing import Any

from .context import Context
from .inputs import BENCH_EXPORT, EXPORT, Doc
from .markdown import code, nbytes, num, sci, seconds, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Exports", ""]
    made = [d for d in docs if d.kind == EXPORT]
    if made:
        lines += ["### Verified by construction (the export read back against its source)", "",
                  *export_table(made), ""]  # fmt: skip
    bench = [d for d in docs if d.kind == BENCH_EXPORT]
    if bench:
        lines += ["### Export time and memory", "", *bench_table(bench), ""]
    return lines


def export_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        v: dict[str, Any] = d.get("verification") or {}
        variants = v.get("variants") or {}
        w, a = variants.get("weights") or {}, variants.get("w8a8") or {}
        rows.append([code(doc.name), num(d["format"]), num(d.get("scheme")), num(d.get("family")),
                     str(len(d.get("quantized") or [])), nbytes(d.get("output_weight_bytes")),
                     sci(w.get("kl_mean")), sci(a.get("kl_mean")), sci(a.get("kl_max")),
                     num(a.get("top1_agreement"), ".3f"), num(a.get("positions"), "d") if a else "not verified",
                     num(d.get("max_kl"))])  # fmt: skip
    headers = ["File", "format", "scheme", "family", "linears quantized", "weights", "mean KL (weights only)",
               "mean KL (w8a8)", "max KL (w8a8)", "top-1 agreement (w8a8)", "positions", "--max-kl"]  # fmt: skip
    return table(headers, rows, right=(4, 5, 6, 7, 8, 9, 10))


def bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        cp = d["baseline"]
        for r in d["results"]:
            rows.append([code(doc.name), num(d.get("preset")), num(r.get("what")), seconds(r.get("seconds")),
                         num(r.get("seconds") / cp["seconds"] if cp.get("seconds") else None, ".2f"),
                         nbytes(r.get("peak_rss_bytes")), nbytes(r.get("bytes_written"))])  # fmt: skip
    headers = ["File", "preset", "run", "time", "vs cp", "peak RSS", "written"]
    return table(headers, rows, right=(3, 4, 5, 6))
