"""`plamo2-tools verify --json` results: runtime logits per TP × PP layout against a reference
forward.  One table per file (a row per layout) and a log-scale bar plot of the worst relative
error per layout against its threshold."""

from __future__ import annotations

from typing import Any

from ..kinds import VERIFY_TARGETS_KIND
from . import deploy
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, num, sci, table, yes_no
from .plots import FAIL_COLOR, PASS_COLOR, figure, log_floor

HIGHER_IS_BETTER = ("greedy_match_fraction", "top1_agreement")  # as verify.judge reads thresholds
HEADERS = [
    "Layout",
    "Shards",
    "dtype",
    "Ranks",
    "Launch",
    "Backend",
    "max |Δlogit|",
    "max rel err",
    "mean KL",
    "top-1",
    "greedy match",
    "logprobs close",
    "Thresholds",
    "Result",
]


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Verify: runtime logits against the reference forward", ""]
    for doc in docs:
        targets = isinstance(doc.data, dict) and doc.data.get("kind") == VERIFY_TARGETS_KIND
        lines += deploy.file_section(doc, ctx) if targets else file_section(doc, ctx)
    return lines


def layout_name(layout: dict[str, Any]) -> str:
    tp, pp = layout.get("tp"), layout.get("pp")
    return f"TP{num(tp)}×PP{num(pp)}" if tp is not None or pp is not None else str(layout.get("shards", MISSING))


def file_section(doc: Doc, ctx: Context) -> list[str]:
    data = doc.data
    layouts = [x for x in data.get("layouts") or [] if isinstance(x, dict)]
    verdict = {True: "passed", False: "**FAILED**"}.get(data.get("passed"), "no verdict")
    lines = [f"### {code(doc.name)}: {verdict}", "", " · ".join(_facts(data)), ""]
    lines += table(HEADERS, [_row(x, data) for x in layouts], right=(3, 6, 7, 8, 9, 10))
    failures = [(layout_name(x), f) for x in layouts for f in x.get("failures") or []]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {name} {' '.join(str(x).splitlines())}" for name, x in failures]
        ctx.warn(f"verify {code(doc.name)}: {len(failures)} failure(s) in {len({n for n, _ in failures})} layout(s)")
    if layouts:
        path = ctx.plot_path("logit-error")
        plot(layouts, path, doc.name)
        lines += ["", ctx.image(path, f"max relative logit error per layout, {doc.name}")]
    return lines + [""]


def _facts(data: dict[str, Any]) -> list[str]:
    ref = data.get("reference") or {}
    prompts = data.get("prompts") or {}
    facts = []
    if ref:
        facts.append(f"reference {code(ref.get('path', MISSING))} ({ref.get('precision', MISSING)})")
    if prompts:
        lengths = prompts.get("lengths") or []
        detail = ", ".join(
            p
            for p in (f"lengths {', '.join(map(str, lengths))}" if lengths else "", str(prompts.get("source") or ""))
            if p
        )
        facts.append(f"{num(prompts.get('count'))} prompt(s)" + (f" ({detail})" if detail else ""))
    if data.get("max_new_tokens") is not None:
        facts.append(f"max_new_tokens {data['max_new_tokens']}")
    return facts or ["(no run details in the file)"]


def _row(layout: dict[str, Any], data: dict[str, Any]) -> list[str]:
    m = layout.get("metrics") or {}
    launch = {True: "torchrun", False: "in-process"}.get(layout.get("launch"), num(layout.get("launch")))
    backend = "/".join(str(layout[k]) for k in ("backend", "device") if layout.get(k) is not None) or MISSING
    thresholds = layout.get("thresholds") or {}
    limits = ", ".join(
        f"{k} {'≥' if k in HIGHER_IS_BETTER else '<'} {v:g}" for k, v in thresholds.items() if is_number(v)
    )
    passed = layout.get("passed")
    return [
        layout_name(layout),
        code(layout["shards"]) if layout.get("shards") else MISSING,
        num(layout.get("dtype")),
        num(layout.get("world_size")),
        launch,
        backend,
        sci(m.get("max_abs_logit_diff")),
        sci(m.get("max_rel_err")),
        sci(m.get("mean_kl")),
        num(m.get("top1_agreement")),
        _greedy(m, data),
        yes_no(m.get("logprobs_close")),
        limits or MISSING,
        {True: "pass", False: "**FAIL**"}.get(passed, MISSING),
    ]


def _greedy(metrics: dict[str, Any], data: dict[str, Any]) -> str:
    """Fraction of greedy tokens that match, with the token count behind it when known."""
    fraction = num(metrics.get("greedy_match_fraction"), ".3f")
    tokens = metrics.get("greedy_match_tokens")
    count = (data.get("prompts") or {}).get("count")
    new = data.get("max_new_tokens")
    if isinstance(tokens, list) and all(is_number(t) for t in tokens) and is_number(new):
        return f"{fraction} ({sum(tokens)}/{(count if is_number(count) else len(tokens)) * new})"
    return fraction


def plot(layouts: list[dict[str, Any]], path: Any, title: str) -> None:
    values = [(layout.get("metrics") or {}).get("max_rel_err") for layout in layouts]
    numeric = [float(v) for v in values if is_number(v)]
    floor = log_floor(numeric)
    heights = [max(float(v), floor) if is_number(v) else floor for v in values]
    labels = [f"{layout_name(x)}\n{x.get('dtype', '')}".strip() for x in layouts]
    colors = [PASS_COLOR if x.get("passed") else FAIL_COLOR for x in layouts]
    limits = [(x.get("thresholds") or {}).get("max_rel_err") for x in layouts]
    with figure(path) as (ax,):
        xs = list(range(len(layouts)))
        ax.bar(xs, heights, color=colors, width=0.6)
        ax.set_yscale("log")
        for x, v, h in zip(xs, values, heights, strict=True):
            ax.annotate(
                sci(v) if v is not None else "n/a",
                (x, h),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        _threshold_lines(ax, xs, limits)
        ax.set_xticks(xs, labels)
        ax.set_ylabel("max relative error (log)")
        ax.set_title(f"Max relative logit error per layout: {title}")
        ax.set_xlim(-0.6, len(layouts) - 0.4)
        span = heights + [float(v) for v in limits if is_number(v)]
        ax.set_ylim(min(span) / 3, max(span) * 20)  # room for the value labels above the bars


def _threshold_lines(ax: Any, xs: list[int], limits: list[Any]) -> None:
    """One dashed line when every layout has the same threshold, else a short one over each bar."""
    known = [float(v) for v in limits if is_number(v)]
    if not known:
        return
    if len(set(known)) == 1 and len(known) == len(limits):
        ax.axhline(known[0], color=FAIL_COLOR, linestyle="--", linewidth=1, label=f"threshold {known[0]:g}")
    else:
        for x, v in zip(xs, limits, strict=True):
            if is_number(v):
                ax.hlines(float(v), x - 0.4, x + 0.4, colors=FAIL_COLOR, linestyles="--", linewidth=1)
        ax.plot([], [], color=FAIL_COLOR, linestyle="--", label="threshold per layout")
    ax.legend(loc="upper right", fontsize=8)
