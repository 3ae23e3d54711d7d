"""Start-up and one-time costs (issue 33): `--help` and refusals from the shell (bench/startup.py),
weight loading (bench/load.py), lm-eval's own time in a GSM8K run (bench/lm_eval_parts.py) and a
card's tuned-kernel table (`python -m bench tune`)."""

from __future__ import annotations

from typing import Any

from ..kinds import BENCH_LM_EVAL_PARTS_KIND, BENCH_LOAD_KIND, BENCH_STARTUP_KIND, BENCH_TUNE_KIND
from .bench import payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Start-up and one-time costs", ""]
    for kind, title, make in (
        (BENCH_STARTUP_KIND, "`--help` and refusals from the shell", startup),
        (BENCH_LOAD_KIND, "Weight loading", load),
        (BENCH_LM_EVAL_PARTS_KIND, "lm-eval's own time in a GSM8K run", lm_eval_parts),
        (BENCH_TUNE_KIND, "Tuned-kernel tables made on a card", tune),
    ):
        chosen = [d for d in docs if d.data.get("kind") == kind]
        for doc in chosen:
            lines += [f"### {title}: {code(doc.name)}", "", *run_line(doc), *make(payload(doc)), ""]
    return lines


def _s(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if is_number(value) else MISSING


def startup(d: dict[str, Any]) -> list[str]:
    rows = [
        [
            str(c.get("case")),
            _s(c.get("wall_s_median")),
            _s(c.get("cpu_s_median")),
            ",".join(map(str, c.get("exits") or [])),
            str(c.get("stderr_first", ""))[:70],
        ]
        for c in d["cases"]
        if isinstance(c, dict)
    ]
    head = f"{d.get('label') or ''} — median of {d.get('repeat')}, target {_s(d.get('target_seconds'), '.1f')} s wall"
    return [head, "", *table(["case", "wall s", "CPU s", "exit", "stderr"], rows, right=(1, 2))]


def load(d: dict[str, Any]) -> list[str]:
    kinds = d["kinds"]
    rows = [
        [k, _s(v.get("wall_s_median")), _s(v.get("gb_per_s"), ".2f"), _s(v.get("cpu_s_median"), ".2f")]
        for k, v in kinds.items()
        if isinstance(v, dict)
    ]
    head = f"{d.get('bytes')} bytes in {d.get('files')} files, {d.get('cache')} page cache, device {d.get('device')}"
    return [head, "", *table(["kind", "wall s", "GB/s", "CPU s"], rows, right=(1, 2, 3))]


def lm_eval_parts(d: dict[str, Any]) -> list[str]:
    cpu = d.get("parts_cpu_seconds") if isinstance(d.get("parts_cpu_seconds"), dict) else {}
    parts = sorted(d["parts_seconds"].items(), key=lambda kv: -kv[1] if is_number(kv[1]) else 0)
    rows = [[k, _s(v, ".2f"), _s(cpu.get(k), ".2f")] for k, v in parts]
    fixes = ", ".join(d.get("workarounds") or []) or "none"
    head = (
        f"{d.get('documents')} documents, {d.get('num_fewshot')}-shot, workarounds: {fixes}; "
        f"total {_s(d.get('total_seconds'), '.2f')} s"
    )
    return [head, "", *table(["part", "wall s", "CPU s"], rows, right=(1, 2))]


def tune(d: dict[str, Any]) -> list[str]:
    t = d["table"]
    counts = {k: len(v) for k, v in (t.get("kernels") or {}).items() if isinstance(v, dict)}
    w = d.get("warmup") if isinstance(d.get("warmup"), dict) else {}
    compiled = (w.get("triton_kernels_after") or 0) - (w.get("triton_kernels_before") or 0)
    return [
        f"{t.get('card')} (sm {t.get('capability')}): "
        + ", ".join(f"{k} {n}" for k, n in counts.items())
        + f"; warmup {_s(d.get('wall_s'), '.1f')} s, {compiled} Triton kernels compiled"
    ]
