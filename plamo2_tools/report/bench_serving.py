"""The server under load (`python -m bench serving`, kind plamo2-bench-serving; plamo2-bench-serve from
bench/serve.py before the suite): per number of
concurrent streaming clients, output tokens/s of `plamo2-tools serve` beside in-process
`Runtime.generate` on the same requests, and the clients' time to first token and per token."""

from __future__ import annotations

from typing import Any

from .bench import payload, run_line
from .context import Context
from .inputs import Doc
from .markdown import MISSING, code, is_number, table

TARGET_RATIO = 0.9  # issue 20: the server keeps >= 90% of in-process throughput at 64 and 256 clients
TARGET_CLIENTS = (64, 256)


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if is_number(v) else MISSING


def _ms(v: Any) -> str:
    return f"{1000 * v:,.1f}" if is_number(v) else MISSING


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Server under load", ""]
    for doc in docs:
        d = payload(doc)
        cfg = d.get("config") if isinstance(d.get("config"), dict) else {}
        server = d.get("server") if isinstance(d.get("server"), dict) else {}
        head = [f"shards {code(d.get('shards', '?'))}"]
        prompt, answer, per = cfg.get("prompt_tokens", "?"), cfg.get("max_tokens", "?"), cfg.get("per_client", "?")
        head.append(f"prompts {prompt} ± 25% tokens, answers {answer} tokens, {per} requests per client")
        if server:
            up, rc = _num(server.get("startup_s"), ".1f"), server.get("exit_code", "?")
            slots, context = server.get("slots", "?"), server.get("context", "?")
            head.append(f"server: {slots} slots of {context} tokens, up in {up} s, exit {rc}")
        lines += [f"### {code(doc.name)}", "", *run_line(doc), "; ".join(head), ""]
        rows = []
        for r in d.get("runs", []):
            if not isinstance(r, dict):
                continue
            if r.get("skipped"):
                rows.append([r.get("clients", "?"), "skipped (time)", "", "", "", "", "", ""])
                continue
            ip = r.get("in_process") if isinstance(r.get("in_process"), dict) else {}
            ratio = r.get("ratio")
            verdict = ""
            if is_number(ratio) and r.get("clients") in TARGET_CLIENTS:
                verdict = " ✅" if ratio >= TARGET_RATIO else " ❌"
            note = "" if r.get("complete", True) else " (cut)"
            speeds = [_num(r.get("tokens_per_s"), ",.1f"), _num(ip.get("tokens_per_s"), ",.1f")]
            times = [_ms(r.get(k)) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")]
            share = (f"{ratio:.0%}" if is_number(ratio) else MISSING) + verdict
            rows.append([f"{r.get('clients', '?')}{note}", *speeds, share, *times])
        lines += table(["clients", "server tok/s", "in-process tok/s", "server / in-process", "TTFT p50 ms",
                        "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"], rows, right=tuple(range(8)))  # fmt: skip
        lines += ["", f"Target: server ≥ {TARGET_RATIO:.0%} of in-process tokens/s at "
                      f"{' and '.join(map(str, TARGET_CLIENTS))} clients.", ""]  # fmt: skip
    return lines
