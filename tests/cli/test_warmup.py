"""`plamo2-tools warmup SHARDS` (issue 33): it runs a prefill of every (tokens, sequences) shape of
the plan (`prefill_shapes`, whose completeness tests/serve/test_warm_shapes.py proves) and decode at
every batch bucket of the pool, reports it, and refuses bad input with one line before loading
anything.  (What it fills, Triton's and our tuning caches, needs a GPU: the GPU script runs it there
and reports the kernels compiled.)

Seen failing: with the plan built from the budget halved (the (32..63, *) shapes are not run), with
a prefill's tokens rounded down to a multiple of its sequences (a shape's integer class lost).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.runtime.batching import warmup
from plamo2_tools.runtime.batching.engine import Runtime


def test_the_plan_is_every_shape_of_the_budget() -> None:
    """Every token count up to the budget in its (bucket, class), sequences up to the pool."""
    assert warmup.prefill_shapes(64, 4)[-3:] == [(63, 1), (63, 2), (63, 4)]
    assert {t for t, _ in warmup.prefill_shapes(64, 4)} == {1, 2, 4, 8, 15, 16, 31, 32, 48, 63}
    assert max(s for _, s in warmup.prefill_shapes(100, 1)) == 1


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
    assert plan == warmup.prefill_shapes(64, 4) and result["plan"]["slots"] == 4
    prefill = [(n, tokens) for n, tokens, new in calls if new == 1]
    assert prefill == [(s, t) for t, s in warmup.prefill_order(tuple(plan))]  # one forward per shape, T exact
    assert sorted(n for n, _, new in calls if new == 3) == [1, 2, 4]  # decode at every batch bucket
    assert set(result["seconds"]) == {"prefill", "decode"} and result["left_out"] == []


def test_the_likeliest_buckets_first_and_none_past_the_deadline(cli, shards) -> None:
    plan = warmup.prefill_shapes(64, 4)
    order = warmup.prefill_order(tuple(plan))
    singles = [t for t, s in plan if s == 1]
    assert order[: len(singles)] == [(t, 1) for t in singles]  # a generate's shapes first, shortest first
    assert order[len(singles) : len(singles) + 3] == [(63, 4), (63, 2), (48, 4)]  # then the largest forwards
    assert sorted(order) == sorted(plan)
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
