"""This card's tuned-kernel table: `plamo2-tools warmup --tuned-out` run on the card, table kept in the result.

    python -m bench tune [--preset plamo-2-1b --dtype bfloat16 | --shards DIR] [--device cuda]
        [--table-dir DIR] [--max-batch auto] [--max-prompt-tokens N]

Runs `PLAMO2_TUNED=0 plamo2-tools warmup SHARDS --device cuda --tuned-out DIR` in a fresh process
(shipped tables off, so every decision is this card's own measurement, or read back from the
caches of this session's earlier runs, which measured on this card too) and keeps the table it
wrote in the result (`results.table`), with warmup's own report (buckets warmed, Triton kernels
compiled, seconds).  The table goes to --table-dir too (default $PLAMO2_TUNED_DIR, else WORK/tuned),
so that later benchmarks of a session started with PLAMO2_TUNED_DIR set read it, as a fresh machine
will once it ships: commit `results.table` as plamo2_tools/kernels/tuned/<card>.json
(docs/kernels.md 4.8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import Result, model_inputs, run_timed, tree_env, work_dir
from plamo2_tools.kinds import BENCH_TUNE_KIND

KIND = BENCH_TUNE_KIND
MODEL = True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--table-dir", type=Path, default=None, help="where the table goes (default: see above)")
    ap.add_argument("--max-batch", default="auto", help="warmup's decode slots (default: auto)")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="warmup's largest prefill (default: the budget)"
    )


def run(args: argparse.Namespace, result: Result) -> None:
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        where = args.table_dir or Path(os.environ.get("PLAMO2_TUNED_DIR") or work / "tuned")
        where.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "plamo2_tools.cli", "warmup", str(shards), "--device", args.device,
               "--max-batch", args.max_batch, "--tuned-out", str(where), "--json"]  # fmt: skip
        if args.max_prompt_tokens:
            cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
        timed = run_timed(cmd, env=tree_env(PLAMO2_TUNED="0"), cwd=work)
        res = result.results
        res.update(command=cmd[2:], wall_s=timed["wall_s"], rc=timed["rc"], table_dir=str(where))
        if timed["rc"] != 0:
            res["output_tail"] = (timed["stderr"] or timed["stdout"])[-2000:]
            raise RuntimeError(f"warmup exited {timed['rc']}")
        report = json.loads(timed["stdout"])  # --json: stdout holds exactly the report
        res["warmup"] = report
        table = Path(report["tuned_table"])
        res["table_file"] = table.name
        res["table"] = json.loads(table.read_text())
        result.save()
        print(f"tuned table for {res['table']['card']}: {table}", flush=True)
