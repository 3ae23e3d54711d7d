"""The long fuzz campaign of issues 21 and 28: every target of tests/security/fuzzing.py
(safetensors headers, manifests, PLaMo 2 and PLaMo 3 configs, tokenizer.jsonl files and rows,
journals, result files, CLI option values, batch request files and their results files) in turn,
each for an equal share of `--minutes`, Hypothesis generating the inputs; every run held to the
contract (exit 0-3, one `error:` line on 2/3, never 70, never a traceback, never a hang).  The
JSON names the commit it ran on (`git`, and `git_dirty` when the tree had changes).

Writes the number of inputs tried and how they ended, per target, to a JSON file
(`plamo2-tools report` reads it: kind plamo2-bench-fuzz).  Run it niced on a shared machine:

    nice -n 19 python bench/fuzz.py --minutes 10 --out reports/fuzz/fuzz-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "security")]
os.environ.setdefault("TRITON_INTERPRET", "1")

from plamo2_tools.kinds import BENCH_FUZZ_KIND as KIND  # noqa: E402 - after sys.path above
from plamo2_tools.kinds import BENCH_FUZZ_SCHEMA_VERSION as SCHEMA_VERSION  # noqa: E402

BATCH = 40  # inputs per Hypothesis run; the time budget is checked between runs


def campaign(name: str, seconds: float, bases, tally, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Runs of BATCH generated inputs, each run from its own seed, until `seconds` are used."""
    from fuzzing import run_target
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    stop, run = time.monotonic() + seconds, 0
    while time.monotonic() < stop:

        @with_seed(seed * 100_003 + run)
        @settings(
            max_examples=BATCH,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def one(data: st.DataObject) -> None:
            scratch = Path(tempfile.mkdtemp(prefix="plamo2-fuzz-"))
            try:
                run_target(name, data.draw, bases, scratch, tally)  # recorded, never raised: keep going
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

        one()
        run += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "fuzz" / "fuzz-cpu.json")
    parser.add_argument("--seed", type=int, default=21)
    args = parser.parse_args()

    import torch
    from fuzzing import LIMIT_S, TARGETS, Tally, make_bases

    torch.set_num_threads(1)
    commit, dirty = _git_commit(), _git_dirty()  # what the campaign starts on (commits may land meanwhile)
    tally = Tally()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plamo2-fuzz-bases-") as tmp:
        bases = make_bases(Path(tmp))
        share = args.minutes * 60 / len(TARGETS)
        for i, name in enumerate(TARGETS):
            campaign(name, share, bases, tally, args.seed + i)
            print(f"{name}: {tally.tried[name]} inputs, {dict(tally.outcomes.get(name, {}))}", flush=True)
    broken = {t: sum(1 for f in tally.failures if f["target"] == t) for t in TARGETS}
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "seconds": round(time.monotonic() - start, 1),
        "limit_per_input_s": LIMIT_S,
        "seed": args.seed,
        "inputs": sum(tally.tried.values()),
        "contract_broken": len(tally.failures),
        "targets": {
            name: {
                "tried": tally.tried[name],
                "outcomes": dict(tally.outcomes.get(name, {})),
                "contract_broken": broken[name],
            }
            for name in TARGETS
        },
        "failures": tally.failures,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "git": commit,
        "git_dirty": dirty,
        "command": " ".join(["python", "bench/fuzz.py", *sys.argv[1:]]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['inputs']} inputs in {result['seconds']} s, contract broken {result['contract_broken']} times: "
        f"{args.out}"
    )
    return 1 if tally.failures else 0


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def _git_dirty() -> bool | None:
    """Whether the package or the fuzz targets had changes not in the commit (None: no git)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "plamo2_tools", "tests/security", "bench/fuzz.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
    except OSError:
        return None
    return bool(out.strip())


if __name__ == "__main__":
    sys.exit(main())
