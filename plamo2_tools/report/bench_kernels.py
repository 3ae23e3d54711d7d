"""GPU kernel benchmark: `python -m bench kernels` output (`"kind": "plamo2-bench-kernels"`): the
suite's envelope with results = {"env", "records"}; before the suite (version 1), kernels.json =
{"kind", "schema_version", "env", "records"}, or the streamed kernels.jsonl, whose runs each start
with a {"kind", "schema_version"} line.

Per kernel, our implementations against their peers shape by shape, a correctness digest, and a
plot of our speed-up over the fastest peer.  Records need only "kernel" and "impl"; everything
else is found under a few spellings (ms_p50 / median_ms, GBps / gbps, frac_copy / frac_bw, ...),
and the fields that are not measurements make up the shape.  A measurement repeated in a stream
(a rerun appended to the same kernels.jsonl) counts once: the later one wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .bench import payload, run_line
from .context import Context
from .inputs import KERNEL_LIST_KEYS, Doc, all_records, is_kernel_record, kernel_records
from .markdown import MISSING, code, flatten, is_number, num, pretty, sci, table
from .plots import PALETTE, figure

OURS_PREFIXES = ("ours", "triton", "plamo2")  # our kernels are the Triton ones; "torch" is our plain reference path
MS = ("ms_p50", "median_ms", "p50_ms", "ms", "time_ms")
US = ("median_us", "p50_us", "us", "time_us")
P20, P80 = ("ms_p20", "p20_ms", "q20_ms"), ("ms_p80", "p80_ms", "q80_ms")
GBPS = ("GBps", "gbps", "gb_s", "bandwidth_gbps")
FRAC_BW = ("frac_copy", "frac_bw", "bw_frac", "frac_peak_bw")
TFLOPS = ("TFLOPs", "tflops", "tflop_s")
REL_ERR = ("rel_err", "max_rel_err", "rel_error")
FIRST_CALL = ("first_call_s",)
NOTES = ("error", "skipped", "skip", "note", "reason")
GRAPH = {"ms": "graph_ms_p50", "p20": "graph_ms_p20", "p80": "graph_ms_p80", "gbps": "graph_GBps"}
# Record fields that are not part of the problem shape.
NOT_SHAPE = {
    "kernel",
    "impl",
    "section",
    "t",
    "mode",
    "timing",
    "graph",
    "cudagraph",
    "shape",
    "ok",
    "peer",
    "ours",
    "config",
    "frac_matmul",
    "ours_over_peer_time",
    "what",
    "seconds",
    "kind",
    *MS,
    *US,
    *P20,
    *P80,
    *GBPS,
    *FRAC_BW,
    *TFLOPS,
    *REL_ERR,
    *FIRST_CALL,
    *NOTES,
    *GRAPH.values(),
}
LEGEND = (
    "ours / impl: the fastest of our implementations (Triton) over this one, median times; below 1.00× ours is "
    "faster. % BW: share of the measured device copy bandwidth. p20–p80: spread over repetitions. In the plot, "
    "bars above 1× mean ours is faster than the fastest peer."
)
DENSE_BARS = 8  # above this many bars in a panel, labels drop the peer name (the table has it)
MIN_SLOTS = 4  # bar slots per plot panel, however few shapes there are
SHAPE_TEXT_MAX = 40  # longer strings (autotune configs, messages) are details, not shape


@dataclass(frozen=True)
class Measurement:
    kernel: str
    impl: str
    shape: str
    mode: str | None
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    gbps: float | None = None
    frac_bw: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    first_call_s: float | None = None
    note: str | None = None

    @property
    def ours(self) -> bool:
        return is_ours(self.impl)


@dataclass(frozen=True)
class Check:
    kernel: str
    impl: str
    dtype: str
    shape: str
    rel_err: float | None
    ok: bool | None


def is_ours(impl: str) -> bool:
    return impl.lower().startswith(OURS_PREFIXES)


def first(record: dict[str, Any], names: tuple[str, ...]) -> float | None:
    for name in names:
        if is_number(record.get(name)):
            return float(record[name])
    return None


def _value_text(value: Any) -> str:
    return str(value).removeprefix("torch.")  # JSON records may hold "torch.bfloat16"


def shape_label(record: dict[str, Any]) -> str:
    """An explicit "shape" (dict, list or text), else the record's remaining scalar fields."""
    shape = record.get("shape")
    if isinstance(shape, dict):
        text = " ".join(f"{k}={_value_text(v)}" for k, v in shape.items())
    elif isinstance(shape, list):
        text = "×".join(map(str, shape))
    elif shape is not None:
        text = str(shape)
    else:
        text = " ".join(
            f"{k}={_value_text(v)}"
            for k, v in record.items()
            if k not in NOT_SHAPE and k != "dtype" and _is_shape_value(v)
        )
    if isinstance(record.get("dtype"), str):
        text = f"{text} {_value_text(record['dtype'])}".strip()
    return text or MISSING


def _is_shape_value(value: Any) -> bool:
    return is_number(value) or (isinstance(value, str) and len(value) <= SHAPE_TEXT_MAX and ":" not in value)


def _note(record: dict[str, Any]) -> str | None:
    return next((f"{k}: {record[k]}" for k in NOTES if record.get(k) not in (None, False, "")), None)


def to_measurements(record: dict[str, Any]) -> list[Measurement]:
    """One measurement per timing mode: eager timings, plus CUDA-graph ones when the record has them."""
    ms = first(record, MS)
    if ms is None and first(record, US) is not None:
        ms = first(record, US) / 1000  # type: ignore[operator]
    mode = record.get("mode", record.get("timing"))
    if mode is None and isinstance(record.get("graph", record.get("cudagraph")), bool):
        mode = "graph" if record.get("graph", record.get("cudagraph")) else "eager"
    base = Measurement(
        str(record["kernel"]),
        "ours" if record.get("ours") is True else str(record["impl"]),
        shape_label(record),
        None if mode is None else str(mode),
        ms,
        first(record, P20),
        first(record, P80),
        first(record, GBPS),
        first(record, FRAC_BW),
        first(record, TFLOPS),
        first(record, REL_ERR),
        first(record, FIRST_CALL),
        _note(record),
    )
    if not is_number(record.get(GRAPH["ms"])):
        return [base]
    graph = replace(
        base,
        mode="graph",
        median_ms=float(record[GRAPH["ms"]]),
        p20_ms=first(record, (GRAPH["p20"],)),
        p80_ms=first(record, (GRAPH["p80"],)),
        gbps=first(record, (GRAPH["gbps"],)),
        frac_bw=None,
        tflops=None,
        first_call_s=None,
    )
    return [replace(base, mode=base.mode or "eager"), graph]


def is_check(record: dict[str, Any]) -> bool:
    no_timing = first(record, MS + US) is None
    return record.get("section") == "check" or (no_timing and "ok" in record and first(record, REL_ERR) is not None)


def parse(data: Any) -> tuple[list[Measurement], list[Check], list[dict[str, Any]]]:
    """(measurements, correctness checks, skipped-for-budget records) of one file."""
    latest: dict[tuple[str, str, str | None, str], Measurement] = {}
    checks: dict[tuple[str, str, str], Check] = {}
    skipped = []
    for record in kernel_records(data):
        if is_check(record):
            c = Check(
                str(record["kernel"]),
                str(record["impl"]),
                _value_text(record.get("dtype", MISSING)),
                shape_label({k: v for k, v in record.items() if k != "dtype"}),
                first(record, REL_ERR),
                record.get("ok") if isinstance(record.get("ok"), bool) else None,
            )
            checks[(c.kernel, c.impl, c.dtype + c.shape)] = c
        elif record.get("section") == "skip":
            skipped.append(record)
        elif record.get("section") in (None, "perf"):
            for m in to_measurements(record):
                latest[(m.kernel, m.shape, m.mode, m.impl)] = m  # the first key position, the last value
    found = list(latest.values())
    return _default_modes(found), list(checks.values()), skipped


def _default_modes(found: list[Measurement]) -> list[Measurement]:
    """Within a kernel that has CUDA-graph timings, plain timings are the eager ones."""
    moded = {m.kernel for m in found if m.mode is not None}
    return [replace(m, mode="eager") if m.mode is None and m.kernel in moded else m for m in found]


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Kernel benchmark", ""]
    for doc in docs:
        lines += file_section(doc, ctx)
    return lines


def file_section(doc: Doc, ctx: Context) -> list[str]:
    data = payload(doc)
    found, checks, skipped = parse(data)
    lines = [f"### {code(doc.name)}", ""] + run_line(doc) + meta_table(data)
    for what, error in (kernel_meta(data).get("section error") or {}).items():
        ctx.warn(f"kernel benchmark {code(doc.name)}: section {what} failed: {error}")
    if checks:
        lines += ["#### Correctness", ""] + check_table(checks) + [""]
        bad = [c for c in checks if c.ok is False]
        if bad:
            ctx.warn(f"kernel benchmark {code(doc.name)}: {len(bad)} correctness check(s) failed")
    kernels = list(dict.fromkeys(m.kernel for m in found))
    for kernel in kernels:
        lines += [f"#### {kernel}", ""] + kernel_table([m for m in found if m.kernel == kernel]) + [""]
    if found:
        lines += [LEGEND, ""]
    if skipped:
        lines += [f"{len(skipped)} measurement(s) were skipped for lack of time budget.", ""]
    speedups = {k: v for k in kernels if (v := speedup_rows([m for m in found if m.kernel == k]))}
    if speedups:
        path = ctx.plot_path("kernels")
        plot(speedups, path)
        lines += [ctx.image(path, f"speed-up of ours over the fastest peer, {doc.name}"), ""]
    elif found:
        lines += ["(No shape has both our timing and a peer's, so there is no speed-up plot.)", ""]
    return lines


def kernel_meta(data: Any) -> dict[str, Any]:
    """Everything that is not a measurement: device and versions ("env"), per-section seconds
    ("done"), totals ("final"), section errors, and plain header lines of a stream."""
    meta: dict[str, Any] = {}
    if isinstance(data, dict) and not is_kernel_record(data):
        meta.update({k: v for k, v in data.items() if k not in (*KERNEL_LIST_KEYS, "kind", "schema_version")})
    for r in all_records(data):
        if is_kernel_record(r):
            continue
        section, fields = r.get("section"), {k: v for k, v in r.items() if k not in ("section", "t", "kind")}
        if section == "env":
            meta["env"] = {**fields, **(meta.get("env") or {})}
        elif section == "done":
            meta.setdefault("section seconds", {})[str(r.get("what"))] = r.get("seconds")
        elif section in ("error", "skip"):
            meta.setdefault(f"section {section}", {})[str(r.get("what"))] = r.get("error", r.get("reason"))
        elif section == "final":
            meta["final"] = fields
        elif section is None:
            meta.update(fields)
    return meta


def meta_table(data: Any) -> list[str]:
    """The kernel_meta fields as a key/value table; long multi-line text (nvidia-smi) is left out."""
    rows = []
    for key, value in flatten(kernel_meta(data)):
        if isinstance(value, str) and "\n" in value:
            value = f"({value.count(chr(10)) + 1} lines, not shown)"
        rows.append([key, pretty(key, value)])
    return (table(["Field", "Value"], rows, right=(1,)) + [""]) if rows else []


def check_table(checks: list[Check]) -> list[str]:
    """The worst case per kernel / implementation / dtype, like bench/kernels.py's own summary."""
    worst: dict[tuple[str, str, str], list[Check]] = {}
    for c in checks:
        worst.setdefault((c.kernel, c.impl, c.dtype), []).append(c)
    rows = []
    for (kernel, impl, dtype), cases in sorted(worst.items()):
        top = max(cases, key=lambda c: -1.0 if c.rel_err is None else c.rel_err)
        ok = all(c.ok is not False for c in cases)
        rows.append(
            [
                kernel,
                impl,
                dtype,
                str(len(cases)),
                sci(top.rel_err),
                top.shape,
                "ok" if ok else f"**FAIL** ({sum(c.ok is False for c in cases)})",
            ]
        )
    return table(["Kernel", "Impl", "dtype", "Cases", "worst rel err", "worst case", "Result"], rows, right=(3, 4))


def _groups(found: list[Measurement]) -> dict[tuple[str, str | None], list[Measurement]]:
    """(shape, mode) -> measurements with ours first, then the peers, each by name."""
    groups: dict[tuple[str, str | None], list[Measurement]] = {}
    for m in found:
        groups.setdefault((m.shape, m.mode), []).append(m)
    return {k: sorted(v, key=lambda m: (not m.ours, m.impl)) for k, v in groups.items()}


def _best(group: list[Measurement], ours: bool) -> Measurement | None:
    timed = [m for m in group if m.ours == ours and m.median_ms]
    return min(timed, key=lambda m: (m.median_ms, m.impl)) if timed else None


COLUMNS = (
    "Shape",
    "Mode",
    "Impl",
    "median ms",
    "p20–p80 ms",
    "GB/s",
    "% BW",
    "TFLOP/s",
    "rel err",
    "1st call s",
    "ours / impl",
    "Note",
)
NUMERIC = {"median ms", "p20–p80 ms", "GB/s", "% BW", "TFLOP/s", "rel err", "1st call s", "ours / impl"}


def kernel_table(found: list[Measurement]) -> list[str]:
    present = {
        "Mode": any(m.mode for m in found),
        "GB/s": any(m.gbps is not None for m in found),
        "% BW": any(m.frac_bw is not None for m in found),
        "TFLOP/s": any(m.tflops is not None for m in found),
        "rel err": any(m.rel_err is not None for m in found),
        "1st call s": any(m.first_call_s is not None for m in found),
        "Note": any(m.note for m in found),
    }
    headers = [h for h in COLUMNS if present.get(h, True)]
    rows = []
    for group in _groups(found).values():
        best = _best(group, ours=True)
        for m in group:
            cells = {
                "Shape": m.shape,
                "Mode": m.mode or "",
                "Impl": f"**{m.impl}**" if m.ours else m.impl,
                "median ms": num(m.median_ms, ".4g"),
                "p20–p80 ms": _spread(m),
                "GB/s": num(m.gbps, ".4g"),
                "% BW": num(None if m.frac_bw is None else 100 * m.frac_bw, ".0f"),
                "TFLOP/s": num(m.tflops, ".4g"),
                "rel err": sci(m.rel_err),
                "1st call s": num(m.first_call_s, ".3g"),
                "ours / impl": _ratio(best, m),
                "Note": m.note or "",
            }
            rows.append([cells[h] for h in headers])
    return table(headers, rows, right=tuple(i for i, h in enumerate(headers) if h in NUMERIC))


def _ratio(best: Measurement | None, m: Measurement) -> str:
    if m.ours or best is None or not m.median_ms:
        return ""
    return f"{best.median_ms / m.median_ms:.2f}×"  # type: ignore[operator]


def _spread(m: Measurement) -> str:
    if m.p20_ms is None and m.p80_ms is None:
        return MISSING
    return f"{num(m.p20_ms, '.4g')}–{num(m.p80_ms, '.4g')}"


@dataclass(frozen=True)
class Speedup:
    shape: str
    mode: str | None
    value: float  # fastest peer's time over our fastest: above 1 ours is faster
    peer: str


def speedup_rows(found: list[Measurement]) -> list[Speedup]:
    rows = []
    for (shape, mode), group in _groups(found).items():
        ours, peer = _best(group, ours=True), _best(group, ours=False)
        if ours and peer:
            rows.append(Speedup(shape, mode, peer.median_ms / ours.median_ms, peer.impl))  # type: ignore[operator]
    return rows


def short_labels(shapes: list[str]) -> list[str]:
    """Drop the words every shape shares (model=1b on all bars says nothing) and wrap the rest."""
    words = [s.split() for s in shapes]
    common = set(words[0]).intersection(*words[1:]) if len(words) > 1 else set()
    return ["\n".join(w for w in ws if w not in common) or s for ws, s in zip(words, shapes, strict=True)]


def plot(speedups: dict[str, list[Speedup]], path: Any) -> None:
    """One panel per kernel; bars grouped by shape, one bar per timing mode."""
    with figure(path, width=10.0, height=2.6, rows=len(speedups)) as axes:
        for ax, (kernel, rows) in zip(axes, speedups.items(), strict=True):
            _panel(ax, kernel, rows)


def _panel(ax: Any, kernel: str, rows: list[Speedup]) -> None:
    from matplotlib.ticker import FuncFormatter

    shapes = list(dict.fromkeys(r.shape for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        chosen = [r for r in rows if r.mode == mode]
        xs = [shapes.index(r.shape) - 0.4 + width * (j + 0.5) for r in chosen]
        # Bars start at parity (1×): up means ours is faster, down means slower.
        heights = [r.value - 1.0 for r in chosen]
        bars = ax.bar(xs, heights, width * 0.9, bottom=1.0, color=PALETTE[j % len(PALETTE)], label=mode or "median")
        for bar, r in zip(bars, chosen, strict=True):
            _label(ax, bar, r, dense=len(rows) > DENSE_BARS)
    values = [r.value for r in rows]
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(values + [1.0]) / 2, max(values + [1.0]) * 2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}×"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)), short_labels(shapes), fontsize=7)
    margin = max(0, MIN_SLOTS - len(shapes)) / 2  # keep a lone bar from filling the whole panel
    ax.set_xlim(-0.6 - margin, len(shapes) - 0.4 + margin)
    ax.set_ylabel("peer time / ours")
    ax.set_title(f"{kernel}: speed-up over the fastest peer (above 1×: ours faster)", fontsize=9)
    if any(modes):
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # outside: never over a bar


def _label(ax: Any, bar: Any, r: Speedup, dense: bool) -> None:
    """The speed-up and the peer it beats (or loses to); in a crowded panel only the number, upright."""
    up = r.value >= 1.0
    ax.annotate(
        f"{r.value:.2f}×" if dense else f"{r.value:.2f}× {r.peer}",
        (bar.get_x() + bar.get_width() / 2, r.value),
        ha="center",
        va="bottom" if up else "top",
        fontsize=6 if dense else 7,
        rotation=90 if dense else 0,
        xytext=(0, 2 if up else -2),
        textcoords="offset points",
    )
