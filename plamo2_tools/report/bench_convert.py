"""Convert benchmark (`"kind": "plamo2-bench-convert"`): convert time per TP × PP target against
a plain `cp -r` of the same checkpoint, throughput and peak memory.

The benchmark's schema is young, so fields are found by their usual names (several spellings
each), timing lists are summarised by their median, and whatever else the file holds is shown in
a generic key/value table; a file with no recognisable runs is shown as that table alone.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, flatten, is_number, nbytes, pretty, ratio, seconds, table
from .plots import PALETTE, figure

RUN_LISTS = ("runs", "results", "layouts", "targets", "records", "measurements")
FIELDS = {
    "convert": ("wall_s", "wall_seconds", "convert_s", "convert_seconds", "convert_wall_s", "seconds", "time_s",
                "elapsed_s", "median_s", "wall", "convert"),
    "cp": ("cp_s", "cp_seconds", "cp_wall_s", "cp_r_s", "cp_r_seconds", "cp_r_wall_s", "baseline_s",
           "baseline_seconds", "cp", "cp_r", "baseline"),
    "ratio": ("ratio", "ratio_vs_cp", "vs_cp", "convert_over_cp", "ratio_to_cp", "slowdown"),
    "gbps": ("gbps", "gb_s", "gb_per_s", "throughput_gbps", "gbytes_per_s"),
    "rss": ("peak_rss_bytes", "peak_rss", "max_rss_bytes", "rss_peak_bytes", "maxrss_bytes", "peak_rss_anon_bytes"),
    "checkpoint": ("checkpoint_bytes", "source_bytes", "bytes_total", "total_bytes", "payload_bytes", "bytes"),
    "tensor": ("largest_tensor_bytes", "max_tensor_bytes", "largest_tensor"),
}  # fmt: skip
SHARED = ("cp", "checkpoint", "tensor")  # may be given once at the top level instead of per run
SECONDS_INSIDE = ("wall_s", "seconds", "median_s", "time_s", "s")  # for {"cp": {"seconds": ...}}
HEADERS = ["Layout", "convert", "cp -r", "convert / cp", "GB/s", "peak RSS", "checkpoint", "largest tensor"]


@dataclass
class ConvertRun:
    label: str
    values: dict[str, Any] = field(default_factory=dict)  # FIELDS name -> number (or list of times)
    used: set[str] = field(default_factory=set)  # the run's own keys consumed by the table
    raw: dict[str, Any] = field(default_factory=dict)


def norm(key: Any) -> str:
    """Spellings compare equal after this: "GB/s" -> "gb_s", "Peak RSS" -> "peak_rss"."""
    return re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_")


def lookup(d: dict[str, Any], names: tuple[str, ...]) -> tuple[str | None, Any]:
    """(original key, value) of the first field spelled like one of `names`, in names' order."""
    keys = {norm(k): k for k in d}
    for name in names:
        if name in keys:
            value = d[keys[name]]
            if isinstance(value, dict):  # {"cp": {"seconds": 4.1, ...}}
                _, value = lookup(value, SECONDS_INSIDE)
            if is_number(value) or (isinstance(value, list) and value and all(is_number(v) for v in value)):
                return keys[name], value
    return None, None


def median(value: Any) -> float | None:
    if isinstance(value, list):
        return float(statistics.median(value))
    return float(value) if is_number(value) else None


def run_list(data: dict[str, Any]) -> tuple[str | None, list[tuple[str | None, dict[str, Any]]]]:
    """The list (or name -> run mapping) of per-target runs, with the key it came from."""
    for key in RUN_LISTS:
        value = data.get(key)
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return key, [(None, v) for v in value]
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            return key, [(str(k), v) for k, v in value.items()]
    return None, []


def run_label(name: str | None, run: dict[str, Any], index: int) -> str:
    if run.get("tp") is not None or run.get("pp") is not None:
        return f"TP{run.get('tp', 1)}×PP{run.get('pp', 1)}"
    for key in ("target", "layout", "label", "name"):
        if isinstance(run.get(key), str):
            return run[key]
    return name or f"run {index}"


def extract(data: dict[str, Any]) -> tuple[list[ConvertRun], str | None]:
    key, raw_runs = run_list(data)
    runs = []
    for i, (name, raw) in enumerate(raw_runs, 1):
        run = ConvertRun(run_label(name, raw, i), raw=raw)
        for what, names in FIELDS.items():
            found, value = lookup(raw, names)
            if found is not None:
                run.used.add(found)
            elif what in SHARED:
                _, value = lookup(data, names)  # measured once for all targets (also listed as a field)
            if value is not None:
                run.values[what] = value
        runs.append(run)
    usable = [r for r in runs if "convert" in r.values]
    return usable, key if usable else None


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Convert benchmark", ""]
    for doc in docs:
        lines += ours_section(doc, ctx) if _is_ours(doc.data) else file_section(doc, ctx)
    return lines


def _is_ours(d: Any) -> bool:
    """bench/convert.py's own schema: a baseline block and one result per split."""
    return isinstance(d, dict) and isinstance(d.get("baseline"), dict) and isinstance(d.get("results"), list)


def ours_section(doc: Doc, ctx: Context) -> list[str]:
    d = doc.data
    base, ckpt, targets = d["baseline"], d.get("checkpoint", {}), d.get("targets", {})
    largest = (ckpt.get("largest_tensor") or {}).get("bytes")
    lines = [f"### {code(doc.name)}", ""]
    machine = d.get("machine", {})
    lines += [
        f"{ckpt.get('preset', '?')} checkpoint of {nbytes(ckpt.get('bytes'))}, largest tensor {nbytes(largest)}; "
        f"{machine.get('cpus', '?')} CPUs; page cache {d.get('options', {}).get('cache', '?')}; "
        f"`cp -r` {seconds(base.get('cp_s'))}, `cp -r` + `sync` {seconds(base.get('cp_sync_s'))}; "
        f"sha256 {pretty('gbps', machine.get('sha256_single_thread_GBps'))} GB/s per thread.",
        "",
    ]
    rows = []
    for r in d["results"]:
        met = r.get("targets", {})
        rows.append([
            f"TP{r.get('tp')}×PP{r.get('pp')}", seconds(r.get("wall_s")), ratio(r.get("ratio_vs_cp")),
            ratio(r.get("ratio_vs_cp_sync")), nbytes(r.get("peak_rss_bytes")),
            "yes" if all(met.values()) else "no: " + ", ".join(k for k, v in met.items() if not v),
        ])  # fmt: skip
    headers = ["Layout", "convert", "÷ cp -r", "÷ cp -r + sync", "peak RSS", "targets met"]
    lines += table(headers, rows, right=(1, 2, 3, 4))
    lines += [
        "",
        f"Targets: wall ≤ {targets.get('ratio', 1.5)}× the copy, peak RSS ≤ largest tensor + 512 MiB "
        f"({nbytes(targets.get('peak_rss_bytes'))}). Command: `{d.get('command', '?')}`.",
        "",
    ]
    runs = [
        ConvertRun(f"TP{r.get('tp')}×PP{r.get('pp')}", {"convert": r.get("wall_s"), "cp": base.get("cp_s"),
                                                        "ratio": r.get("ratio_vs_cp")})
        for r in d["results"]
    ]  # fmt: skip
    path = ctx.plot_path("convert-time")
    plot(runs, path, doc.name)
    return lines + [ctx.image(path, f"convert vs cp -r time per layout, {doc.name}"), ""]


def file_section(doc: Doc, ctx: Context) -> list[str]:
    runs, list_key = extract(doc.data)
    lines = [f"### {code(doc.name)}", ""]
    if runs:
        lines += table(HEADERS, [_row(r) for r in runs], right=tuple(range(1, len(HEADERS))))
        lines += [
            "",
            "convert / cp: convert wall time over `cp -r` of the same checkpoint (1.00× = as fast "
            "as copying); GB/s: checkpoint bytes per second of convert; timing lists show their median.",
        ]
        path = ctx.plot_path("convert-time")
        plot(runs, path, doc.name)
        lines += ["", ctx.image(path, f"convert vs cp -r time per layout, {doc.name}")]
    else:
        lines += ["No per-target runs with a convert time were recognised; all fields as found:"]
    other = _other_fields(doc.data, runs, list_key)
    if other:
        lines += ["", *table(["Field", "Value"], other, right=(1,))]
    return lines + [""]


def run_ratio(run: ConvertRun) -> float | None:
    """convert / cp as the benchmark recorded it, else from the two medians."""
    recorded = median(run.values.get("ratio"))
    convert, cp = median(run.values.get("convert")), median(run.values.get("cp"))
    return recorded if recorded is not None else (convert / cp if convert and cp else None)


def _row(run: ConvertRun) -> list[str]:
    v = run.values
    convert, rate = median(v.get("convert")), run_ratio(run)
    gbps = median(v.get("gbps"))
    if gbps is None and convert and is_number(v.get("checkpoint")):
        gbps = v["checkpoint"] / convert / 1e9
    return [run.label, _timing(v.get("convert")), _timing(v.get("cp")), ratio(rate) if rate is not None else MISSING,
            f"{gbps:.2f}" if gbps is not None else MISSING, nbytes(v.get("rss")), nbytes(v.get("checkpoint")),
            nbytes(v.get("tensor"))]  # fmt: skip


def _timing(value: Any) -> str:
    if isinstance(value, list) and len(value) > 1:
        return f"{seconds(median(value))} (median of {len(value)}, {min(value):.3f}–{max(value):.3f})"
    return seconds(median(value)) if value is not None else MISSING


def _other_fields(data: dict[str, Any], runs: list[ConvertRun], list_key: str | None) -> list[list[str]]:
    rows = [[k, pretty(k, v)] for k, v in flatten({k: v for k, v in data.items() if k not in ("kind", list_key)})]
    for run in runs:  # fields of a run that the main table did not show
        rest = {k: v for k, v in run.raw.items() if k not in run.used and k not in ("tp", "pp", "target", "layout")}
        rows += [[f"{run.label}: {k}", pretty(k, v)] for k, v in flatten(rest)]
    return rows


def plot(runs: list[ConvertRun], path: Any, title: str) -> None:
    convert = [median(r.values.get("convert")) or 0.0 for r in runs]
    cp = [median(r.values.get("cp")) for r in runs]
    has_cp = any(c is not None for c in cp)
    width = 0.38 if has_cp else 0.6
    with figure(path) as (ax,):
        xs = list(range(len(runs)))
        left = [x - width / 2 for x in xs] if has_cp else xs
        bars = ax.bar(left, convert, width, color=PALETTE[0], label="convert")
        if has_cp:
            ax.bar([x + width / 2 for x in xs], [c or 0.0 for c in cp], width, color=PALETTE[6], label="cp -r")
        for bar, conv, run in zip(bars, convert, runs, strict=True):
            rate = run_ratio(run)
            text = f"{conv:.2f} s" + (f"\n{rate:.2f}× cp" if rate is not None else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")  # fmt: skip
        ax.set_xticks(xs, [r.label for r in runs])
        ax.set_ylabel("wall time (s)")
        ax.set_ylim(0, max(convert + [c or 0.0 for c in cp] + [1e-9]) * 1.3)
        ax.set_title(f"Convert vs cp -r: {title}")
        ax.legend(loc="upper left", fontsize=8)
