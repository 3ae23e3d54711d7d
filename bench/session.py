"""One GPU session: several benchmarks of the suite in a row, within a deadline, results tarred under $OUT.

    python -m bench.session [--deadline 540] [--out DIR] [--preset plamo-2-1b --dtype bfloat16]
        [--pytest "-m gpu tests/kernels"] BENCHMARK [BENCHMARK ...]

Each BENCHMARK is a name of the suite, alone or with its options as one shell word, e.g.

    python -m bench.session --deadline 540 throughput "serving --clients 1,64,256" "e2e --steps generate,eval" kernels

Nothing in this file changes from one session to the next: what a session runs is its command line.
For every benchmark in order, the driver gives it what is left of the deadline (`--max-seconds`,
less a margin; the benchmark starts no step that would not fit and rewrites its file after each
one) and stops it if it runs past (SIGTERM, then SIGKILL); a benchmark that would start with less
than --min-seconds left is skipped.  Model benchmarks get `--preset`/`--dtype` (their own options
after the name win) and one `--work` directory, so the model is synthesized and converted once and
reused by the next.  After every benchmark, and at the end with `plamo2-tools report` of all
results, the session's files are tarred into OUT/session.tar.gz (OUT: --out, else $OUT, else
runs/session), beside a copy of session.json and report.md (a device machine sends back only a few
files from $OUT):

    results/NAME.json     each benchmark's result (NAME-2.json for a second run of one name)
    logs/NAME.log         its output; logs/session.json: what ran, exit codes, walls, skips
    report.md (+ PNGs)    the rendered report

(kept in WORK/session/ until the next session there starts).

Set up here for the device machines: wheels carried in .whl/ (e.g. lm-eval and the server's
packages, which the device image lacks) are installed into WORK/site ahead of the image's packages;
NVLink multicast is left off (NCCL_NVLS_ENABLE=0 and its kin); the Triton and PLaMo caches live in
WORK; the commit is passed to the benchmarks in $PLAMO2_BENCH_COMMIT, since the device's copy of the
tree has no .git (set it on the command line there: PLAMO2_BENCH_COMMIT=<sha>[+dirty]).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bench import BENCHMARKS, load
from bench.common import COMMIT_ENV, ROOT, cards, cli, commit, now, tree_env, write_json

# Left off on the lent machines (their notes say why); harmless elsewhere.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TAR_RESERVE_S = 15.0  # kept back from the deadline for the report and the last tar


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.session", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("benchmarks", nargs="+", metavar="BENCHMARK", help=f"of {', '.join(BENCHMARKS)}, with options")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole session (default: 540)")
    ap.add_argument("--out", type=Path, default=None, help="where results go (default: $OUT, else runs/session)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/plamo2-session"), help="scratch: models, caches, site")
    ap.add_argument("--preset", default="plamo-2-1b", help="the model benchmarks' preset (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="and its dtype (default: %(default)s)")
    ap.add_argument("--pytest", default=None, metavar="ARGS", help="run pytest with these arguments first")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="install these wheels into WORK/site first")
    ap.add_argument("--min-seconds", type=float, default=30.0, help="skip a benchmark with less than this left")
    return ap


class Session:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.began = time.monotonic()
        self.deadline = self.began + args.deadline - TAR_RESERVE_S
        self.out: Path = (args.out or Path(os.environ.get("OUT") or ROOT / "runs" / "session")).resolve()
        self.work: Path = args.work.resolve()
        self.tree = self.work / "session"  # what the tar holds
        shutil.rmtree(self.tree, ignore_errors=True)
        for d in (self.tree / "results", self.tree / "logs", self.out):
            d.mkdir(parents=True, exist_ok=True)
        sha, dirty = commit()
        self.env = tree_env(
            **NO_MULTICAST,
            TRITON_CACHE_DIR=str(self.work / "caches" / "triton"),
            PLAMO2_CACHE_DIR=str(self.work / "caches" / "plamo2"),
        )
        if sha:
            self.env[COMMIT_ENV] = sha + ("+dirty" if dirty else "")
        self.log: dict[str, Any] = {
            "started_at": now(),
            "argv": sys.argv[1:],
            "cards": cards(),
            "commit": sha,
            "dirty": dirty,
            "deadline_s": args.deadline,
            "steps": [],
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, cmd: list[str], log: Path, limit: float, **extra: Any) -> dict[str, Any]:
        """Run cmd (its own process group) for at most `limit` seconds; its output into `log`."""
        t0 = time.monotonic()
        with open(log, "ab") as f:
            f.write(f"$ {shlex.join(cmd)}\n".encode())
            f.flush()
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                rc = stop(proc)
            except KeyboardInterrupt:
                stop(proc)
                raise
        record = {"name": name, "rc": rc, "wall_s": round(time.monotonic() - t0, 2), "log": str(log), **extra}
        self.log["steps"].append(record)
        tail = log.read_text(errors="replace").splitlines()[-6:]
        print(
            f"== {name}: exit {rc} in {record['wall_s']:.1f} s" + "".join(f"\n   {line}" for line in tail), flush=True
        )
        self.save()
        return record

    def skip(self, name: str, why: str) -> None:
        self.log["steps"].append({"name": name, "skipped": why})
        print(f"== {name}: skipped ({why})", flush=True)
        self.save()

    def save(self) -> None:
        self.log["wall_s"] = round(time.monotonic() - self.began, 2)
        write_json(self.tree / "logs" / "session.json", self.log)
        shutil.copyfile(self.tree / "logs" / "session.json", self.out / "session.json")
        if (self.tree / "report.md").exists():
            shutil.copyfile(self.tree / "report.md", self.out / "report.md")
        with tarfile.open(self.out / ".session.tar.gz.partial", "w:gz") as tar:
            for path in sorted(self.tree.iterdir()):
                tar.add(path, arcname=path.name)
        os.replace(self.out / ".session.tar.gz.partial", self.out / "session.tar.gz")


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the whole group (torchrun ranks, server subprocesses), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    return 124  # as timeout(1) says it


def install_wheels(s: Session, wheels: Path) -> None:
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return
    site = s.work / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--target",
        str(site),
        *map(str, found),
    ]
    if s.step("wheels", cmd, s.tree / "logs" / "wheels.log", min(120.0, s.left()), wheels=len(found))["rc"] == 0:
        s.env["PYTHONPATH"] = os.pathsep.join([str(site), s.env["PYTHONPATH"]])


def command(s: Session, spec: str, out: Path) -> tuple[str, list[str]]:
    """(name, command line) of one BENCHMARK argument."""
    name, *extra = shlex.split(spec)
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})")
    model = ["--preset", s.args.preset, "--dtype", s.args.dtype] if load(name).MODEL else []
    budget = max(1.0, s.left() - 10.0)  # the benchmark's own margin to write its file before the stop
    cmd = [
        sys.executable,
        "-m",
        "bench",
        name,
        "--out",
        str(out),
        "--work",
        str(s.work),
        "--max-seconds",
        f"{budget:.0f}",
        *model,
        *extra,
    ]
    return name, cmd


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    s = Session(args)
    print(
        f"session: {len(args.benchmarks)} benchmark(s) in {args.deadline:.0f} s on "
        f"{', '.join(s.log['cards']) or 'no GPU'}; results in {s.out}",
        flush=True,
    )
    for spec in args.benchmarks:  # refuse a typo before anything runs
        command(s, spec, s.out)
    install_wheels(s, args.wheels)
    if args.pytest:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(args.pytest)]
        s.step("pytest", cmd, s.tree / "logs" / "pytest.log", min(s.left() / 2, s.left() - args.min_seconds))
    taken: dict[str, int] = {}
    for spec in args.benchmarks:
        name = shlex.split(spec)[0]
        taken[name] = taken.get(name, 0) + 1
        stem = name if taken[name] == 1 else f"{name}-{taken[name]}"
        if s.left() < args.min_seconds:
            s.skip(stem, f"{s.left():.0f} s left")
            continue
        _, cmd = command(s, spec, s.tree / "results" / f"{stem}.json")
        s.step(stem, cmd, s.tree / "logs" / f"{stem}.log", s.left(), spec=spec)
    if any((s.tree / "results").glob("*.json")):
        cmd = cli("report", s.tree / "results", "--out", s.tree / "report.md", "--title", "GPU session")
        s.step("report", cmd, s.tree / "logs" / "report.log", max(5.0, s.left() + TAR_RESERVE_S - 5))
    s.log["finished_at"] = now()
    s.save()
    print(f"session: {s.out / 'session.tar.gz'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
