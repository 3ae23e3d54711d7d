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
        (
            EXPORT_FP8,
            "export fp8, verified by construction (`verify`'s fp8 target: the export read back, run as W8A8)",
            fp8_table,
        ),
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


def judged(v: dict[str, Any] | None) -> dict[str, Any]:
    """The verdict and figures of an export's `verification`: schema 3 holds `verify`'s own result
    (deploy/verify.py, one target); schema 1 records (the exports' earlier own judges) are read too."""
    if not isinstance(v, dict):
        return {"verdict": "not run"}
    verdict = "passed" if v.get("passed") else "DIVERGED"
    if isinstance(v.get("targets"), list):  # schema 3
        if not v["targets"]:
            return {"verdict": verdict, "first": v.get("error")}
        t = v["targets"][0]
        label = (t.get("follows") or [None])[0] or next(iter(t.get("conventions") or {"": None}))
        r = (t.get("conventions") or {}).get(label) or {}
        main = r.get("teacher_forced") or r.get("greedy") or {}
        first = t.get("first_divergence") or (r.get("first_divergence") if not t.get("passed") else None)
        return {
            "verdict": verdict,
            "follows": label if t.get("follows") else None,
            "mean_kl": main.get("mean_kl"),
            "max_kl": main.get("max_kl"),
            "top1": main.get("top1_agreement"),
            "positions": main.get("positions"),
            "precision": t.get("precision"),
            "first": "none" if first is None else f"prompt {first['prompt']} pos {first['position']}",
        }
    runs = v.get("runs") or {}  # schema 1, mlx
    run = runs.get(v.get("follows") or "") or (
        min(runs.values(), key=lambda r: r.get("mean_kl", 1e300)) if runs else {}
    )
    if "variants" in v:  # schema 1, fp8
        run = {**v["variants"].get("w8a8", {}), "mean_kl": v.get("kl_mean")}
        run["max_kl"] = run.get("kl_max")
    first = run.get("first_divergence")
    where = "none" if first is None or isinstance(first, list) else f"prompt {first['prompt']} pos {first['position']}"
    return {
        "verdict": verdict,
        "follows": v.get("follows"),
        "mean_kl": run.get("mean_kl"),
        "max_kl": run.get("max_kl"),
        "top1": run.get("top1_agreement"),
        "positions": run.get("positions"),
        "first": where,
    }


def mlx_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        j = judged(d.get("verification"))
        rows.append(
            [
                code(doc.name),
                num(d.get("model_type")),
                _format(d),
                num(d.get("bits_per_weight"), ".2f"),
                ", ".join(x.get("key", "?") for x in d["known_differences"]) or "none",
                j["verdict"],
                num(j.get("follows")),
                sci(j.get("mean_kl")),
                num(j.get("top1"), ".3f"),
                num(j.get("first")),
            ]
        )
    headers = [
        "File",
        "model",
        "format",
        "bits/weight",
        "mlx-lm differs in",
        "verdict",
        "follows",
        "mean KL",
        "top-1",
        "first divergence",
    ]
    return table(headers, rows, right=(3, 7, 8))


def mlx_bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for preset, entry in doc.data["presets"].items():
            for name, r in (entry.get("runs") or {}).items():
                rows.append(
                    [
                        code(doc.name),
                        preset,
                        name,
                        seconds(r.get("wall_s")),
                        num(r.get("vs_cp"), ".2f"),
                        nbytes(r.get("peak_rss_bytes")),
                        nbytes(r.get("bytes")),
                    ]
                )
    return table(["File", "preset", "run", "time", "vs cp", "peak RSS", "written"], rows, right=(3, 4, 5, 6))


def fp8_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        j = judged(d.get("verification"))
        rows.append(
            [
                code(doc.name),
                num(d["format"]),
                num(d.get("scheme")),
                num(d.get("family")),
                str(len(d.get("quantized") or [])),
                nbytes(d.get("output_weight_bytes")),
                j["verdict"],
                sci(j.get("mean_kl")),
                sci(j.get("max_kl")),
                num(j.get("top1"), ".3f"),
                num(j.get("positions"), "d") if j.get("positions") is not None else MISSING,
                num(j.get("first")),
                num(d.get("max_kl")),
            ]
        )
    headers = [
        "File",
        "format",
        "scheme",
        "family",
        "linears quantized",
        "weights",
        "verdict",
        "mean KL (w8a8)",
        "max KL (w8a8)",
        "top-1 agreement (w8a8)",
        "positions",
        "first divergence",
        "--max-kl",
    ]
    return table(headers, rows, right=(4, 5, 7, 8, 9, 10))


def fp8_bench_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        cp = d["baseline"]
        for r in d["results"]:
            rows.append(
                [
                    code(doc.name),
                    num(d.get("preset")),
                    num(r.get("what")),
                    seconds(r.get("seconds")),
                    num(r.get("seconds") / cp["seconds"] if cp.get("seconds") else None, ".2f"),
                    nbytes(r.get("peak_rss_bytes")),
                    nbytes(r.get("bytes_written")),
                ]
            )
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
        rows.append(
            [
                code(doc.name),
                num(d.get("type")),
                ", ".join(d.get("tensor_types") or []) or "-",
                num(d.get("tensors"), "d"),
                nbytes(d.get("bytes")),
                verdict,
                num((v or {}).get("precision")),
                num((v or {}).get("follows")),
                sci((v or {}).get("mean_kl")),
                sci((v or {}).get("max_kl")),
                num((v or {}).get("top1_agreement"), ".3f"),
                where,
            ]
        )
    headers = [
        "File",
        "type",
        "--tensor-type",
        "tensors",
        "size",
        "verdict",
        "judged as",
        "follows",
        "mean KL",
        "max KL",
        "top-1",
        "first divergence",
    ]
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
            rows.append(
                [
                    code(doc.name),
                    num(d.get("preset")),
                    num(d.get("type")),
                    name,
                    seconds(r.get("seconds")),
                    num(ratio, ".2f"),
                    num(r.get("peak_rss_mib"), ".0f"),
                ]
            )
    return table(["File", "preset", "type", "run", "time", "vs cp", "peak RSS (MiB)"], rows, right=(4, 5, 6))
