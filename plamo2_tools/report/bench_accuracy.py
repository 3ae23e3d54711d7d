"""The offline GSM8K run (`python -m bench accuracy`, kind plamo2-bench-accuracy; before the suite a
`phase: gsm8k` file of bench/gsm8k.py, shown in the throughput section): lm-eval's scores beside
the published reference, the wall time against its target, and where the time went."""

from __future__ import annotations

from typing import Any

from .bench import payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, table

GSM8K_TARGET_S = 40.0  # issue 11: the full 5-shot run on synthetic plamo-2-1b, one H200


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## GSM8K offline", ""]
    for doc in docs:
        lines += [f"### {code(doc.name)}", "", *run_line(doc), *gsm8k_summary(payload(doc)), ""]
    return lines


def gsm8k_summary(d: dict[str, Any]) -> list[str]:
    """Documents, batch, wall against the target, the split into phases, the scores."""
    wall = d.get("wall_seconds")
    status = "complete" if d.get("complete", True) else "**incomplete**"
    verdict = ""
    if is_number(wall) and d.get("complete", True):
        verdict = f" (target ≤ {GSM8K_TARGET_S:.0f} s: {'met' if wall <= GSM8K_TARGET_S else 'missed'})"
    if is_number(wall):
        head = (
            f"GSM8K offline ({status}): {d.get('documents', MISSING)} documents, batch "
            f"{d.get('batch_size', MISSING)}, continuous batching {'on' if d.get('continuous_batching') else 'off'}, "
            f"wall {wall:.1f} s{verdict}."
        )
    else:
        head = f"GSM8K offline ({status}): no wall time."
    lines = [head, ""]
    split = d.get("split_seconds") or {}
    if split:
        rows = [[k, f"{v:.2f}" if is_number(v) else MISSING] for k, v in split.items()]
        lines += table(["part", "seconds"], rows, right=(1,)) + [""]
    metrics = d.get("metrics") or {}
    if metrics:
        scores = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if is_number(v))
        published = d.get("published") if isinstance(d.get("published"), dict) else None
        if published:
            ref = ", ".join(f"{k} {v}" for k, v in published.items() if is_number(v))
            scores += f" (published for {published.get('model', '?')}: {ref}, {published.get('source', '')})"
        if d.get("synthetic_data") is True:
            scores += "; GSM8K-shaped synthetic data: the scores mean nothing, the time does"
        lines += [scores, ""]
    if d.get("note"):
        lines += [f"_{d['note']}_", ""]
    return lines
