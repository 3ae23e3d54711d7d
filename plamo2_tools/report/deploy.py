"""`plamo2-tools verify TARGET...` results (kind `plamo2-verify-targets`): each deployment against
the reference forward.  One table per file (a row per target and forward convention), the
failures, and per target a per-position plot: KL(reference ‖ target) and the log-prob difference
of each sequence's next token, per prompt, with the thresholds and the first divergence marked."""

from __future__ import annotations

from typing import Any

from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, num, sci
from .markdown import table as md_table
from .plots import FAIL_COLOR, PALETTE, figure, log_floor

HEADERS = [
    "Target",
    "Kind",
    "Precision",
    "KL over",
    "Mode",
    "Convention",
    "mean KL",
    "max KL",
    "top-1",
    "max |Δlog p|",
    "greedy match",
    "First divergence",
    "Result",
]


def file_section(doc: Doc, ctx: Context) -> list[str]:
    data = doc.data
    targets = [t for t in data.get("targets") or [] if isinstance(t, dict)]
    verdict = {True: "passed", False: "**FAILED**"}.get(data.get("passed"), "no verdict")
    lines = [f"### {code(doc.name)}: {verdict}", "", " · ".join(_facts(data)), ""]
    rows = [_row(t, label, r) for t in targets for label, r in _conventions(t)]
    lines += md_table(HEADERS, rows, right=(6, 7, 8, 9))
    notes = []
    for t in targets:
        name = code(t.get("location", MISSING))
        follows = t.get("follows")
        if isinstance(follows, list) and len(_conventions(t)) > 1:
            which = ", ".join(map(str, follows)) or "none"
            tie = " (these prompts do not tell the conventions apart)" if t.get("indistinguishable") else ""
            notes.append(f"- {name} follows {which}{tie}")
        parity = t.get("tokenizer") if isinstance(t.get("tokenizer"), dict) else {}
        if parity.get("checked") is False:
            notes.append(f"- {name}: tokenizer not checked ({parity.get('why', MISSING)})")
        elif parity.get("checked"):
            notes.append(
                f"- {name}: tokenizer {'identical' if parity.get('equal') else '**differs**'} "
                f"({num(parity.get('tokens'))} tokens of the parity text)"
            )
        info = t.get("info") if isinstance(t.get("info"), dict) else {}
        for d in info.get("known_differences") or []:
            text = d.get("text", d) if isinstance(d, dict) else d
            notes.append(f"- {name}: known difference: {' '.join(str(text).split())}")
        for f in t.get("failures") or []:
            notes.append(f"- {name} **fails**: {' '.join(str(f).split())}")
    if notes:
        lines += ["", *notes]
    failed = [t for t in targets if t.get("passed") is False]
    if failed:
        ctx.warn(f"verify {code(doc.name)}: {len(failed)} target(s) diverge from the reference")
    for t in targets:
        label, judged = _shown(t)
        series = [s for s in judged.get("positions") or [] if isinstance(s, dict)]
        if not series:
            continue
        path = ctx.plot_path("divergence")
        plot(series, judged, path, f"{t.get('location', '')} ({label})")
        lines += ["", ctx.image(path, f"KL and log-prob difference per position, {t.get('location', '')}, {label}")]
    return lines + [""]


def _facts(data: dict[str, Any]) -> list[str]:
    ref = data.get("reference") if isinstance(data.get("reference"), dict) else {}
    prompts = data.get("prompts") if isinstance(data.get("prompts"), dict) else {}
    facts = []
    if ref:
        facts.append(f"reference {code(ref.get('path', MISSING))} ({ref.get('precision', MISSING)})")
    if prompts:
        facts.append(f"{num(prompts.get('count'))} prompt(s) ({prompts.get('source', MISSING)})")
    if data.get("max_new_tokens") is not None:
        facts.append(f"max_new_tokens {data['max_new_tokens']}")
    conventions = data.get("conventions")
    if isinstance(conventions, list) and conventions != ["default"]:
        facts.append("conventions " + ", ".join(map(str, conventions)))
    return facts or ["(no run details in the file)"]


def _conventions(t: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    by = t.get("conventions")
    return [(str(k), v) for k, v in by.items() if isinstance(v, dict)] if isinstance(by, dict) else []


def _shown(t: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The convention a target's plot shows: the one it follows, else the first (where it failed)."""
    convs = _conventions(t)
    follows = t.get("follows") if isinstance(t.get("follows"), list) else []
    for label, r in convs:
        if label in follows:
            return label, r
    return convs[0] if convs else ("", {})


def _row(t: dict[str, Any], label: str, r: dict[str, Any]) -> list[str]:
    main = r.get("teacher_forced") if isinstance(r.get("teacher_forced"), dict) else r.get("greedy")
    main = main if isinstance(main, dict) else {}
    greedy = r.get("greedy") if isinstance(r.get("greedy"), dict) else {}
    first = r.get("first_divergence") if isinstance(r.get("first_divergence"), dict) else None
    matches, steps = greedy.get("match_tokens"), greedy.get("steps")
    match = (
        f"{sum(matches)}/{sum(steps)}"
        if isinstance(matches, list) and isinstance(steps, list) and all(is_number(x) for x in matches + steps)
        else MISSING
    )
    where = MISSING
    if first:
        where = (
            f"prompt {first.get('prompt')}, pos {first.get('position')} ({first.get('phase')}): "
            f"{first.get('reference_token')} {first.get('reference_text')!r} → "
            f"{first.get('target_token')} {first.get('target_text')!r}"
        )
    kl = str(t.get("kl_kind", MISSING)) + (f" (K={t['top_k']})" if is_number(t.get("top_k")) and t["top_k"] else "")
    result = "pass" if r.get("passed") else ("not followed" if t.get("passed") else "**FAIL**")
    return [
        code(t.get("location", MISSING)),
        num(t.get("kind")),
        num(t.get("precision")),
        kl,
        num(t.get("mode")),
        label,
        sci(main.get("mean_kl")),
        sci(main.get("max_kl")),
        num(main.get("top1_agreement"), ".3f"),
        sci(main.get("max_abs_logprob_diff")),
        match,
        where,
        result,
    ]


def plot(series: list[dict[str, Any]], judged: dict[str, Any], path: Any, title: str) -> None:
    """Two stacked panels: KL per position (log) and Δlog p per position, one line per prompt and
    phase, the per-position thresholds dashed and the first divergence marked."""
    thresholds = judged.get("thresholds") if isinstance(judged.get("thresholds"), dict) else {}
    first = judged.get("first_divergence") if isinstance(judged.get("first_divergence"), dict) else None
    kl_values = [float(v) for s in series for v in s.get("kl") or [] if is_number(v)]
    floor = log_floor(kl_values)
    with figure(path, rows=2, height=2.8) as (ax_kl, ax_lp):
        for n, s in enumerate(series):
            pos = [p for p in s.get("positions") or [] if is_number(p)]
            color = PALETTE[int(s.get("prompt", n)) % len(PALETTE)] if is_number(s.get("prompt")) else PALETTE[0]
            style = "-" if s.get("phase") == "teacher-forced" else ":"
            label = f"prompt {s.get('prompt')} ({s.get('phase')})"
            kl = [_finite(v, floor, high=1e3) for v in s.get("kl") or []]
            lp = [_finite(v, 0.0, high=50.0) for v in s.get("logprob_diff") or []]
            if len(kl) == len(pos):
                ax_kl.plot(pos, [max(v, floor) for v in kl], style, color=color, linewidth=1, label=label)
            if len(lp) == len(pos):
                ax_lp.plot(pos, lp, style, color=color, linewidth=1)
        if is_number(thresholds.get("kl_position")):
            ax_kl.axhline(
                thresholds["kl_position"],
                color=FAIL_COLOR,
                linestyle="--",
                linewidth=1,
                label=f"per-position bound {thresholds['kl_position']:g}",
            )
        if is_number(thresholds.get("logprob_diff")):
            for sign in (1, -1):
                ax_lp.axhline(sign * thresholds["logprob_diff"], color=FAIL_COLOR, linestyle="--", linewidth=1)
        if first and is_number(first.get("position")):
            for ax in (ax_kl, ax_lp):
                ax.axvline(first["position"], color=FAIL_COLOR, linewidth=1.5, alpha=0.6)
            ax_kl.annotate(
                f"first divergence: prompt {first.get('prompt')}, position {first['position']}",
                (first["position"], 0.02),
                xycoords=("data", "axes fraction"),
                xytext=(4, 0),
                textcoords="offset points",
                fontsize=8,
                color=FAIL_COLOR,
            )
        ax_kl.set_yscale("log")
        ax_kl.set_ylabel("KL(ref ‖ target)")
        ax_kl.set_title(f"Per position: {title}")
        ax_kl.legend(loc="best", fontsize=7, ncol=2)
        ax_lp.set_ylabel("Δ log p(next)")
        ax_lp.set_xlabel("position in the sequence (dotted: the target's own greedy continuation)")


def _finite(value: Any, fallback: float, high: float) -> float:
    """Plot values: an "inf"/"nan" string (jsonable) or a wild number drawn at the axis edge."""
    if not is_number(value):
        return {"inf": high, "-inf": -high}.get(str(value), fallback)
    return max(-high, min(high, float(value)))


__all__ = ["file_section", "plot"]
