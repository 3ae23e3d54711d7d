"""This card's tuned-kernel table: `plamo2-tools warmup --tuned-out` run on the card, table kept in the result.

    python -m bench tune [--preset plamo-2-1b --dtype bfloat16 | --shards DIR] [--device cuda]
        [--table-dir DIR] [--caches DIR] [--max-batch auto] [--max-prompt-tokens N]

Runs `PLAMO2_TUNED=0 plamo2-tools warmup SHARDS --device cuda --tuned-out DIR` in a fresh process:
shipped tables off, so every decision is this card's own, measured now or read back from caches
of this session's earlier runs, which measured on this card too (`--caches DIR` names them, e.g.
`/tmp/plamo2-session/e2e/caches/this` after an `e2e` run: its Triton and tuning caches then start
warm).  With a deadline (`--max-seconds`, which the session sets) warmup starts no prefill bucket
past it, the likeliest first.  The table warmup wrote is kept in the result (`results.table`),
with warmup's report (buckets warmed and left out, Triton kernels compiled, seconds), and goes to
--table-dir too (default $PLAMO2_TUNED_DIR, else WORK/tuned), so that the session's later
benchmarks read it when the session was started with PLAMO2_TUNED_DIR set, as a fresh machine will
once it ships: commit `results.table` as plamo2_tools/kernels/tuned/<card>.json (docs/kernels.md 4.8).
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
    ap.add_argument("--caches", type=Path, default=None, help="DIR/triton, DIR/plamo2: the caches")


def run(args: argparse.Namespace, result: Result) -> None:
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        where = args.table_dir or Path(os.environ.get("PLAMO2_TUNED_DIR") or work / "tuned")
        where.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "plamo2_tools.cli",
            "warmup",
            str(shards),
            "--device",
            args.device,
            "--max-batch",
            args.max_batch,
            "--tuned-out",
            str(where),
            "--json",
        ]
        if args.max_prompt_tokens:
            cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
        if result.left() != float("inf"):  # leave time to load, warm the decode buckets and write
            cmd += ["--max-seconds", str(max(0.0, result.left() - 45.0))]
        caches = (
            {}
            if args.caches is None
            else {"TRITON_CACHE_DIR": str(args.caches / "triton"), "PLAMO2_CACHE_DIR": str(args.caches / "plamo2")}
        )
        timed = run_timed(cmd, env=tree_env(PLAMO2_TUNED="0", **caches), cwd=work)
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
