"""lm-eval results (`results*.json` of lm-eval 0.4.x): per-run tables like lm-eval's own
`make_table`, and a side-by-side comparison across TP × PP layouts next to the published vLLM
reference for pfnet/plamo-2-1b."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, num, table

# Published vLLM numbers for pfnet/plamo-2-1b, lm-eval gsm8k (v3) 5-shot, exact_match on the full
# 1,319-problem test set.  Only a run of the same model on the same full set is comparable.
REFERENCE: dict[tuple[int, int], dict[str, float]] = {
    (1, 1): {"flexible-extract": 0.202, "strict-match": 0.520},
    (2, 2): {"flexible-extract": 0.205, "strict-match": 0.517},
}
REFERENCE_TASK, REFERENCE_SHOTS, REFERENCE_METRIC, REFERENCE_DOCS = "gsm8k", 5, "exact_match", 1319
HIGHER_IS_BETTER = {True: "↑", False: "↓"}
NOT_METRICS = ("alias", "name", "sample_len", "sample_count")
TP_KEYS = ("tp", "tp_size", "tensor_parallel_size", "tensor_parallel")
PP_KEYS = ("pp", "pp_size", "pipeline_parallel_size", "pipeline_parallel")


@dataclass
class Run:
    index: int  # 1-based, in report order
    doc: Doc
    tp: int | None
    pp: int | None

    @property
    def data(self) -> dict[str, Any]:
        return self.doc.data

    @property
    def layout(self) -> str:
        return layout_label(self.tp, self.pp)

    @property
    def limit(self) -> Any:
        return (self.data.get("config") or {}).get("limit")


def layout_label(tp: int | None, pp: int | None) -> str:
    return "layout unknown" if tp is None else f"TP{tp}×PP{pp}"


def parse_model_args(model_args: Any) -> dict[str, Any]:
    """model_args as lm-eval stores them: a dict (Python API) or "k=v,k=v" (CLI)."""
    if isinstance(model_args, dict):
        return model_args
    if not isinstance(model_args, str):
        return {}
    pairs = (item.split("=", 1) for item in model_args.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def find_layout(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """TP and PP from what our adapter records via get_model_info (config keys tp/pp) or from
    model_args (ours: tp/pp; vLLM: tensor_parallel_size/pipeline_parallel_size).  When only one of
    them is given the other is 1, as in vLLM; when neither is, the layout is unknown."""
    sources = [config, parse_model_args(config.get("model_args"))]
    tp, pp = _first_int(sources, TP_KEYS), _first_int(sources, PP_KEYS)
    if tp is None and pp is None:
        return None, None
    return tp or 1, pp or 1


def _first_int(sources: list[dict[str, Any]], keys: tuple[str, ...]) -> int | None:
    for source in sources:
        for key in keys:
            try:
                return int(source[key])
            except (KeyError, TypeError, ValueError):
                continue
    return None


def task_order(data: dict[str, Any]) -> list[tuple[str, int]]:
    """(task, depth) in lm-eval's order: groups followed by their subtasks, then the rest."""
    results, groups = data["results"], data.get("group_subtasks") or {}
    subtasks = {s for subs in groups.values() for s in subs}
    order: list[tuple[str, int]] = []

    def visit(task: str, depth: int) -> None:
        if task in results and task not in {t for t, _ in order}:
            order.append((task, depth))
        for sub in groups.get(task, []):
            visit(sub, depth + 1)

    for task in [g for g in groups if g not in subtasks] + list(results):
        visit(task, 0)
    return order


def metric_rows(data: dict[str, Any], task: str) -> list[tuple[str, str, Any, Any]]:
    """(metric, filter, value, stderr) sorted like make_table (by "metric,filter")."""
    entry = data["results"][task]
    rows = []
    for key, value in sorted((k, v) for k, v in entry.items() if k not in NOT_METRICS):
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr"):
            continue
        rows.append((metric, filt, value, entry.get(f"{metric}_stderr,{filt}")))
    return rows


def version_text(version: Any) -> str:
    if isinstance(version, float) and version.is_integer():
        return str(int(version))
    return num(version)


def run_table(data: dict[str, Any]) -> list[str]:
    """lm-eval's own table (make_table), with the ↑/↓ arrow beside the metric name."""
    rows = []
    for task, depth in task_order(data):
        entry = data["results"][task]
        name = " " * depth + ("- " if depth else "") + str(entry.get("alias", task))
        hib = (data.get("higher_is_better") or {}).get(task, {})
        version, shots = version_text(data["versions"].get(task, "N/A")), num(data["n-shot"].get(task, ""))
        for metric, filt, value, stderr in metric_rows(data, task):
            label = f"{metric} {HIGHER_IS_BETTER.get(hib.get(metric), '')}".rstrip()
            rows.append([name, version, filt, shots, label, num(value), "" if stderr is None else num(stderr)])
            name = version = ""  # like make_table: a task's name and version only on its first row
    headers = ["Tasks", "Version", "Filter", "n-shot", "Metric", "Value", "± Stderr"]
    return table(headers, rows, right=(3, 5, 6))


def samples(data: dict[str, Any], task: str) -> tuple[Any, Any]:
    n = (data.get("n-samples") or {}).get(task) or {}
    return n.get("effective"), n.get("original")


def comparability(run: Run, task: str) -> str | None:
    """Why this run's `task` score cannot stand next to the published reference (None: it can)."""
    effective, original = samples(run.data, task)
    if run.limit is not None or (is_number(effective) and is_number(original) and effective < original):
        return f"--limit {run.limit} used: scored on {num(effective)} of {num(original)} problems"
    if is_number(original) and original != REFERENCE_DOCS:
        return f"the test set has {original} problems, not GSM8K's {REFERENCE_DOCS:,}"
    return None


def has_reference_task(run: Run) -> bool:
    return REFERENCE_TASK in run.data["results"] and run.data["n-shot"].get(REFERENCE_TASK) == REFERENCE_SHOTS


def make_runs(docs: list[Doc]) -> list[Run]:
    """Runs ordered by layout (TP, then PP), unknown layouts last, then by file name."""
    runs = [Run(0, d, *find_layout(d.data.get("config") or {})) for d in docs]
    runs.sort(key=lambda r: (r.tp is None, r.tp or 0, r.pp or 0, r.doc.name))
    for i, run in enumerate(runs, 1):
        run.index = i
    return runs


def render(docs: list[Doc], ctx: Context) -> list[str]:
    runs = make_runs(docs)
    lines = ["## lm-eval results", ""]
    for run in runs:
        lines += run_section(run, ctx)
    lines += comparison(runs)
    return lines


def run_section(run: Run, ctx: Context) -> list[str]:
    cfg = run.data.get("config") or {}
    args = parse_model_args(cfg.get("model_args"))
    model = f"model {code(cfg.get('model', MISSING))}"
    if args:
        model += " (" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"
    facts = [f"file {code(run.doc.name)}", model]
    if cfg.get("shards"):
        facts.append(f"shards {code(cfg['shards'])}")
    facts += [
        f"limit: {num(cfg.get('limit')) if cfg.get('limit') is not None else 'none'}",
        f"gen_kwargs: {code(cfg.get('gen_kwargs'))}" if cfg.get("gen_kwargs") else "",
        f"lm-eval {run.data['lm_eval_version']}" if run.data.get("lm_eval_version") else "",
    ]
    lines = [f"### Run {run.index}: {run.layout}", "", " · ".join(f for f in facts if f), ""]
    lines += run_table(run.data) + [""]
    for task, _ in task_order(run.data):
        effective, original = samples(run.data, task)
        if run.limit is not None or (is_number(effective) and is_number(original) and effective < original):
            text = (
                f"Run {run.index} ({run.layout}, {code(run.doc.name)}) used --limit: {task} was scored on "
                f"{num(effective)} of {num(original)} problems; not comparable to the reference."
            )
            ctx.warn(text)
            lines += [f"> **Warning:** {text}", ""]
    return lines


def comparison(runs: list[Run]) -> list[str]:
    """Rows (task, n-shot, filter, metric); one column per run, each reference layout's published
    numbers right after the last run of that layout."""
    columns = _columns(runs)
    keys: list[tuple[str, Any, str, str]] = []
    tasks: list[str] = []
    for run in runs:
        for task, _ in task_order(run.data):
            tasks += [task] if task not in tasks else []
            for metric, filt, _, _ in metric_rows(run.data, task):
                key = (task, run.data["n-shot"].get(task), filt, metric)
                keys += [key] if key not in keys else []
    headers = ["Task", "n-shot", "Filter", "Metric"] + [_column_label(c) for c in columns]
    rows = [[t, num(n), f, m] + [_value_cell(c, (t, n, f, m)) for c in columns] for t, n, f, m in keys]
    for task in tasks:
        rows.append([task, "", "", "samples (effective / original)"] + [_samples_cell(c, task) for c in columns])
        if any(c[0] == "ref" for c in columns) and task == REFERENCE_TASK:
            rows.append([task, "", "", "comparable to the reference"] + [_comparable_cell(c, task) for c in columns])
        rows.append([task, "", "", "prompt hash (task_hashes)"] + [_hash_cell(c, task) for c in columns])
    lines = ["### Comparison across runs", ""]
    lines += table(headers, rows, right=tuple(range(4, len(headers))))
    if any(c[0] == "ref" for c in columns):
        lines += [
            "",
            "**Reference** columns are the published vLLM results for pfnet/plamo-2-1b "
            f"(lm-eval {REFERENCE_TASK} {REFERENCE_SHOTS}-shot, {REFERENCE_METRIC}, all {REFERENCE_DOCS:,} test "
            "problems). They are not measured by this report; a run only compares with them when it "
            "evaluated the same model on the full test set without --limit.",
        ]
    hashes = {_hash_cell(("run", r), t) for r in runs for t in tasks if t in r.data["results"]}
    if len(runs) > 1 and len(hashes - {MISSING}) == 1:
        lines += ["", "All runs saw identical prompts (equal task_hashes)."]
    return lines + [""]


Column = tuple[str, Any]  # ("run", Run) or ("ref", (tp, pp))


def _columns(runs: list[Run]) -> list[Column]:
    columns: list[Column] = []
    for i, run in enumerate(runs):
        columns.append(("run", run))
        last_of_layout = i + 1 == len(runs) or (runs[i + 1].tp, runs[i + 1].pp) != (run.tp, run.pp)
        if last_of_layout and (run.tp, run.pp) in REFERENCE and has_reference_task(run):
            columns.append(("ref", (run.tp, run.pp)))
    if not any(c[0] == "ref" for c in columns) and any(has_reference_task(r) for r in runs):
        # No run has a published layout: show both references at the end so they are still in view.
        columns += [("ref", layout) for layout in REFERENCE]
    return columns


def _column_label(column: Column) -> str:
    kind, item = column
    if kind == "ref":
        return f"vLLM reference {layout_label(*item)} (published)"
    notes = [f"run {item.index}"] + ([f"--limit {item.limit}"] if item.limit is not None else [])
    return f"{item.layout} ({', '.join(notes)})"


def _value_cell(column: Column, key: tuple[str, Any, str, str]) -> str:
    task, shots, filt, metric = key
    kind, item = column
    if kind == "ref":
        ok = (task, shots, metric) == (REFERENCE_TASK, REFERENCE_SHOTS, REFERENCE_METRIC)
        return f"{REFERENCE[item][filt]:.3f}" if ok and filt in REFERENCE[item] else ""
    if task not in item.data["results"] or item.data["n-shot"].get(task) != shots:
        return ""
    entry = item.data["results"][task]
    return num(entry.get(f"{metric},{filt}")) if f"{metric},{filt}" in entry else ""


def _samples_cell(column: Column, task: str) -> str:
    kind, item = column
    if kind == "ref":
        return f"{REFERENCE_DOCS} / {REFERENCE_DOCS}" if task == REFERENCE_TASK else ""
    if task not in item.data["results"]:
        return ""
    effective, original = samples(item.data, task)
    return f"{num(effective)} / {num(original)}"


def _comparable_cell(column: Column, task: str) -> str:
    kind, item = column
    if kind == "ref" or task not in item.data["results"]:
        return ""
    if (item.tp, item.pp) not in REFERENCE:
        return "no: no published reference for this layout"
    reason = comparability(item, task)
    return "yes" if reason is None else f"no: {reason}"


def _hash_cell(column: Column, task: str) -> str:
    kind, item = column
    if kind == "ref":
        return ""
    digest = (item.data.get("task_hashes") or {}).get(task)
    return code(digest[:12]) if isinstance(digest, str) and digest else MISSING
