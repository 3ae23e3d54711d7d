"""Multi-part shard directories run by every runner, and damage found on any rank and part.

plamo-2-8b at the default part size is a multi-part directory (several files per rank): generate,
verify and eval run one here (`convert --max-part-size` small) on thread ranks and on real
torchrun (gloo) ranks, and must give what the single-file layout gives.  A byte flipped in the
*last* part of the *last* rank (not rank 0's first file, the only one damaged elsewhere) is
refused at load by each of them, naming that file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.errors import CheckpointError
from plamo2_tools.runtime.batching.generation import generate_job
from plamo2_tools.runtime.process.jobs import run_job

MINI_GSM8K = Path(__file__).parents[1] / "eval" / "data" / "gsm8k_mini"
EVAL = (
    "--tasks",
    "gsm8k",
    "--gsm8k-dir",
    MINI_GSM8K,
    "--allow-unverified-data",
    "--limit",
    "2",
    "--num-fewshot",
    "0",
    "--max-gen-toks",
    "4",
    "--bootstrap-iters",
    "0",
)
PART = "20000"  # bytes: the tiny model's ranks in 3+ files each
PROMPTS = [[5, 17, 99, 3, 250], [7, 8]]


def parts(out: Path, rank: int) -> list[Path]:
    files = out.glob(f"model-rank-{rank}-part-*.safetensors")
    return sorted(files, key=lambda p: int(p.stem.rsplit("-", 1)[1]))


@pytest.fixture(scope="module")
def layouts(shards):  # type: ignore[no-untyped-def]
    """(multi-part, single-file) of the runtime tests' model at TP2 x PP2 and TP2."""

    def get(tp: int, pp: int) -> tuple[Path, Path]:
        multi = shards("tiny", tp, pp, "--max-part-size", PART, seed=11)
        assert all(len(parts(multi, r)) >= 2 for r in range(tp * pp))
        return multi, shards("tiny", tp, pp, seed=11)

    return get


@pytest.fixture
def damaged(layouts, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A private copy of the multi-part TP x PP layout with one byte flipped in the payload of the
    last part of the last rank (the manifest is left alone)."""

    def make(tp: int, pp: int) -> tuple[Path, str]:
        import shutil

        out = tmp_path / f"damaged-{tp}x{pp}"
        shutil.copytree(layouts(tp, pp)[0], out)
        last = parts(out, tp * pp - 1)[-1]
        data = bytearray(last.read_bytes())
        data[-5] ^= 0x10
        last.write_bytes(bytes(data))
        return out, last.name

    return make


def _generate(cli, shards: Path, *extra: str) -> list[int]:  # type: ignore[no-untyped-def]
    r = cli("generate", shards, "--prompt", "hello world", "--max-new-tokens", "5", "--json", *extra)
    return json.loads(r.stdout)["tokens"]


def test_damage_on_the_last_rank_and_part_is_refused_by_every_runner(
    cli, one_line_error, damaged, checkpoint, tmp_path: Path
) -> None:
    out, name = damaged(2, 2)
    commands = {
        "generate": ("generate", out, "--prompt", "hello", "--max-new-tokens", "2"),
        "verify": ("verify", out, "--reference", checkpoint("tiny", seed=11), "--max-new-tokens", "2"),
        "eval": ("eval", out, *EVAL, "--output-path", tmp_path / "eval-out"),
    }
    for what, args in commands.items():
        line = one_line_error(cli(*args, expect=2), 2)
        assert name in line and "digest differs from the manifest" in line, (what, line)


def test_damage_is_refused_before_torchrun_ranks_start(damaged) -> None:
    out, name = damaged(2, 1)
    with pytest.raises(CheckpointError, match=name):
        run_job(generate_job, {"shards": str(out)}, {"prompts": PROMPTS, "max_new_tokens": 2}, launch=True)


def test_generate_on_thread_ranks(cli, layouts) -> None:  # type: ignore[no-untyped-def]
    multi, single = layouts(2, 2)
    assert _generate(cli, multi) == _generate(cli, single)


def test_generate_on_torchrun_ranks(layouts) -> None:  # type: ignore[no-untyped-def]
    multi, single = layouts(2, 1)
    args = {"prompts": PROMPTS, "max_new_tokens": 4}
    launched = run_job(generate_job, {"shards": str(multi)}, args, launch=True)
    assert launched == run_job(generate_job, {"shards": str(single)}, args)


def test_verify_on_thread_and_torchrun_ranks(cli, layouts, checkpoint) -> None:  # type: ignore[no-untyped-def]
    multi, _ = layouts(2, 1)
    ref = checkpoint("tiny", seed=11)
    for launch in ((), ("--launch",)):
        r = cli("verify", multi, "--reference", ref, "--random", "2", "--max-new-tokens", "3", "--json", *launch)
        result = json.loads(r.stdout)
        assert result["passed"] is True and [t["kind"] for t in result["targets"]] == ["shards"], launch


def test_eval_on_thread_and_torchrun_ranks(cli, layouts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    multi, single = layouts(2, 1)
    results = {}
    for name, shards, extra in (("single", single, ()), ("multi", multi, ()), ("multi-launch", multi, ("--launch",))):
        cli("eval", shards, *EVAL, "--output-path", tmp_path / name, *extra)
        found = sorted((tmp_path / name).rglob("results*.json"))
        assert found, name
        results[name] = json.loads(found[-1].read_text())["results"]
    assert results["multi"] == results["single"] == results["multi-launch"]
