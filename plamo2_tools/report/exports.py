"""Exports: what `export mlx` recorded (OUT/plamo2_export.json or its --json: the format, the
quantization, the mlx-lm differences it predicted and the verification it measured) and the
export benchmark (bench/export_mlx.py: time against `cp -r`, peak memory)."""

from __future__ import annotations

from typing import Any

from .context import Context
from .inputs import BENCH_EXPORT, EXPORT, Doc
from .markdown import MISSING, code, nbytes, num, sci, seconds, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Exports", ""]
    for kind, title, make in ((EXPORT, "export mlx, verified with mlx-lm", export_table),
                              (BENCH_EXPORT, "export mlx vs cp -r", bench_table)):  # fmt: skip
        chosen = [d for d in docs if d.kind == kind]
        if chosen:
            lines += [f"### {title}", "", *make(chosen), ""]
    return lines


def _format(d: dict[str, Any]) -> str:
    q = d.get("quantization")
    if isinstance(q, dict):
        return f"{num(q.get('bits'))}-bit g{num(q.get('group_size'))}" + (" mixed" if d.get("mixed") else "")
    dtype = d.get("dtype")
    return ",".join(map(str, dtype)) if isinstance(dtype, list) else num(dtype)


def export_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        v = d.get("verification") if isinstance(d.get("verification"), dict) else None
        run = (v.get("runs") or {}).get(v.get("follows") or "") if v else None
        if v and run is None and v.get("runs"):
            run = min(v["runs"].values(), key=lambda r: r.get("mean_kl", float("inf")))
        first = (run or {}).get("first_divergence")
        where = MISSING if not run else "none" if first is None else f"prompt {first['prompt']} pos {first['position']}"
        verdict = "not run" if v is None else "passed" if v.get("passed") else "DIVERGED"
        rows.append([code(doc.name), num(d.get("model_type")), _format(d), num(d.get("bits_per_weight"), ".2f"),
                     ", ".join(x.get("key", "?") for x in d["known_differences"]) or "none", verdict,
                     num(v.get("follows")) if v else MISSING, sci((run or {}).get("mean_kl")),
                     num((run or {}).get("top1_agreement"), ".3f"), where])  # fmt: skip
    headers = ["File", "model", "format", "bits/weight", "mlx-lm differs in", "verdict", "follows", "mean KL",
               "top-1", "first divergence"]  # fmt: skip
    return table(headers, rows, right=(3, 7, 8))


def bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for preset, entry in doc.data["presets"].items():
            for name, r in (entry.get("runs") or {}).items():
                rows.append([code(doc.name), preset, name, seconds(r.get("wall_s")), num(r.get("vs_cp"), ".2f"),
                             nbytes(r.get("peak_rss_bytes")), nbytes(r.get("bytes"))])  # fmt: skip
    return table(["File", "preset", "run", "time", "vs cp", "peak RSS", "written"], rows, right=(3, 4, 5, 6))
