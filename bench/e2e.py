"""The README's commands from the shell, as a user meets them: a fresh pass, then warm ones.

    python -m bench e2e [--preset plamo-2-1b --dtype bfloat16 | --shards DIR] [--device cuda]
        [--steps help,synth,inspect,convert,check,verify,generate,report] [--repeat 2]
        [--tree NAME=PATH ...] [--gsm8k-dir DIR | --synthetic-data N] [--limit N]

Every step is one `plamo2-tools` command in a fresh process, timed from outside (wall, CPU of the
process and its children, peak RSS, exit status), as README.md runs it: `help` (--help), `synth`,
`inspect`, `convert` (to --layout), `check`, `check-source` (check --source), `verify` (against
the reference forward), `generate` (one prompt, --max-new-tokens), `eval` (gsm8k 5-shot, on
--gsm8k-dir or GSM8K-shaped --synthetic-data), `merge` and `report` (on the --json output of
inspect and check).  The inputs a step reads (the checkpoint, the shards) are made first, untimed;
what a step writes goes to a fresh directory each time.

Pass 1 is fresh: the Triton, PLaMo tuning and TorchInductor caches start empty, as on a new
machine (the OS page cache and Python's .pyc files are left as they are: pip compiles those at
install).  Passes 2..--repeat are warm: the same caches again.  Baselines, measured in the same
run: a bare interpreter (`python -c pass`) every pass, and with `--tree NAME=PATH` (repeatable)
the same commands from other source trees, interleaved step by step (e.g. `--tree before=DIR`,
a checkout of the commit before a change: the ratios then say what the change did).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, Result, model_inputs, parse_layout, run_cli, run_timed, tree_env, work_dir
from plamo2_tools.kinds import BENCH_E2E_KIND

KIND = BENCH_E2E_KIND
MODEL = True
PROMPT = "Question: what is 12 times 7? Answer:"
DEFAULT_STEPS = "help,synth,inspect,convert,check,verify,generate,report"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", default=DEFAULT_STEPS, help=f"of {', '.join(STEPS)} (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2, help="passes: the first fresh, the others warm")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run every step from this source tree (repeat; default: this one only)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=256, help="generate's tokens")
    data = ap.add_mutually_exclusive_group()
    data.add_argument("--gsm8k-dir", type=Path, help="eval's data: train.jsonl + test.jsonl")
    data.add_argument("--synthetic-data", type=int, metavar="N", default=40, help="else GSM8K-shaped, N problems")
    ap.add_argument("--limit", type=int, default=None, help="eval: only the first N documents")


@dataclass(frozen=True)
class Inputs:
    """What the steps' command lines are made of."""

    ckpt: Path
    shards: Path
    results: Path
    gsm8k: Path
    preset: str
    dtype: str | None
    layout: tuple[int, int]
    device: str
    tokens: int
    limit: int | None
    official_data: bool


def step_args(step: str, i: Inputs, out: Path) -> list[str]:
    """The command line of one step (after `plamo2-tools`), writing to `out` where it writes."""
    tp, pp = i.layout
    dtype = ["--dtype", i.dtype] if i.dtype else []
    device = ["--device", i.device]
    limit = ["--limit", str(i.limit)] if i.limit else []
    unverified = [] if i.official_data else ["--allow-unverified-data"]
    return {
        "help": ["--help"],
        "synth": ["synth", str(out), "--preset", i.preset, *dtype],
        "inspect": ["inspect", str(i.ckpt)],
        "convert": ["convert", str(i.ckpt), str(out), "--tp", str(tp), "--pp", str(pp)],
        "check": ["check", str(i.shards)],
        "check-source": ["check", str(i.shards), "--source", str(i.ckpt)],
        "verify": [
            "verify",
            str(i.shards),
            "--reference",
            str(i.ckpt),
            "--random",
            "2",
            "--max-new-tokens",
            "8",
            *device,
            "--output",
            f"{out}.json",
        ],
        "generate": ["generate", str(i.shards), "--prompt", PROMPT, "--max-new-tokens", str(i.tokens), *device],
        "eval": [
            "eval",
            str(i.shards),
            "--tasks",
            "gsm8k",
            "--num-fewshot",
            "5",
            "--gsm8k-dir",
            str(i.gsm8k),
            *device,
            "--output-path",
            str(out),
            *limit,
            *unverified,
        ],
        "merge": ["merge", str(i.shards), str(out)],
        "report": ["report", str(i.results), "--out", f"{out}.md"],
    }[step]


STEPS = (
    "help",
    "synth",
    "inspect",
    "convert",
    "check",
    "check-source",
    "verify",
    "generate",
    "eval",
    "merge",
    "report",
)


def timed(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Wall, CPU of the process and its children, peak RSS, exit status (and its output's end if not 0)."""
    # cwd: the run's own directory, never a source tree (`python -m` puts the working directory
    # ahead of PYTHONPATH, which would run this tree's code for every --tree).
    r = run_timed(cmd, env=env, sample=True, log=log, cwd=log.parent)
    record = {k: r[k] for k in ("wall_s", "user_s", "sys_s", "peak_rss_bytes", "rc")}
    if r["rc"] != 0:
        record["output_tail"] = log.read_text(errors="replace")[-1500:]
    return record


def trees(given: list[str]) -> dict[str, Path]:
    """NAME=PATH pairs; this tree is `this` unless named among them."""
    out: dict[str, Path] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / "plamo2_tools" / "cli").is_dir():
            raise SystemExit(f"--tree {item}: give NAME=PATH of a source tree holding plamo2_tools/")
        out[name] = Path(path).resolve()
    if ROOT not in out.values():
        out = {"this": ROOT, **out}
    return out


def prepare(args: argparse.Namespace, work: Path, result: Result, steps: list[str]) -> Inputs:
    """The checkpoint and shards (untimed; reused from --work), the report's inputs, eval's data."""
    ckpt, shards = model_inputs(args, work, result)
    if ckpt is None and {"synth", "inspect", "check-source", "verify"} & set(steps):
        raise SystemExit("these steps need the HF checkpoint: give --preset, not --shards")
    results = work / "e2e" / "results"
    if "report" in steps and not (results / "check.json").exists():
        results.mkdir(parents=True, exist_ok=True)
        (results / "check.json").write_text(run_cli("check", shards, "--json").stdout)
        if ckpt is not None:
            (results / "inspect.json").write_text(run_cli("inspect", ckpt, "--json").stdout)
    gsm8k = args.gsm8k_dir
    if gsm8k is None and "eval" in steps:
        from bench.accuracy import synthetic_gsm8k

        gsm8k = synthetic_gsm8k(work / "e2e" / "gsm8k", args.synthetic_data)
    return Inputs(
        ckpt=ckpt or shards,
        shards=shards,
        results=results,
        gsm8k=gsm8k or work,
        preset=args.preset,
        dtype=args.dtype or None,
        layout=parse_layout(args.layout),
        device=args.device,
        tokens=args.max_new_tokens,
        limit=args.limit,
        official_data=args.gsm8k_dir is not None,
    )


def run(args: argparse.Namespace, result: Result) -> None:
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"--steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})")
    sources = trees(args.tree)
    with work_dir(args) as work:
        inputs = prepare(args, work, result, steps)
        res = result.results
        res.update(
            steps=steps,
            trees={name: str(path) for name, path in sources.items()},
            commands={s: shlex.join(["plamo2-tools", *step_args(s, inputs, Path("OUT"))]) for s in steps},
            records=[],
        )
        runs = work / "e2e" / "runs"
        shutil.rmtree(work / "e2e" / "caches", ignore_errors=True)  # pass 1 starts with empty caches
        for n in range(args.repeat):
            for step in ["python", *steps]:
                for name, tree in sources.items():
                    if not fits(result, step, name):
                        result.skip(f"pass {n + 1} {step} ({name})")
                        continue
                    res["records"].append(one(step, name, tree, n, inputs, work, runs))
                    result.save()
        res["summary"] = summary(res["records"], list(sources))
        for row in res["summary"]:
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def one(step: str, name: str, tree: Path, n: int, inputs: Inputs, work: Path, runs: Path) -> dict[str, Any]:
    """One step from one tree in pass n, into a fresh output path."""
    caches = work / "e2e" / "caches" / name
    env = tree_env(
        tree,
        TRITON_CACHE_DIR=str(caches / "triton"),
        PLAMO2_CACHE_DIR=str(caches / "plamo2"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        HF_HOME=str(work / "e2e" / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    out = runs / f"{step}-{name}-{n + 1}"
    shutil.rmtree(out, ignore_errors=True)
    for leftover in (Path(f"{out}.json"), Path(f"{out}.md")):
        leftover.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if step == "python":
        cmd = [sys.executable, "-c", "pass"]
    else:
        cmd = [sys.executable, "-m", "plamo2_tools.cli", *step_args(step, inputs, out)]
    record = {
        "step": step,
        "tree": name,
        "pass": n + 1,
        "fresh": n == 0,
        **timed(cmd, env, runs / f"{step}-{name}-{n + 1}.log"),
    }
    flag = "" if record["rc"] == 0 else f"  exit {record['rc']}"
    print(
        f"pass {n + 1} {'fresh' if n == 0 else 'warm '} {name:8s} {step:12s} {record['wall_s']:8.2f} s{flag}",
        flush=True,
    )
    return record


def fits(result: Result, step: str, tree: str) -> bool:
    """Whether the step should fit in what is left: its last wall from this tree, else 5 s."""
    last = [r["wall_s"] for r in result.results["records"] if r["step"] == step and r["tree"] == tree]
    return result.left() > (last[-1] if last else 5.0) + 2.0


def summary(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per step and tree: the fresh wall, the median of the warm ones, and the ratios to the first tree."""
    rows = []
    steps = list(dict.fromkeys(r["step"] for r in records))
    for step in steps:
        base: dict[str, float | None] = {}
        for name in names:
            mine = [r for r in records if r["step"] == step and r["tree"] == name]
            if not mine:
                continue
            fresh = [r["wall_s"] for r in mine if r["fresh"]]
            warm = [r["wall_s"] for r in mine if not r["fresh"]]
            row: dict[str, Any] = {
                "step": step,
                "tree": name,
                "fresh_s": fresh[0] if fresh else None,
                "warm_s": statistics.median(warm) if warm else None,
                "warm_runs": len(warm),
                "ok": all(r["rc"] == 0 for r in mine),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mine),
            }
            if name == names[0]:
                base = {"fresh_s": row["fresh_s"], "warm_s": row["warm_s"]}
            else:
                for key in ("fresh_s", "warm_s"):
                    b = base.get(key)
                    row[f"{key[:-2]}_vs_{names[0]}"] = row[key] / b if row[key] is not None and b else None
            rows.append(row)
    return rows
