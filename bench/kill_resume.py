"""Kill `plamo2-tools convert` at random points, resume, and compare with a clean run (issue 14).

    python bench/kill_resume.py --work DIR --out reports/convert/kill_resume.json \\
        [--preset plamo-2-1b --dtype bfloat16 --tp 2 --pp 2 --kills 20 --seed 0]

Synthesises the checkpoint in DIR/src (reused when there), converts it once cleanly (the
reference bytes, and the time the work takes once the output lock is taken), then per trial:
starts the real CLI into a fresh DIR/run, SIGKILLs it at a uniformly random moment of that work
window, and runs the same command again until it finishes; every other trial also kills the
first resume at a random moment (a resume of a resume).  Each trial records where the kill left
the directory (journaled files, *.partial files, a manifest or not), what the resume reported
(status, files reused) and whether the result is byte-identical to the clean run: the same
file names (no journal, lock or *.partial left) and the same bytes in every file.  Not a test:
tests/convert/test_kill_resume.py runs it on a tiny preset.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "plamo2_tools.cli"]
LOCK_NAME = ".plamo2.lock"
JOURNAL_NAME = ".plamo2_convert.journal.jsonl"
MANIFEST_NAME = "plamo2_shards.json"
KIND = "plamo2-bench-kill-resume"
SCHEMA_VERSION = 1


def convert_cmd(args: argparse.Namespace, src: Path, out: Path) -> list[str]:
    return [
        *CLI,
        "convert",
        str(src),
        str(out),
        "--tp",
        str(args.tp),
        "--pp",
        str(args.pp),
        "--max-part-size",
        args.max_part_size,
        "--json",
    ]


def lock_holder(out: Path) -> int | None:
    try:
        return int(json.loads((out / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def wait_for_lock(proc: subprocess.Popen, out: Path, timeout: float = 600) -> float | None:
    """The moment this process took OUT's lock (its work starts), or None if it ended first."""
    deadline = time.monotonic() + timeout
    while lock_holder(out) != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.0005)
    return time.monotonic()


def run_and_kill(cmd: list[str], out: Path, fraction: float, window: float) -> dict[str, Any]:
    """Start cmd, SIGKILL it `fraction` of `window` seconds after it took the lock."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        locked = wait_for_lock(proc, out)
        if locked is not None:
            delay = locked + fraction * window - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        _, stderr = proc.communicate()
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"convert failed before the kill (rc {proc.returncode}): {stderr.decode()[-2000:]}")
    return {"fraction": round(fraction, 4), "killed": killed, "left": state_of(out)}


def state_of(out: Path) -> dict[str, Any]:
    """What a kill left: finished (journaled) files, unfinished ones, whether it looks complete."""
    try:
        journaled = len((out / JOURNAL_NAME).read_text().splitlines()) - 1
    except OSError:
        journaled = 0
    names = os.listdir(out) if out.is_dir() else []
    return {
        "journaled_files": max(0, journaled),
        "partial_files": sum(n.endswith(".partial") for n in names),
        "manifest": MANIFEST_NAME in names,
        "lock_file": LOCK_NAME in names,
    }


def finish(cmd: list[str]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"resume failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), seconds


def identical(out: Path, clean: Path) -> tuple[bool, list[str]]:
    """Same file names and the same bytes in every file."""
    names, want = sorted(os.listdir(out)), sorted(os.listdir(clean))
    if names != want:
        extra, missing = sorted(set(names) - set(want)), sorted(set(want) - set(names))
        return False, [f"files differ: extra {extra}, missing {missing}"]
    differ = [n for n in names if not filecmp.cmp(out / n, clean / n, shallow=False)]
    return not differ, [f"bytes differ: {n}" for n in differ]


def trial(
    args: argparse.Namespace, rng: random.Random, index: int, src: Path, clean: Path, run: Path, window: float
) -> dict[str, Any]:
    shutil.rmtree(run, ignore_errors=True)
    cmd = convert_cmd(args, src, run)
    kills = [run_and_kill(cmd, run, rng.uniform(0.0, 1.0), window)]
    if index % 2 == 1 and kills[0]["killed"]:  # a resume killed as well
        kills.append(run_and_kill(cmd, run, rng.uniform(0.0, 1.0), window))
    result, seconds = finish(cmd)
    same, why = identical(run, clean)
    return {
        "trial": index,
        "kills": kills,
        "resume_status": result["status"],
        "files_reused": len(result["files_reused"]),
        "resume_seconds": round(seconds, 3),
        "identical": same,
        "differences": why,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="Scratch directory (source, clean run, trial run).")
    p.add_argument("--out", type=Path, required=True, help="Result JSON.")
    p.add_argument("--preset", default="plamo-2-1b")
    p.add_argument("--dtype", default=None, help="Synthesised source dtype (default: the preset's).")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--max-part-size", default="512MB", help="Smaller parts: more files, more kill points.")
    p.add_argument("--kills", type=int, default=20, help="Trials (each kills at least once).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    src, clean, run = args.work / "src", args.work / "clean", args.work / "run"
    if not (src / "config.json").exists():
        synth = [*CLI, "synth", str(src), "--preset", args.preset, "--force", "--json"]
        subprocess.run(synth + (["--dtype", args.dtype] if args.dtype else []), check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(clean, ignore_errors=True)
    proc = subprocess.Popen(convert_cmd(args, src, clean), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    locked = wait_for_lock(proc, clean)
    while locked is not None and lock_holder(clean) == proc.pid:  # released once the manifest is written
        time.sleep(0.0005)
    window = time.monotonic() - (locked or 0.0)  # the work a kill can interrupt: from lock to release
    stdout, stderr = proc.communicate()
    if proc.returncode != 0 or locked is None:
        raise SystemExit(f"the clean conversion failed: {stderr.decode()[-2000:]}")
    subprocess.run([*CLI, "check", str(clean), "--json"], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(stdout)

    rng = random.Random(args.seed)
    trials = []
    started = time.perf_counter()
    for i in range(args.kills):
        trials.append(trial(args, rng, i, src, clean, run, window))
        t = trials[-1]
        print(
            f"trial {i}: killed at {[k['fraction'] for k in t['kills']]} of the work -> {t['resume_status']}, "
            f"{t['files_reused']} reused, identical={t['identical']}",
            file=sys.stderr,
        )
    shutil.rmtree(run, ignore_errors=True)
    files = sorted(os.listdir(clean))
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": " ".join(convert_cmd(args, Path("SRC"), Path("OUT"))[2:]),
        "preset": args.preset,
        "dtype": args.dtype or "preset default",
        "tp": args.tp,
        "pp": args.pp,
        "max_part_size": args.max_part_size,
        "bytes": sum((clean / n).stat().st_size for n in files),
        "shard_files": sum(n.endswith(".safetensors") for n in files),
        "clean_seconds": round(summary["seconds"], 3),
        "work_window_seconds": round(window, 3),
        "seed": args.seed,
        "trials": trials,
        "interrupted_mid_way": sum(any(k["killed"] and not k["left"]["manifest"] for k in t["kills"]) for t in trials),
        "all_identical": all(t["identical"] for t in trials),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['interrupted_mid_way']}/{len(trials)} trials interrupted mid-way; all identical: "
        f"{result['all_identical']}; wrote {args.out}",
        file=sys.stderr,
    )
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
