"""`python -m bench throughput` and `python -m bench accuracy` run end to end on the CPU with a tiny
model (a GPU session has one chance: the benchmarks must not crash on an API drift), and write what
the report reads."""

from __future__ import annotations

from pathlib import Path

from bench_helpers import rendered, run_json

from plamo2_tools.kinds import BENCH_ACCURACY_KIND, BENCH_SCHEMA_VERSION, BENCH_THROUGHPUT_KIND

THROUGHPUT = "--device cpu --modes torch-eager --decode 1,4 --steps 8 --context 16 --prefill 64 --packed 16 "
THROUGHPUT += "--schedule 12 --prompt-tokens 20 --batch 6"
ACCURACY = "--device cpu --synthetic-data 12 --limit 5 --batch-size auto --max-gen-toks 8 --capacity 2048"


def test_throughput_on_cpu(cli, shards, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    data = run_json("throughput", "--shards", shards("tiny", 1, 1, seed=11), *THROUGHPUT.split(), out=out)
    assert (data["kind"], data["schema_version"], data["complete"]) == (
        BENCH_THROUGHPUT_KIND,
        BENCH_SCHEMA_VERSION,
        True,
    )
    res = data["results"]
    assert res["bytes"]["weights"] > 0 and res["bytes"]["kv_per_token"] > 0  # what the floor is made of
    phases = [r["phase"] for r in res["runs"]]
    assert phases == ["decode", "decode", "prefill", "prefill-packed", "schedule"]
    packed = res["runs"][3]
    assert (packed["sequences"], packed["tokens"], packed["forwards"]) == (4, 64, 1)
    sched = res["runs"][4]
    assert sched["batch"] == 6 and sched["requests"] == 12 and sched["loop"]["groups"] >= 2
    assert all(r["tokens_per_s"] is None or isinstance(r["tokens_per_s"], float) for r in res["runs"])
    assert "## Runtime throughput" in rendered(cli, out)


def test_accuracy_on_cpu(cli, shards, tmp_path: Path) -> None:
    out = tmp_path / "accuracy.json"
    data = run_json("accuracy", "--shards", shards("tiny", 1, 1, seed=11), *ACCURACY.split(), out=out)
    assert (data["kind"], data["complete"]) == (BENCH_ACCURACY_KIND, True)
    res = data["results"]
    assert res["documents"] == 5 and res["synthetic_data"] is True
    split = {"load", "warm_up", "generate", "prefill_device", "decode_device", "generate_host", "lm_eval_other"}
    assert set(res["split_seconds"]) == split
    assert res["auto_batch"]["slots"] >= res["batch_size"] == 5
    assert res["prefill"]["tokens"] > 5 * 500 and res["generated_tokens"] == 5 * 8
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(res["metrics"])
    text = rendered(cli, out)
    assert "## GSM8K offline" in text and "published for pfnet/plamo-2-1b" in text
