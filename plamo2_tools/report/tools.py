"""JSON printed by `plamo2-tools convert --json`, `check --json` and `inspect --json`: one short
table per command, a row per file."""

from __future__ import annotations

from .context import Context
from .inputs import CHECK, CONVERT, INSPECT, Doc
from .markdown import MISSING, code, is_number, nbytes, num, seconds, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Tool output (convert / check / inspect)", ""]
    for kind, title, make in (
        (CONVERT, "convert", convert_table),
        (CHECK, "check", check_table),
        (INSPECT, "inspect", inspect_table),
    ):
        chosen = [d for d in docs if d.kind == kind]
        if chosen:
            lines += [f"### {title}", "", *make(chosen, ctx), ""]
    return lines


def convert_table(docs: list[Doc], ctx: Context) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        secs, written = d.get("seconds"), d.get("bytes_written")
        rate = f"{written / secs / 1e9:.2f}" if is_number(secs) and is_number(written) and secs > 0 else MISSING
        ranks = d.get("ranks") if isinstance(d.get("ranks"), list) else []
        rows.append(
            [
                code(doc.name),
                code(d["out"]) if d.get("out") else MISSING,
                f"TP{num(d['tp'])}×PP{num(d['pp'])}",
                num(d.get("status")),
                seconds(secs),
                nbytes(written),
                nbytes(d.get("bytes_total")),
                rate,
                str(len(ranks)),
                str(len(d.get("files_reused") or [])),
            ]
        )
    headers = ["File", "Out", "Layout", "Status", "Time", "Written", "Total", "GB/s", "Ranks", "Files reused"]
    return table(headers, rows, right=(4, 5, 6, 7, 8, 9))


def check_table(docs: list[Doc], ctx: Context) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        problems = {name: found for name, found in d["checks"].items() if found}
        detail = "; ".join(f"{name}: {len(v) if isinstance(v, list) else v}" for name, v in problems.items())
        rows.append(
            [
                code(doc.name),
                code(d["path"]),
                "ok" if d["ok"] else "**FAILED**",
                str(len(d["checks"])),
                detail or "none",
            ]
        )
        if not d["ok"]:
            ctx.warn(f"check {code(d['path'])} found problems in: {', '.join(problems) or 'unknown'}")
    return table(["File", "Shards", "Result", "Checks", "Problems"], rows, right=(3,))


def inspect_table(docs: list[Doc], ctx: Context) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        c = d.get("config") or {}
        model = f"D={num(c.get('hidden_size'))} L={num(c.get('num_hidden_layers'))} V={num(c.get('vocab_size'))}"
        mapping = d.get("mapping") or {}
        layout = f"TP{mapping.get('tp_size')}×PP{mapping.get('pp_size')}" if mapping else "HF checkpoint"
        params = d.get("parameters")
        size = sum(v for v in (d.get("bytes_by_dtype") or {}).values() if is_number(v))
        dtypes = ", ".join(sorted(d.get("bytes_by_dtype") or {}))
        rows.append(
            [
                code(doc.name),
                code(d["path"]),
                layout,
                model,
                f"{params:,}" if is_number(params) else MISSING,
                num(d.get("tensors")),
                f"{nbytes(size)} ({dtypes})" if dtypes else MISSING,
            ]
        )
    return table(["File", "Path", "Layout", "Model", "Parameters", "Tensors", "Bytes"], rows, right=(4, 5, 6))
