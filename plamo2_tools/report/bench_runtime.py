"""Runtime throughput (`"kind": "plamo2-bench-runtime"`, written by bench/runtime.py): prefill and
decode tokens/s per kernel backend, with the Triton / PyTorch ratio where both ran."""

from __future__ import annotations

from .context import Context
from .inputs import Doc
from .markdown import code, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Runtime throughput", ""]
    for doc in docs:
        d = doc.data
        lines += [
            f"### {code(doc.name)}",
            "",
            f"{d.get('gpu', '?')} · torch {d.get('torch', '?')} · shards {code(d.get('shards', '?'))}",
            "",
        ]
        speed = {
            (r["backend"], r["phase"], r.get("tokens", r.get("batch"))): r["tokens_per_s"] for r in d.get("runs", [])
        }
        rows = []
        for (backend, phase, size), tps in sorted(speed.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            other = speed.get(("torch", phase, size)) if backend != "torch" else None
            what = f"T = {size}" if phase == "prefill" else f"batch {size}"
            rows.append([phase, what, backend, f"{tps:,.1f}", f"{tps / other:.2f}×" if other else ""])
        lines += [*table(["phase", "size", "kernels", "tokens/s", "vs torch"], rows, right=(3, 4)), ""]
    return lines
