"""Convert benchmark (`"kind": "plamo2-bench-convert"`, written by `python -m bench convert`): convert wall
time per TP × PP split against `cp -r` (and `cp -r` + `sync`) of the same checkpoint measured in
the same run, peak memory, and whether the targets were met; where the file has them, where the
time went (Python start-up vs the conversion itself, CPU) and how the bytes were copied, and the
cost of checking Hugging Face cache blobs' sha256."""

from __future__ import annotations

from typing import Any

from .bench import bench_run, payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import code, nbytes, pretty, ratio, seconds, table
from .plots import PALETTE, figure

HEADERS = ["Layout", "convert", "÷ cp -r", "÷ cp -r + sync", "peak RSS", "targets met"]
DETAIL_HEADERS = [
    "Layout",
    "options",
    "inside",
    "start-up",
    "CPU user + sys",
    "kernel copy",
    "user copy",
    "gather",
    "compute",
]


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Convert benchmark", ""]
    for doc in docs:
        lines += file_section(doc, ctx)
    return lines


def file_section(doc: Doc, ctx: Context) -> list[str]:
    d, run = payload(doc), bench_run(doc)
    base, ckpt, targets = d["baseline"], d.get("checkpoint", {}), d.get("targets", {})
    machine = {**run.machine, **(d.get("hash_rates") or {})}  # a version-1 file kept the rates in "machine"
    largest = (ckpt.get("largest_tensor") or {}).get("bytes")
    lines = [
        f"### {code(doc.name)}",
        "",
        *run_line(doc),
        f"{ckpt.get('preset', '?')} checkpoint of {nbytes(ckpt.get('bytes'))}, largest tensor {nbytes(largest)}; "
        f"{machine.get('cpus', '?')} CPUs; page cache {d.get('options', {}).get('cache', '?')}; "
        f"`cp -r` {seconds(base.get('cp_s'))}, `cp -r` + `sync` {seconds(base.get('cp_sync_s'))}; "
        f"sha256 {pretty('gbps', machine.get('sha256_single_thread_GBps'))} GB/s per thread"
        + (
            f", xxh3-128 {pretty('gbps', machine['xxh3_128_single_thread_GBps'])} GB/s"
            if "xxh3_128_single_thread_GBps" in machine
            else ""
        )
        + (
            f"; load {machine['loadavg_before'][0]:.1f} before, {machine['loadavg_after'][0]:.1f} after"
            if machine.get("loadavg_before") and machine.get("loadavg_after")
            else ""
        )
        + ".",
        "",
    ]
    rows = []
    for r in d["results"]:
        met = r.get("targets", {})
        missed = [k for k, v in met.items() if not v]
        rows.append(
            [
                _layout(r),
                seconds(r.get("wall_s")),
                ratio(r.get("ratio_vs_cp")),
                ratio(r.get("ratio_vs_cp_sync")),
                nbytes(r.get("peak_rss_bytes")),
                "no: " + ", ".join(missed) if missed else "yes",
            ]
        )
    lines += table(HEADERS, rows, right=(1, 2, 3, 4))
    lines += _details(d)
    lines += [
        "",
        f"Targets: wall ≤ {targets.get('ratio', 1.5)}× `cp -r`, peak RSS ≤ largest tensor + 512 MiB "
        f"({nbytes(targets.get('peak_rss_bytes'))}).",
        "",
    ]
    path = ctx.plot_path("convert-time")
    plot(d["results"], base.get("cp_s"), base.get("cp_sync_s"), path, doc.name)
    return lines + [ctx.image(path, f"convert vs cp -r time per layout, {doc.name}"), ""]


def _details(d: dict[str, Any]) -> list[str]:
    """Where the time went and how the bytes were made (files from bench/convert.py that say so)."""
    results = [r for r in d["results"] if r.get("convert_seconds") is not None and r.get("copy")]
    lines: list[str] = []
    if results:
        rows = []
        for r in results:
            made = r["copy"].get("bytes", {})
            rows.append(
                [
                    f"TP{r.get('tp')}×PP{r.get('pp')}",
                    code(r["options"]) if r.get("options") else "",
                    seconds(r["convert_seconds"]),
                    seconds(r["wall_s"] - r["convert_seconds"]),
                    f"{seconds(r.get('user_s'))} + {seconds(r.get('sys_s'))}",
                    nbytes(made.get("copy_file_range", 0) + made.get("sendfile", 0)),
                    nbytes(made.get("user")),
                    nbytes(made.get("gather")),
                    nbytes(made.get("compute")),
                ]
            )
        lines += [
            "",
            "Where the time goes (medians; *inside* is the conversion, *start-up* the Python and PyTorch "
            "imports before it):",
            "",
        ]
        lines += table(DETAIL_HEADERS, rows, right=(2, 3, 4, 5, 6, 7, 8))
    blob = d.get("blob_check")
    if blob:
        lines += [
            "",
            f"Hugging Face cache layout, {blob['split']}: {seconds(blob['verify_blobs_s'])} with "
            f"`--verify-blobs` (sha256 of every blob against its name), {seconds(blob['no_verify_blobs_s'])} "
            "without.",
        ]
    return lines


def _layout(r: dict[str, Any]) -> str:
    """TP2×PP1, with a variant's options after it."""
    return f"TP{r.get('tp')}×PP{r.get('pp')}" + (f" {code(r['options'])}" if r.get("options") else "")


def plot(results: list[dict[str, Any]], cp: float | None, cp_sync: float | None, path: Any, title: str) -> None:
    """Convert time per layout as bars, the two copy baselines as horizontal lines."""
    results = [r for r in results if not r.get("options")]  # the plain runs; variants are in the table
    walls = [float(r.get("wall_s") or 0.0) for r in results]
    with figure(path) as (ax,):
        xs = list(range(len(results)))
        bars = ax.bar(xs, walls, 0.5, color=PALETTE[0], label="convert")
        for bar, r in zip(bars, results, strict=True):
            text = f"{r.get('wall_s', 0):.2f} s\n{r.get('ratio_vs_cp', 0):.2f}× cp"
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        for value, label, style in ((cp, "cp -r", "--"), (cp_sync, "cp -r + sync", ":")):
            if value:
                ax.axhline(value, color=PALETTE[6], linestyle=style, label=f"{label} ({value:.1f} s)")
        ax.set_xticks(xs, [_layout(r) for r in results])
        ax.set_ylabel("wall time (s)")
        ax.set_ylim(0, max(walls + [cp or 0.0, cp_sync or 0.0, 1e-9]) * 1.3)
        ax.set_title(f"Convert vs cp -r: {title}")
        ax.legend(loc="upper left", fontsize=8)
