"""GET /metrics on a live server: valid Prometheus text, and numbers that match the traffic."""

from __future__ import annotations

from typing import Any

import httpx
from serve_prom import parse_exposition


def test_metrics_follow_the_traffic(serve: Any) -> None:
    server = serve()
    empty = httpx.get(f"{server.url}/metrics")
    assert empty.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    parse_exposition(empty.text)
    client = server.client()
    usage = [
        client.completions.create(model="fake-plamo", prompt=p, max_tokens=m, temperature=0).usage
        for p, m in (("abc", 5), ("hello", 9), ("ab<eos>", 9))
    ]
    list(client.completions.create(model="fake-plamo", prompt="xyz", max_tokens=4, temperature=0, stream=True))
    httpx.post(f"{server.url}/v1/completions", json={"prompt": ""})  # a 400
    httpx.get(f"{server.url}/nowhere")  # a 404 on an endpoint we do not label by name

    fams = parse_exposition(server.metrics())
    req = fams["plamo2_http_requests_total"]
    assert req.value(endpoint="/v1/completions", status="200") == 4
    assert req.value(endpoint="/v1/completions", status="400") == 1
    assert req.value(endpoint="other", status="404") == 1
    generated = sum(u.completion_tokens for u in usage) + 4  # type: ignore[union-attr]
    assert fams["plamo2_generation_tokens_total"].value() == generated
    assert fams["plamo2_prompt_tokens_total"].value() == sum(u.prompt_tokens for u in usage) + 4  # type: ignore[union-attr]
    fin = fams["plamo2_sequences_finished_total"]
    assert fin.value(reason="length") == 3 and fin.value(reason="stop") == 1
    ttft = fams["plamo2_time_to_first_token_seconds"]
    assert [v for n, _, v in ttft.samples if n.endswith("_count")] == [4]
    tpot = fams["plamo2_time_per_output_token_seconds"]
    assert [v for n, _, v in tpot.samples if n.endswith("_count")] == [generated - 4]
    assert fams["plamo2_generation_tokens_per_second"].value() > 0
    for gauge in ("plamo2_queue_length", "plamo2_running_sequences", "plamo2_admitted_sequences"):
        assert fams[gauge].value() == 0 and fams[gauge].type == "gauge"
