"""`plamo2-tools warmup SHARDS` (issue 33): it runs a prefill at every (tokens, sequences) bucket of
the plan and decode at every batch bucket of the pool, reports it, and refuses bad input with one
line before loading anything.  (What it fills, Triton's and our tuning caches, needs a GPU: the GPU
script runs it there and reports the kernels compiled.)

Seen failing: with `prefill_buckets` stopping one doubling early, the (64, *) buckets are not run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.runtime.batching import warmup
from plamo2_tools.runtime.batching.engine import Runtime


def test_prefill_buckets_by_the_rule() -> None:
    """Powers of two of tokens from 16, of sequences from 1, at least 16 tokens per sequence."""
    assert warmup.prefill_buckets(64, 4) == [(16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (64, 4)]
    assert warmup.prefill_buckets(100, 1) == [(16, 1), (32, 1), (64, 1)]
    assert warmup.prefill_buckets(8, 8) == [(16, 1)]


def test_warmup_runs_the_plan(cli, shards, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, object]] = []
    real = Runtime.generate

    def spy(self, prompts, max_new_tokens, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((len(prompts), sum(map(len, prompts)), max_new_tokens))
        return real(self, prompts, max_new_tokens, **kwargs)

    monkeypatch.setattr(Runtime, "generate", spy)
    r = cli(
        "warmup",
        shards("tiny", 1, 1, seed=11),
        "--max-batch",
        "4",
        "--capacity",
        "64",
        "--max-prompt-tokens",
        "64",
        "--json",
    )
    result = json.loads(r.stdout)
    plan = [tuple(b) for b in result["plan"]["prefill"]]
    assert plan == warmup.prefill_buckets(64, 4) and result["plan"]["slots"] == 4
    prefill = [(n, tokens) for n, tokens, new in calls if new == 1]
    assert prefill == [(s, (t // s) * s) for t, s in warmup.prefill_order(tuple(plan))]  # one forward per bucket
    assert sorted(n for n, _, new in calls if new == 3) == [1, 2, 4]  # decode at every batch bucket
    assert set(result["seconds"]) == {"prefill", "decode"} and result["left_out"] == []


def test_the_likeliest_buckets_first_and_none_past_the_deadline(cli, shards) -> None:
    plan = warmup.prefill_buckets(64, 4)
    assert warmup.prefill_order(tuple(plan)) == [(16, 1), (32, 1), (64, 1), (64, 4), (64, 2), (32, 2)]
    r = cli(
        "warmup",
        shards("tiny", 1, 1, seed=11),
        "--max-batch",
        "4",
        "--capacity",
        "64",
        "--max-prompt-tokens",
        "64",
        "--max-seconds",
        "0",
        "--json",
    )
    assert [tuple(b) for b in json.loads(r.stdout)["left_out"]] == warmup.prefill_order(tuple(plan))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--max-batch", "0"), "--max-batch 0: must be >= 1"),
        (("--capacity", "1"), "--capacity 1: must be >= 2"),
        (("--modes", "beam"), "--modes 'beam'"),
        (("--tuned-out", "tables"), "--tuned-out: a card's table is measured on that card"),
        (("--device", "tpu"), "is not a device"),
    ],
)
def test_refusals(cli, one_line_error, shards, tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    line = one_line_error(cli("warmup", shards("tiny", 1, 1, seed=11), *args, expect=2), 2)
    assert words in line, line


def test_not_a_shard_directory(cli, one_line_error, tmp_path: Path) -> None:
    assert "no plamo2_shards.json" in one_line_error(cli("warmup", tmp_path, expect=2), 2)
