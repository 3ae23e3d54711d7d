"""metrics.py writes what Prometheus reads: checked by our strict reader and the official parser."""

from __future__ import annotations

import pytest
from serve_prom import parse_exposition

from plamo2_tools.serve.metrics import Counter, Gauge, Histogram, RateWindow, Registry, ServerMetrics, format_value


def test_labels_and_help_are_escaped() -> None:
    r = Registry()
    c = r.add(Counter("x_total", "help with \\ backslash\nand newline", ("path",)))
    c.inc(path='a "quoted" \\ path\nwith newline')
    c.inc(2, path="plain")
    fams = parse_exposition(r.render())
    assert fams["x_total"].value(path='a "quoted" \\ path\nwith newline') == 1
    assert fams["x_total"].value(path="plain") == 2
    assert fams["x_total"].help == "help with \\\\ backslash\\nand newline"


def test_histogram_buckets_are_cumulative_with_inf_equal_to_count() -> None:
    r = Registry()
    h = r.add(Histogram("lat_seconds", "latency", (0.1, 1.0)))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    h.observe(0.5, count=3)
    fam = parse_exposition(r.render())["lat_seconds"]
    buckets = {lab["le"]: v for n, lab, v in fam.samples if n.endswith("_bucket")}
    assert buckets == {"0.1": 2, "1.0": 6, "+Inf": 7}
    assert [v for n, _, v in fam.samples if n == "lat_seconds_sum"] == [pytest.approx(0.05 + 0.1 + 0.5 + 3.0 + 1.5)]


def test_gauge_reads_its_function_at_render_time() -> None:
    box = [3]
    r = Registry()
    r.add(Gauge("q", "queue", read=lambda: box[0]))
    assert parse_exposition(r.render())["q"].value() == 3
    box[0] = 5
    assert parse_exposition(r.render())["q"].value() == 5


def test_the_server_metric_set_is_valid_when_empty_and_used() -> None:
    m = ServerMetrics(waiting=lambda: 1, running=lambda: 2, admitted=lambda: 3)
    parse_exposition(m.render())
    m.http_requests.inc(endpoint="/v1/completions", status="200")
    m.finished.inc(reason="cancelled")
    m.ttft.observe(0.2)
    m.tpot.observe(0.01, 5)
    fams = parse_exposition(m.render())
    assert fams["plamo2_queue_length"].value() == 1 and fams["plamo2_running_sequences"].value() == 2
    assert fams["plamo2_sequences_finished_total"].value(reason="cancelled") == 1


def test_names_and_values_are_refused_or_formatted_by_the_rules() -> None:
    with pytest.raises(ValueError):
        Counter("no_suffix", "x")
    with pytest.raises(ValueError):
        Gauge("bad-name", "x")
    with pytest.raises(ValueError):
        Counter("c_total", "x").inc(-1)
    assert [format_value(v) for v in (3, 2.0, 0.25, float("inf"), float("nan"))] == ["3", "2", "0.25", "+Inf", "NaN"]


def test_rate_window_forgets_old_events() -> None:
    now = [100.0]
    w = RateWindow(window=10, clock=lambda: now[0])
    now[0] = 110.0
    w.add(50)
    assert w.rate() == 5.0
    now[0] = 125.0
    assert w.rate() == 0.0
