"""Per-request stage times of the server (off by default): where one request's time to first token
goes, stage by stage, with the clock every process of the server shares (`time.monotonic`,
CLOCK_MONOTONIC: one clock for the HTTP process and the engine's).

    PLAMO2_SERVE_TRACE=trace.jsonl plamo2-tools serve SHARDS ...
    python -m plamo2_tools.serve.trace trace.jsonl        # p50 / p99 of every stage

One JSON line per finished request: its id, whether it streamed, its token counts and `stamps`, the
time each stage was reached (seconds, monotonic).  The stages, in order (`STAGES`):

| stage | when | the step before it measures |
|---|---|---|
| arrival | the request's headers were parsed (the ASGI call began) | |
| parsed | the body was read and validated (pydantic) | reading + parsing the body |
| tokenized | the prompts are token ids, checked against the model | tokenizing (on the tokenizer thread) |
| admitted | admission (429 or not) and fan-out into sequences done | admission |
| submitted | the engine was handed the first sequence | the handler's own tasks starting |
| taken | the engine's loop took it from its inbox | the hand-over to the loop, plus its iteration in flight |
| scheduled | the loop admitted it into a prefill group | waiting for a slot or the refill rule |
| prefilled | its first token was sampled (prefill done, loaded into its slot) | the prefill forward(s) |
| drained | the loop read that token back and made the first event | `sync_every` decode steps (the host's lag) |
| delivered | the HTTP event loop got the event | the engine's hand-over to the HTTP process |
| written | the first chunk with a token was written to the socket | text, JSON, SSE framing |

Off, it costs one `is None` test per request and per stage in the HTTP handler, and one per
request in the loop (`Request.stamps`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

TRACE_ENV = "PLAMO2_SERVE_TRACE"
STAGES = (
    "arrival",
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


class RequestTrace:
    """One request's stamps (made by the handler only when tracing)."""

    __slots__ = ("stamps", "info", "tracer", "done")

    def __init__(self, tracer: Tracer, arrival: float) -> None:
        self.tracer = tracer
        self.stamps: dict[str, float] = {"arrival": arrival}
        self.info: dict[str, Any] = {}
        self.done = False

    def mark(self, stage: str, at: float | None = None) -> None:
        self.stamps.setdefault(stage, time.monotonic() if at is None else at)

    def merge(self, stamps: Mapping[str, float] | None) -> None:
        """The engine's stamps of the first sequence's first event (later ones are ignored)."""
        if stamps:
            for k, v in stamps.items():
                self.stamps.setdefault(k, v)

    def finish(self, **info: Any) -> None:
        if not self.done:
            self.done = True
            self.info.update(info)
            self.tracer.write(self)


class Tracer:
    """Appends one JSON line per request to a file (a lock: the handler's tasks and the engine's
    threads may finish requests)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.file: TextIO = self.path.open("a", encoding="utf-8")
        self.lock = threading.Lock()

    def start(self, arrival: float) -> RequestTrace:
        return RequestTrace(self, arrival)

    def write(self, trace: RequestTrace) -> None:
        line = json.dumps({**trace.info, "stamps": trace.stamps})
        with self.lock:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        with self.lock:
            self.file.close()


def tracer_from_env() -> Tracer | None:
    path = os.environ.get(TRACE_ENV)
    return Tracer(path) if path else None


# ---- reading a trace ------------------------------------------------------------------------------
def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(rec, dict) and isinstance(rec.get("stamps"), dict):
            out.append(rec)
    return out


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def stage_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stage: p50 / p99 / mean seconds from the stage before it that the record has (and
    `total`: arrival to written), over the records that reached it."""
    steps: dict[str, list[float]] = {s: [] for s in (*STAGES[1:], "total")}
    for rec in records:
        st = rec["stamps"]
        prev = st.get("arrival")
        for stage in STAGES[1:]:
            if stage in st and prev is not None:
                steps[stage].append(st[stage] - prev)
                prev = st[stage]
        if "arrival" in st and "written" in st:
            steps["total"].append(st["written"] - st["arrival"])
    return {
        k: {"count": len(v), "p50_s": _quantile(v, 0.5), "p99_s": _quantile(v, 0.99), "mean_s": sum(v) / len(v)}
        for k, v in steps.items()
        if v
    }


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    lines = [f"{'stage':<10} {'n':>6} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}"]
    for stage, s in summary.items():
        lines.append(
            f"{stage:<10} {int(s['count']):>6} {1e3 * s['p50_s']:>9.2f} {1e3 * s['p99_s']:>9.2f} "
            f"{1e3 * s['mean_s']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m plamo2_tools.serve.trace TRACE.jsonl", file=sys.stderr)
        return 2
    print(format_summary(stage_summary(read(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
