"""What every benchmark of the suite shares: the common options, the one result file (an envelope
around the benchmark's own results), the machine and commit it ran on, its deadline, and the model
it runs on.

A benchmark is a module of bench/ registered in bench/__init__.py:BENCHMARKS.  It defines

    KIND                        its kind, from plamo2_tools/kinds.py (the report reads it)
    MODEL: bool                 whether it runs on a model (then it gets --shards / --preset / --dtype /
                                --layout / --device, and `model_inputs` prepares them)
    add_arguments(ap)           its own options
    run(args, result)           fills `result.results`, calling `result.save()` after every step so a
                                run that is cut short still leaves its numbers

and imports nothing heavy at module level (PyTorch, Triton and the runtime inside `run`), so that
`python -m bench --help` and the session driver stay fast and the convert benchmark can measure a
torch-free process.

The result file (kind from kinds.py, schema_version = kinds.BENCH_SCHEMA_VERSION = 2):

    kind, schema_version, benchmark, label, note,
    machine: {host, cpus, card, cards, memory_bytes, platform, python, packages, loadavg_before, loadavg_after},
    commit, dirty, command, started_at, finished_at, wall_s, complete, skipped, error,
    args: {every option as parsed}, inputs: {how the model was made}, results: {the benchmark's own}

It is written through a temporary file and a rename, so a reader never sees half a file; `complete`
stays false until the benchmark returns having skipped nothing (`skipped` names the steps that did
not fit in --max-seconds; a crash leaves its `error`, an interrupt "interrupted").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from plamo2_tools.kinds import BENCH_SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "triton", "numpy", "lm-eval", "transformers", "fastapi", "uvicorn", "xxhash")
# Set by the session driver on machines whose copy of the tree has no .git (the device machines).
COMMIT_ENV = "PLAMO2_BENCH_COMMIT"


def cli(*args: str | os.PathLike[str]) -> list[str]:
    """`plamo2-tools ARGS` in a fresh interpreter, from this source tree (PYTHONPATH, not the install)."""
    return [sys.executable, "-m", "plamo2_tools.cli", *map(str, args)]


def tree_env(tree: Path = ROOT, **extra: str) -> dict[str, str]:
    """The environment for a child that must import plamo2_tools from `tree`."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


# ---- the machine and the commit -------------------------------------------------------------------
def cards() -> list[str]:
    """GPU names from nvidia-smi (no CUDA context, no torch import); [] on a machine without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def packages() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    gpus = cards()
    return {
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "card": gpus[0] if gpus else "cpu",
        "cards": len(gpus),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": packages(),
        "loadavg_before": list(os.getloadavg()),
    }


def commit(tree: Path = ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty: a tracked file changed) of the tree: $PLAMO2_BENCH_COMMIT (`SHA` or `SHA+dirty`)
    when set, else git's, but only when the tree is the top of its own checkout: a copy of the tree
    inside another repository (a device machine's copy of the lead's checkout) would report that
    repository's commit.  Untracked files do not count: the run's own output may be one."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        sha, _, state = given.partition("+")
        return sha, state == "dirty" if state else None

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != tree.resolve():
            return None, None
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the result file --------------------------------------------------------------------------------
def write_json(path: Path, data: Any) -> None:
    """Through a temporary file and a rename: a reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Result:
    """One benchmark run: the envelope, the benchmark's `results`, its clock and its deadline."""

    def __init__(self, benchmark: str, kind: str, args: argparse.Namespace, argv: list[str]) -> None:
        self.out: Path = args.out
        self.began = time.monotonic()
        self.deadline = self.began + args.max_seconds if args.max_seconds else None
        self.results: dict[str, Any] = {}
        sha, dirty = commit()
        self.envelope: dict[str, Any] = {
            "kind": kind,
            "schema_version": BENCH_SCHEMA_VERSION,
            "benchmark": benchmark,
            "label": args.label,
            "note": args.note,
            "machine": machine(),
            "commit": sha,
            "dirty": dirty,
            "command": shlex.join(["python", "-m", "bench", *argv]),
            "started_at": now(),
            "finished_at": None,
            "wall_s": None,
            "complete": False,
            "skipped": [],
            "error": None,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "inputs": {},
        }

    @property
    def inputs(self) -> dict[str, Any]:
        return self.envelope["inputs"]

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def left(self) -> float:
        """Seconds before --max-seconds (infinity without one): start no step that would not fit."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def skip(self, what: str) -> None:
        """A step not run for want of time: the run is then not complete, and says what it left out."""
        print(f"skipped {what}: out of --max-seconds", flush=True)
        self.envelope["skipped"].append(what)

    def save(self, complete: bool = False, error: str | None = None) -> dict[str, Any]:
        """Rewrite the file; `complete` only at the end of a run that skipped nothing."""
        complete = complete and not self.envelope["skipped"] and error is None
        self.envelope.update(finished_at=now(), wall_s=round(self.elapsed(), 3), complete=complete, error=error)
        self.envelope["machine"]["loadavg_after"] = list(os.getloadavg())
        doc = {**self.envelope, "results": self.results}
        write_json(self.out, doc)
        return doc


# ---- the options every benchmark has ------------------------------------------------------------------
def add_common_arguments(ap: argparse.ArgumentParser, name: str) -> None:
    group = ap.add_argument_group("every benchmark")
    group.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "bench" / f"{name}.json",
        help=f"the result file (default: runs/bench/{name}.json; runs/ is not tracked)",
    )
    group.add_argument("--label", default="", help="a name for this run in the report")
    group.add_argument("--note", default="", help="free text kept in the file (who else shared the machine, ...)")
    group.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no step after this many seconds (bench.session sets it from its deadline)",
    )
    group.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch directory on the disk to use; synthesized models are kept there and reused "
        "(default: a temporary directory, removed at the end)",
    )


def add_model_arguments(ap: argparse.ArgumentParser, device: str = "cuda") -> None:
    group = ap.add_argument_group("the model (benchmarks that run one)")
    group.add_argument("--shards", type=Path, default=None, help="an existing shard directory (else --preset)")
    group.add_argument(
        "--preset", default="plamo-2-1b", help="synthesize this preset, convert it (default: %(default)s)"
    )
    group.add_argument("--dtype", default="bfloat16", help="dtype of the synthesized checkpoint (default: %(default)s)")
    group.add_argument("--layout", default="1x1", help="TPxPP of the converted shards (default: %(default)s)")
    group.add_argument("--device", default=device, help="cuda or cpu (default: %(default)s)")


@contextmanager
def work_dir(args: argparse.Namespace) -> Iterator[Path]:
    """--work, or a temporary directory that goes away with the run: under /tmp where /tmp is on a disk,
    else under runs/bench/ (a memory-backed /tmp would hide the disk from what is measured, and fill RAM)."""
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        yield args.work.resolve()
        return
    base = None if not on_tmpfs(Path(tempfile.gettempdir())) else ROOT / "runs" / "bench"
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="plamo2-bench-", dir=base) as tmp:
        yield Path(tmp)


def on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a memory filesystem (the longest mount point of /proc/mounts above it)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    path = path.resolve()
    best = max((m for m in mounts if path.is_relative_to(m[0])), key=lambda m: len(m[0]), default=None)
    return best is not None and best[1] in ("tmpfs", "ramfs")


def run_cli(*args: str | os.PathLike[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cli(*args), env=tree_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise RuntimeError(f"plamo2-tools {shlex.join(map(str, args))} exited {proc.returncode}:\n{tail}")
    return proc


def parse_layout(text: str) -> tuple[int, int]:
    tp, _, pp = text.lower().partition("x")
    return int(tp), int(pp or 1)


def model_inputs(args: argparse.Namespace, work: Path, result: Result) -> tuple[Path | None, Path]:
    """(HF checkpoint or None, shard directory): --shards as given, else --preset synthesized and
    converted to --layout under WORK/models/, reused when an earlier run there finished both (a
    marker written last says so; anything else there is made again)."""
    if args.shards is not None:
        result.inputs.update(shards=str(args.shards), given=True)
        return None, args.shards
    tp, pp = parse_layout(args.layout)
    home = work / "models" / f"{args.preset}-{args.dtype or 'native'}"
    ckpt, shards, marker = home / "hf", home / f"tp{tp}pp{pp}", home / f"tp{tp}pp{pp}.ready"
    result.inputs.update(
        preset=args.preset, dtype=args.dtype, layout=f"{tp}x{pp}", checkpoint=str(ckpt), shards=str(shards)
    )
    if marker.exists():
        result.inputs["reused"] = True
        return ckpt, shards
    t0 = time.monotonic()
    if not (home / "hf.ready").exists():
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        dtype = ["--dtype", args.dtype] if args.dtype else []
        run_cli("synth", ckpt, "--preset", args.preset, *dtype, "--json")
        (home / "hf.ready").write_text(now() + "\n")
    result.inputs["synth_s"] = round(time.monotonic() - t0, 2)
    t1 = time.monotonic()
    shutil.rmtree(shards, ignore_errors=True)
    run_cli("convert", ckpt, shards, "--tp", str(tp), "--pp", str(pp), "--json")
    marker.write_text(now() + "\n")
    result.inputs.update(convert_s=round(time.monotonic() - t1, 2), reused=False)
    print(f"model: {args.preset} {args.dtype} TP{tp}xPP{pp} made in {time.monotonic() - t0:.1f} s", flush=True)
    return ckpt, shards


def ints(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64] (empty items ignored)."""
    return [int(x) for x in text.split(",") if x.strip()]


def prefill_rate(rows: list[tuple[int, int, bool, float]]) -> float | None:
    """Prompt tokens per second of these prefill forwards (the runtime's PhaseTimer.forward_seconds rows:
    tokens, sequences, whether sequences were decoding beside it, device seconds)."""
    secs = sum(r[3] for r in rows)
    return sum(r[0] for r in rows) / secs if secs else None


def run_timed(
    cmd: list[str],
    env: dict[str, str] | None = None,
    sample: bool = False,
    log: Path | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """Run cmd to its end: wall time, exit status ("rc"), CPU time of it and the children it waited
    for, and with `sample` its peak RSS (VmHWM of /proc/PID/status read every 20 ms: rusage's
    ru_maxrss would include this process's memory, inherited across fork and exec).  Its output goes
    to `log`, else comes back as "stdout" and "stderr".  `cwd` matters for `python -m`, which puts
    the working directory ahead of PYTHONPATH."""
    start = time.perf_counter()
    sink = open(log, "wb") if log is not None else None  # noqa: SIM115 - closed below, after the wait
    pipe = subprocess.PIPE if sink is None else sink
    err = subprocess.PIPE if sink is None else subprocess.STDOUT
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=err, env=env or tree_env(), cwd=cwd)
    peaks = {"VmHWM": 0, "VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    stop = threading.Event()

    def sampler() -> None:  # high-water mark, anonymous vs file-backed
        while not stop.is_set():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
            except (OSError, ValueError):
                pass
            stop.wait(0.02)

    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    threads = [threading.Thread(target=sampler, daemon=True)] if sample else []
    if sink is None:
        for name in chunks:
            stream = getattr(proc, name)
            threads.append(threading.Thread(target=lambda s=stream, n=name: chunks[n].append(s.read()), daemon=True))
    for t in threads:
        t.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        wall = time.perf_counter() - start
        stop.set()
        for t in threads:
            t.join()
        if sink is not None:
            sink.close()
    out = {
        "wall_s": wall,
        "rc": os.waitstatus_to_exitcode(status),
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "peak_rss_bytes": peaks["VmHWM"] if sample else None,
        "sampled_peak": dict(peaks) if sample else None,
    }
    if sink is None:
        out.update({name: b"".join(c).decode(errors="replace") for name, c in chunks.items()})
    return out
