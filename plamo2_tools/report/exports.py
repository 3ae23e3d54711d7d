"""Exports (issue 31): what `plamo2-tools export` recorded beside each output (`plamo2_export.json`,
or its --json: the format, the quantization, what the target runtime is known to do differently and
the verification measured against the reference), and the export benchmarks (bench/export_mlx.py,
bench/export_fp8.py, bench/gguf_export.py: time against `cp -r`, peak memory).  A GGUF export's
record is `OUT.gguf.plamo2-export.json` beside the file."""

from __future__ import annotations

from typing import Any

from .context import Context
from .inputs import BENCH_EXPORT_FP8, BENCH_EXPORT_GGUF, BENCH_EXPORT_MLX, EXPORT_FP8, EXPORT_GGUF, EXPORT_MLX, Doc
from .markdown import MISSING, code, nbytes, num, sci, seconds, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Exports", ""]
    for kind, title, make in (
        (EXPORT_MLX, "export mlx, verified with mlx-lm", mlx_table),
        (EXPORT_FP8, "export fp8, verified by construction (the export read back against its source)", fp8_table),
        (EXPORT_GGUF, "export gguf, verified with llama.cpp (judged as `verify` judges)", gguf_table),
        (BENCH_EXPORT_MLX, "export mlx vs cp -r", mlx_bench_table),
        (BENCH_EXPORT_FP8, "export fp8: time and memory", fp8_bench_table),
        (BENCH_EXPORT_GGUF, "export gguf vs cp and llama.cpp's convert_hf_to_gguf.py", gguf_bench_table),
    ):
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


def mlx_table(docs: list[Doc]) -> list[str]:
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


def mlx_bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for preset, entry in doc.data["presets"].items():
            for name, r in (entry.get("runs") or {}).items():
                rows.append([code(doc.name), preset, name, seconds(r.get("wall_s")), num(r.get("vs_cp"), ".2f"),
                             nbytes(r.get("peak_rss_bytes")), nbytes(r.get("bytes"))])  # fmt: skip
    return table(["File", "preset", "run", "time", "vs cp", "peak RSS", "written"], rows, right=(3, 4, 5, 6))


def fp8_table(docs: list[Doc]) -> list[str]:
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


def fp8_bench_table(docs: list[Doc]) -> list[str]:
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


def gguf_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        v = d.get("verify") if isinstance(d.get("verify"), dict) else None
        first = (v or {}).get("first_divergence")
        where = MISSING if v is None else "none" if not first else f"prompt {first['prompt']} pos {first['position']}"
        verdict = "not run" if v is None else "passed" if v.get("verdict") == "pass" else "DIVERGED"
        rows.append([code(doc.name), num(d.get("type")), ", ".join(d.get("tensor_types") or []) or "-",
                     num(d.get("tensors"), "d"), nbytes(d.get("bytes")), verdict,
                     num((v or {}).get("precision")), num((v or {}).get("follows")), sci((v or {}).get("mean_kl")),
                     sci((v or {}).get("max_kl")), num((v or {}).get("top1_agreement"), ".3f"), where])  # fmt: skip
    headers = ["File", "type", "--tensor-type", "tensors", "size", "verdict", "judged as", "follows", "mean KL",
               "max KL", "top-1", "first divergence"]  # fmt: skip
    return table(headers, rows, right=(3, 4, 8, 9, 10))


def gguf_bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        cp = d["cp"]
        for name in ("cp", "ours", "llama_cpp_convert"):
            r = d.get(name)
            if not isinstance(r, dict):
                continue
            ratio = r.get("seconds") / cp["seconds"] if cp.get("seconds") and r.get("seconds") else None
            rows.append([code(doc.name), num(d.get("preset")), num(d.get("type")), name, seconds(r.get("seconds")),
                         num(ratio, ".2f"), num(r.get("peak_rss_mib"), ".0f")])  # fmt: skip
    return table(["File", "preset", "type", "run", "time", "vs cp", "peak RSS (MiB)"], rows, right=(4, 5, 6))
