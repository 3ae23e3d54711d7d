"""Start-up of `plamo2-tools` from the shell: every command's `--help` and the typical refusals that
come before any model work, each run as a fresh process, median of `--repeat` (not a test).

    python bench/startup.py --out reports/startup/NAME.json [--repeat 11] [--tree DIR] [--only PATTERN]

Each case is the console script (`plamo2-tools` next to this interpreter, else `python -m
plamo2_tools.cli`) run from a scratch working directory, with `--tree DIR` (default: this
checkout) first on PYTHONPATH, so that a tree exported from another commit (`git archive`) can be
measured on the same machine in the same session.  Per case: the exit code and first stderr line
(so a refusal that changed is visible), the wall time and the CPU time (user + sys) of exactly that
child (`os.wait4`), medians and every sample.  CPU time is the number to compare on a shared,
loaded machine: wall time there includes waiting for a core.  The cases are interleaved (every
case once per round), so that a noisy neighbour slows all of them alike, and the load average is
recorded before and after.

Target (issue 33): `--help` and refusals under 0.3 s wall.  `python -X importtime` on one case
(`--importtime CASE`) writes the import tree of that case next to the JSON, to find the cost.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KIND = "plamo2-bench-startup"
SCHEMA_VERSION = 1
TARGET_SECONDS = 0.3
HERE = Path(__file__).resolve().parent.parent

# (name, argv after `plamo2-tools`, expected exit code).  Placeholders: {empty} an empty directory,
# {missing} a path that does not exist, {shards} a tiny shard directory, {ckpt} its HF checkpoint,
# {data} a directory with GSM8K-shaped files, {out} a fresh output path.
HELP_COMMANDS = (
    "synth",
    "inspect",
    "logits",
    "convert",
    "merge",
    "check",
    "demo",
    "verify",
    "generate",
    "serve",
    "eval",
    "gsm8k-task",
    "report",
    "tokenize",
    "warmup",
    "export",
    "export gguf",
)
REFUSALS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("generate: not a shard directory", ("generate", "{empty}", "--prompt", "hi"), 2),
    ("generate: no such directory", ("generate", "{missing}", "--prompt", "hi"), 2),
    ("generate: no --prompt", ("generate", "{shards}"), 2),
    ("generate: --temperature -1", ("generate", "{shards}", "--prompt", "hi", "--temperature", "-1"), 2),
    ("generate: --backend nope", ("generate", "{shards}", "--prompt", "hi", "--backend", "nope"), 2),
    ("generate: --device cuda, no GPU", ("generate", "{shards}", "--prompt", "hi", "--device", "cuda"), 3),
    ("eval: not a shard directory", ("eval", "{empty}", "--tasks", "gsm8k", "--gsm8k-dir", "{data}"), 2),
    ("eval: no GSM8K data", ("eval", "{shards}", "--tasks", "gsm8k"), 2),
    ("eval: unknown task", ("eval", "{shards}", "--tasks", "mmlu", "--gsm8k-dir", "{data}"), 2),
    ("serve: not a shard directory", ("serve", "{empty}"), 2),
    ("logits: not a checkpoint", ("logits", "{empty}", "--input-ids", "1,2", "--out", "{out}"), 2),
    ("verify: no reference", ("verify", "{shards}", "--reference", "{missing}"), 2),
    ("warmup: not a shard directory", ("warmup", "{empty}"), 2),
    ("check: not a shard directory", ("check", "{empty}"), 2),
    ("inspect: no such path", ("inspect", "{missing}"), 2),
    ("convert: no such source", ("convert", "{missing}", "{out}"), 2),
    ("merge: not a shard directory", ("merge", "{empty}", "{out}"), 2),
    ("tokenize: no such path", ("tokenize", "{missing}"), 2),
)


def cases() -> list[tuple[str, tuple[str, ...], int]]:
    out: list[tuple[str, tuple[str, ...], int]] = [("--help", ("--help",), 0), ("--version", ("--version",), 0)]
    out += [(f"{c} --help", (*c.split(), "--help"), 0) for c in HELP_COMMANDS]
    return out + list(REFUSALS)


def cli_command() -> list[str]:
    script = Path(sys.executable).with_name("plamo2-tools")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "plamo2_tools.cli"]


def scratch(root: Path) -> dict[str, str]:
    """The placeholder paths: an empty directory, a missing one, a tiny checkpoint and its shards,
    GSM8K-shaped files."""
    (root / "empty").mkdir()
    ckpt, shards, data = root / "ckpt", root / "shards", root / "data"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    for argv in (("synth", str(ckpt), "--preset", "tiny"), ("convert", str(ckpt), str(shards))):
        subprocess.run([*cli_command(), *argv], check=True, capture_output=True, env=env, cwd=root)
    data.mkdir()
    row = json.dumps({"question": "How many?", "answer": "2 + 2 = 4\n#### 4"}) + "\n"
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(row * 10)
    return {
        "empty": str(root / "empty"),
        "missing": str(root / "missing"),
        "shards": str(shards),
        "ckpt": str(ckpt),
        "data": str(data),
        "out": str(root / "out-{n}"),
    }


def run_once(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    assert proc.stderr is not None
    err = proc.stderr.read()  # small: a refusal is one line
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.stderr.close()
    lines = err.decode(errors="replace").strip().splitlines()
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "exit": os.waitstatus_to_exitcode(status),
        "stderr_first": lines[0] if lines else "",
        "stderr_lines": len(lines),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--tree", type=Path, default=HERE, help="the plamo2_tools tree to measure (PYTHONPATH)")
    ap.add_argument("--label", default=None, help="what this tree is (default: its path)")
    ap.add_argument("--only", default="*", help="fnmatch pattern of case names")
    ap.add_argument("--importtime", default=None, metavar="CASE", help="also write `-X importtime` of this case")
    args = ap.parse_args()
    chosen = [c for c in cases() if fnmatch.fnmatch(c[0], args.only)]
    tree = args.tree.resolve()
    env = {**os.environ, "PYTHONPATH": str(tree), "NO_COLOR": "1", "COLUMNS": "120"}
    with tempfile.TemporaryDirectory(prefix="plamo2-bench-startup-") as tmp:
        root = Path(tmp)
        places = scratch(root)
        cwd = root / "cwd"  # outside every tree: python must not find plamo2_tools through the cwd
        cwd.mkdir()
        baseline = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        }
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in chosen}
        samples.update({name: [] for name in baseline})
        load_before = os.getloadavg()
        n = 0
        for _ in range(args.repeat):
            for name, argv, _ in chosen:
                n += 1
                filled = [a.format(**places).replace("{n}", str(n)) for a in argv]
                samples[name].append(run_once([*cli_command(), *filled], env, cwd))
            for name, argv in baseline.items():
                samples[name].append(run_once(argv, env, cwd))
        load_after = os.getloadavg()
        importtime = None
        if args.importtime:
            name, argv, _ = next(c for c in chosen if c[0] == args.importtime)
            filled = [a.format(**places).replace("{n}", "importtime") for a in argv]
            r = subprocess.run(
                [sys.executable, "-X", "importtime", "-m", "plamo2_tools.cli", *filled],
                env=env,
                cwd=cwd,
                capture_output=True,
                text=True,
            )
            importtime = args.out.with_suffix(".importtime.txt")
            importtime.parent.mkdir(parents=True, exist_ok=True)
            importtime.write_text(r.stderr)
    records = []
    expected = {name: code for name, _, code in chosen}
    for name, runs in samples.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        exits = sorted({r["exit"] for r in runs})
        records.append(
            {
                "case": name,
                "argv": next((list(a) for c, a, _ in chosen if c == name), baseline.get(name)),
                "expected_exit": expected.get(name),
                "exits": exits,
                "stderr_first": runs[-1]["stderr_first"],
                "stderr_lines": runs[-1]["stderr_lines"],
                "wall_s_median": wall,
                "cpu_s_median": cpu,
                "wall_s": [r["wall_s"] for r in runs],
                "cpu_s": [r["cpu_s"] for r in runs],
                "meets_target_wall": wall <= TARGET_SECONDS if name in expected else None,
                "meets_target_cpu": cpu <= TARGET_SECONDS if name in expected else None,
            }
        )
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "label": args.label or str(tree),
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "tree": str(tree),
        "commit": _commit(tree),
        "cli": cli_command(),
        "repeat": args.repeat,
        "target_seconds": TARGET_SECONDS,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "importtime_file": importtime.name if importtime else None,
        "cases": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(len(r["case"]) for r in records)
    for r in records:
        bad = r["expected_exit"] is not None and r["exits"] != [r["expected_exit"]]
        print(
            f"{r['case']:<{width}}  wall {r['wall_s_median']:6.3f}  cpu {r['cpu_s_median']:6.3f}  exit {r['exits']}"
            + ("  UNEXPECTED EXIT" if bad else "")
        )


def _commit(tree: Path) -> str | None:
    if os.environ.get("PLAMO2_BENCH_COMMIT"):
        return os.environ["PLAMO2_BENCH_COMMIT"]
    git = shutil.which("git")
    if git is None:
        return None
    r = subprocess.run([git, "-C", str(tree), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True)
    lines = r.stdout.split()
    return lines[1] if r.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == tree else None


if __name__ == "__main__":
    main()
