"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Only what the server needs: counters, gauges (set, or read from a function at scrape time) and
histograms, each with a fixed set of label names.  All updates happen on the event-loop thread
(the app and its middleware run there), so there are no locks.

Format rules kept (https://prometheus.io/docs/instrumenting/exposition_formats/): one ``# HELP``
and one ``# TYPE`` line per family before its samples; names ``[a-zA-Z_:][a-zA-Z0-9_:]*``, label
names ``[a-zA-Z_][a-zA-Z0-9_]*``; label values escape backslash, double quote and newline, HELP
text backslash and newline; counters end in ``_total``; histogram buckets are cumulative, end
with ``le="+Inf"`` equal to ``_count``, followed by ``_sum`` and ``_count``.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
Labels = tuple[str, ...]


def format_value(v: float) -> str:
    if isinstance(v, int) or (math.isfinite(v) and v == int(v) and abs(v) < 2**53):
        return str(int(v))
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Family:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.match(name) or not all(_LABEL.match(n) and not n.startswith("__") for n in labels):
            raise ValueError(f"invalid metric or label name: {name} {labels}")
        self.name, self.help, self.labels = name, help, tuple(labels)

    def _key(self, labels: dict[str, str]) -> Labels:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Family):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        super().__init__(name, help, labels)
        self.values: dict[Labels, float] = {} if labels else {(): 0}

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_label_text(self.labels, k)} {format_value(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Family):
    """A value set by the code, or read from `read()` at every scrape (no labels then)."""

    kind = "gauge"

    def __init__(
        self, name: str, help: str, labels: Sequence[str] = (), read: Callable[[], float] | None = None
    ) -> None:
        super().__init__(name, help, labels)
        self.read = read
        self.values: dict[Labels, float] = {} if labels else {(): 0}

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = value

    def lines(self) -> list[str]:
        if self.read is not None:
            return [f"{self.name} {format_value(self.read())}"]
        return [f"{self.name}{_label_text(self.labels, k)} {format_value(v)}" for k, v in sorted(self.values.items())]


class Histogram(_Family):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("histogram buckets must be distinct and increasing")
        self.buckets = tuple(float(b) for b in buckets if not math.isinf(b))
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (tokens that arrived together share one latency)."""
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += count
        self.sum += value * count
        self.count += count

    def lines(self) -> list[str]:
        out, running = [], 0
        for b, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += c
            le = "+Inf" if math.isinf(b) else repr(b)  # "1.0" as the official clients write it
            out.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        out += [f"{self.name}_sum {format_value(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class Registry:
    def __init__(self) -> None:
        self.families: list[_Family] = []

    def add(self, family: _Family) -> _Family:
        if any(f.name == family.name for f in self.families):
            raise ValueError(f"metric {family.name} registered twice")
        self.families.append(family)
        return family

    def render(self) -> str:
        lines: list[str] = []
        for f in self.families:
            lines += f.header() + f.lines()
        return "\n".join(lines) + "\n"


class RateWindow:
    """Events per second over the last `window` seconds (the tokens-per-second gauge): a rate that
    a person reading /metrics by hand can use; Prometheus itself would rate() the counter."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.clock = window, clock
        self.start = clock()
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, n: int) -> None:
        self.events.append((self.clock(), n))
        self.total += n
        self._trim()

    def rate(self) -> float:
        self._trim()
        span = min(self.window, max(self.clock() - self.start, 1e-9))
        return self.total / span

    def _trim(self) -> None:
        cutoff = self.clock() - self.window
        while self.events and self.events[0][0] < cutoff:
            self.total -= self.events.popleft()[1]


# vLLM's buckets (seconds), so that dashboards built for vLLM read ours.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The server's metric set.  `waiting`/`running` are read from the engine at each scrape."""

    def __init__(
        self,
        waiting: Callable[[], float],
        running: Callable[[], float],
        admitted: Callable[[], float],
        prefix: str = "plamo2_",
    ) -> None:
        p = prefix
        self.registry = r = Registry()
        self.rate = RateWindow()
        self.http_requests = r.add(
            Counter(
                f"{p}http_requests_total",
                "HTTP requests answered, by endpoint and status (499: the client went away)",
                ("endpoint", "status"),
            )
        )
        self.finished = r.add(
            Counter(
                f"{p}sequences_finished_total",
                "Sequences ended, by reason (stop, length, cancelled, error)",
                ("reason",),
            )
        )
        self.prompt_tokens = r.add(Counter(f"{p}prompt_tokens_total", "Prompt tokens admitted"))
        self.generation_tokens = r.add(Counter(f"{p}generation_tokens_total", "Tokens generated"))
        r.add(
            Gauge(
                f"{p}generation_tokens_per_second",
                "Tokens generated per second over the last 10 s",
                read=self.rate.rate,
            )
        )
        r.add(Gauge(f"{p}queue_length", "Sequences waiting for a decode slot (engine)", read=waiting))
        r.add(Gauge(f"{p}running_sequences", "Sequences decoding now (engine)", read=running))
        r.add(Gauge(f"{p}admitted_sequences", "Sequences admitted by the server and not finished", read=admitted))
        self.ttft = r.add(
            Histogram(
                f"{p}time_to_first_token_seconds", "From request arrival to a sequence's first token", TTFT_BUCKETS
            )
        )
        self.tpot = r.add(
            Histogram(f"{p}time_per_output_token_seconds", "Between a sequence's tokens after the first", TPOT_BUCKETS)
        )
        self.e2e = r.add(
            Histogram(
                f"{p}e2e_request_latency_seconds", "From request arrival to the end of its last sequence", E2E_BUCKETS
            )
        )

    def render(self) -> str:
        return self.registry.render()


class SequenceClock:
    """Latency bookkeeping of one sequence: `tokens(n)` for every event, with the n it carries."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics, self.last = metrics, arrival
        self.first = True

    def tokens(self, n: int) -> None:
        if not n:
            return
        now, m = time.monotonic(), self.metrics
        m.generation_tokens.inc(n)
        m.rate.add(n)
        if self.first:
            # Tokens that came with the first one have no latency of their own: not observed.
            m.ttft.observe(now - self.last)
            self.first = False
        else:
            m.tpot.observe((now - self.last) / n, n)  # n tokens that arrived together share the wait
        self.last = now
