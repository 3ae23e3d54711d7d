"""The server under load (`python -m bench serving`, kind plamo2-bench-serving; plamo2-bench-serve from
bench/serve.py before the suite): per server variant and level (closed-loop clients or Poisson
arrivals), output tokens/s of `plamo2-tools serve` beside in-process `Runtime.generate` on the same
requests, the clients' time to first token (all requests and steady state), the inter-token gap
against the in-process decode step, the server's CPU per token, where a traced request's first token
went stage by stage, and the issue's targets met or not."""

from __future__ import annotations

from typing import Any

from .bench import payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, table

TARGET_RATIO = 0.9  # issue 20 / 32: the server keeps >= 90% of in-process throughput at 64 and 256 clients
TARGET_CLIENTS = (64, 256)
STAGES = (
    "parsed",
    "tokenized",
    "admitted",
    "submitted",
    "taken",
    "scheduled",
    "prefilled",
    "drained",
    "delivered",
    "written",
)


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if is_number(v) else MISSING


def _ms(v: Any) -> str:
    return f"{1000 * v:,.1f}" if is_number(v) else MISSING


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _level(r: dict[str, Any]) -> str:
    if r.get("mode") == "open":
        return f"{_num(r.get('rate'), 'g')}/s"
    return str(r.get("clients", "?"))


def _rows(runs: list[Any], variants: bool) -> list[list[Any]]:
    rows = []
    for r in runs:
        if not isinstance(r, dict):
            continue
        head = [r.get("variant", "?")] if variants else []
        if r.get("skipped"):
            rows.append([*head, _level(r), "skipped (time)", *[""] * 9])
            continue
        ip = _dict(r.get("in_process"))
        ratio = r.get("ratio")
        verdict = ""
        if is_number(ratio) and r.get("clients") in TARGET_CLIENTS and r.get("mode", "closed") == "closed":
            verdict = " ✅" if ratio >= TARGET_RATIO else " ❌"
        note = "" if r.get("complete", True) else " (cut)"
        share = (f"{ratio:.0%}" if is_number(ratio) else MISSING) + verdict
        gap = r.get("gap_vs_step")
        rows.append(
            [
                *head,
                f"{_level(r)}{note}",
                _num(r.get("tokens_per_s"), ",.1f"),
                _num(ip.get("tokens_per_s"), ",.1f"),
                share,
                _ms(r.get("ttft_p50_s")),
                _ms(r.get("ttft_p99_s")),
                f"{_ms(r.get('ttft_steady_p50_s'))} / {_ms(r.get('ttft_steady_p99_s'))}",
                _ms(r.get("tpot_p50_s")),
                _ms(ip.get("step_s")),
                _num(gap, ".2f"),
                _num(r.get("cpu_ms_per_token"), ".2f"),
            ]
        )
    return rows


def _stages(runs: list[Any], variants: bool) -> list[str]:
    """p50 ms of each stage of a request's first token, per traced level."""
    rows = []
    for r in runs:
        if not isinstance(r, dict) or not isinstance(r.get("stages"), dict):
            continue
        st = r["stages"]
        head = [r.get("variant", "?")] if variants else []
        rows.append([*head, _level(r), *(_ms(_dict(st.get(s)).get("p50_s")) for s in (*STAGES, "total"))])
    if not rows:
        return []
    head = ["variant"] if variants else []
    right = tuple(range(len(head) + 1, len(rows[0])))
    return [
        "",
        "Where the first token's time went (p50 ms per stage, serve/trace.py):",
        "",
        *table([*head, "level", *STAGES, "total"], rows, right=right),
    ]


def _targets(targets: Any) -> list[str]:
    if not isinstance(targets, list) or not targets:
        return []
    rows = []
    for t in targets:
        if not isinstance(t, dict):
            continue
        value = t.get("value")
        shown = _ms(value) + " ms" if str(t.get("check", "")).endswith("_s") else _num(value, ".2f")
        rows.append(
            [
                t.get("check", "?"),
                t.get("variant", "?"),
                t.get("clients", "?"),
                shown,
                t.get("limit", "?"),
                "✅" if t.get("ok") else "❌",
            ]
        )
    return ["", *table(["target", "variant", "clients", "value", "limit", "met"], rows, right=(2, 3))]


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Server under load", ""]
    for doc in docs:
        d = payload(doc)
        cfg = _dict(d.get("config"))
        servers = _dict(d.get("servers")) or ({"serve": d["server"]} if isinstance(d.get("server"), dict) else {})
        head = [f"shards {code(d.get('shards', '?'))}"]
        prompt, answer, per = cfg.get("prompt_tokens", "?"), cfg.get("max_tokens", "?"), cfg.get("per_client", "?")
        head.append(f"prompts {prompt} ± 25% tokens, answers {answer} tokens, {per} requests per client")
        for name, server in servers.items():
            server = _dict(server)
            up, rc = _num(server.get("startup_s"), ".1f"), server.get("exit_code", "?")
            slots, context = server.get("slots", "?"), server.get("context", "?")
            env = _dict(cfg.get("variants")).get(name)
            what = f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else ""
            head.append(f"server {code(name)}{what}: {slots} slots of {context} tokens, up in {up} s, exit {rc}")
        lines += [f"### {code(doc.name)}", "", *run_line(doc), "; ".join(head), ""]
        runs = d.get("runs", []) if isinstance(d.get("runs"), list) else []
        variants = len(servers) > 1
        cols = [
            "clients / rate",
            "server tok/s",
            "in-process tok/s",
            "server / in-process",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "steady TTFT p50 / p99 ms",
            "gap p50 ms",
            "in-process step ms",
            "gap / step",
            "server CPU ms/token",
        ]
        head_cols = ["variant", *cols] if variants else cols
        first = 1 if variants else 0
        lines += table(head_cols, _rows(runs, variants), right=tuple(range(first, len(head_cols))))
        lines += _stages(runs, variants)
        lines += _targets(d.get("targets"))
        lines += [
            "",
            f"Target: server ≥ {TARGET_RATIO:.0%} of in-process tokens/s at "
            f"{' and '.join(map(str, TARGET_CLIENTS))} clients; steady TTFT p50 ≤ 100 ms, p99 ≤ 300 ms at "
            "64 clients; gap p50 ≤ 1.2 × the in-process step.",
            "",
        ]
    return lines
