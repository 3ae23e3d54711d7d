"""`plamo2-tools convert` against `cp -r` of the same checkpoint: wall time, CPU, peak memory, start-up.

    python -m bench convert [--work DIR] [--preset plamo-2-1b --files 1 --synth random|fast]
        [--splits 2x1,4x2] [--variant NAME=ARGS ...] [--repeat 3] [--cache cold|drop|warm] [--blob-check]

Synthesises a checkpoint in DIR/src (reused when already there; `--synth fast` writes constant
values, which copy and hash exactly as fast as random ones, in a fraction of the time), then times,
on the same disk and interleaved so that a noisy neighbour slows every kind of run alike:
`cp -r` of the checkpoint, `cp -r && sync` (convert fsyncs every file, cp does not), and
`plamo2-tools convert` to each TP x PP split, each into a fresh directory; `--variant` adds
convert runs with other options (e.g. `user=--copy user`; `VAR=value` words set its environment)
for the first split.  Medians of
`--repeat` runs are compared with the targets (issue 13): wall <= 1.3x `cp -r` below 16 cores,
1.1x from 16 cores on, and peak RSS <= largest tensor + 512 MiB.

Peak RSS is the convert process's own high-water mark (VmHWM, sampled from /proc every 20 ms;
rusage's ru_maxrss would include this script's memory, inherited across fork and exec).  The CPU
time of the convert process and what its copy paths carried are recorded per run.

Before every timed command the source's pages leave the page cache (`--cache cold`: sync, then
posix_fadvise DONTNEED on every source file; `--cache drop`: also `echo 3 > /proc/sys/vm/
drop_caches` where allowed), so cp and convert read from the disk alike; `--cache warm` leaves the
cache alone.  `--blob-check` also lays the source out as a Hugging Face cache snapshot (links to
blobs named by their sha256) and times the first split with and without `--verify-blobs`.
`--max-seconds` stops starting runs after that many seconds; the file is rewritten after every
repetition, so a cut-short run still leaves its numbers.  The scratch directory must be on the disk
being measured (`--work`; the default temporary directory avoids a memory-backed /tmp).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Result, cli, tree_env, work_dir
from bench.common import run_timed as common_run_timed
from plamo2_tools.kinds import BENCH_CONVERT_KIND

KIND = BENCH_CONVERT_KIND
MODEL = False  # it makes its own HF checkpoint: convert's input, not the runtime's
MIB = 2**20
TARGET_RATIO_FEW_CORES, TARGET_RATIO_MANY_CORES, MANY_CORES = 1.3, 1.1, 16
TARGET_RSS_HEADROOM = 512 * MIB
CLI = cli()


def run_timed(cmd: list[str], sample: bool = False) -> dict[str, Any]:
    """common.run_timed, with the child's stdout kept (convert --json) and a failure fatal."""
    r = common_run_timed(cmd, sample=sample)
    if r.pop("rc") != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r['stderr'][-2000:]}")
    return r


def evict(paths: list[Path], cache: str) -> str:
    """Write back everything, then take these files' pages out of the page cache."""
    os.sync()
    if cache == "warm":
        return "none"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if cache == "drop":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_checkpoint(src: Path, preset: str, files: int, synth: str) -> dict[str, Any]:
    import torch

    from plamo2_tools.model import num_parameters
    from plamo2_tools.model.checkpoint import HFCheckpoint
    from plamo2_tools.model.synth import DTYPES, checkpoint_bytes, preset_config, write_checkpoint

    cfg = preset_config(preset)
    want = checkpoint_bytes(cfg, DTYPES[cfg.torch_dtype])
    made = None
    try:
        with HFCheckpoint(src) as ckpt:
            ok = not ckpt.inventory_problems() and sum(i.nbytes for i in ckpt.tensors.values()) == want
    except Exception:  # noqa: BLE001 - anything wrong: make it again
        ok = False
    if not ok:
        print(f"synthesising {preset} ({synth}) into {src} ...", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        start = time.perf_counter()
        if synth == "fast":  # constant values: the same bytes to copy and hash, no random numbers to make

            def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
                return torch.full(shape, 1.0 + len(name) % 7 / 8)

            write_checkpoint(src, cfg, values, DTYPES[cfg.torch_dtype], files=files, tokenizer=False)
        else:
            cmd = [*CLI, "synth", str(src), "--preset", preset, "--files", str(files), "--force", "--json"]
            run_timed(cmd)
        made = time.perf_counter() - start
    with HFCheckpoint(src) as ckpt:
        largest = max(ckpt.tensors.values(), key=lambda t: t.nbytes)
        paths = [f.path for f in ckpt.files]
        return {
            "path": str(src),
            "preset": preset,
            "dtype": cfg.torch_dtype,
            "parameters": num_parameters(cfg),
            "bytes": dir_bytes(src),
            "weight_bytes": sum(f.stat().st_size for f in paths),
            "weight_files": len(paths),
            "largest_tensor": {"name": largest.name, "bytes": largest.nbytes},
            "synth": synth,
            "synth_s": made,
            "reused": made is None,
            "files": [str(f) for f in paths],
        }


def startup_times(repeat: int = 5) -> dict[str, Any]:
    """Median wall time of `plamo2-tools --help` and of a bare interpreter, and whether the CLI's
    import (and `--help`) loads torch (issue 22: byte-moving commands never import it)."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['plamo2-tools', '--help']\n"
        "try:\n    runpy.run_module('plamo2_tools.cli', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    times: dict[str, list[float]] = {"python": [], "help": []}
    for _ in range(repeat):
        for name, cmd in (("python", [sys.executable, "-c", "pass"]), ("help", [*CLI, "--help"])):
            start = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=tree_env())
            times[name].append(time.perf_counter() - start)
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=tree_env()
    ).stderr.strip()
    return {
        "python_s": statistics.median(times["python"]),
        "help_s": statistics.median(times["help"]),
        "help_imports_torch": loaded.endswith("True"),
    }


def hash_rates() -> dict[str, float]:
    """Single-thread throughput over 1 GiB in memory (GB/s) of the digests convert may compute."""
    import xxhash

    block = bytearray(64 * MIB)
    rates = {}
    for name, make in (("sha256", hashlib.sha256), ("xxh3_128", xxhash.xxh3_128)):
        h = make()
        start = time.perf_counter()
        for _ in range(16):
            h.update(block)
        rates[f"{name}_single_thread_GBps"] = 16 * len(block) / (time.perf_counter() - start) / 1e9
    return rates


def hf_cache_layout(ckpt: dict[str, Any], work: Path) -> Path:
    """DIR/hub/snapshots/x: the source as a Hugging Face cache holds it (weights are links to
    blobs/<sha256>; the blobs are hard links to the source files, so nothing is copied)."""
    root = work / "hub"
    snapshot, blobs = root / "snapshots" / "x", root / "blobs"
    if snapshot.exists():
        return snapshot
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    src = Path(ckpt["path"])
    for p in sorted(src.iterdir()):
        if str(p) in ckpt["files"]:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(64 * MIB):
                    h.update(block)
            blob = blobs / h.hexdigest()
            os.link(p, blob)
            (snapshot / p.name).symlink_to(blob)
        else:
            shutil.copy(p, snapshot / p.name)
    return snapshot


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="plamo-2-1b")
    ap.add_argument("--files", type=int, default=1, help="weight files of the synthesised checkpoint")
    ap.add_argument("--synth", choices=("random", "fast"), default="random", help="values: random, or constant")
    ap.add_argument("--splits", default="2x1,4x2", help="TPxPP list, e.g. 2x1,4x2")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra convert runs of the first split with these options ('user=--copy user')",
    )
    ap.add_argument("--repeat", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--cache", choices=("cold", "drop", "warm"), default="cold")
    ap.add_argument("--blob-check", action="store_true", help="also time --verify-blobs on an HF cache layout")
    ap.add_argument("--target-ratio", type=float, default=None, help="default: 1.3 below 16 cores, else 1.1")
    ap.add_argument("--clean", action="store_true", help="also delete the synthesised checkpoint at the end")


def run(args: argparse.Namespace, result: Result) -> None:
    with work_dir(args) as work:
        measure(args, work, result)


def measure(args: argparse.Namespace, work: Path, result: Result) -> None:
    src = work / "src"
    ckpt = ensure_checkpoint(src, args.preset, args.files, args.synth)
    sources = [Path(f) for f in ckpt["files"]]
    splits = [tuple(int(x) for x in s.split("x")) for s in args.splits.split(",")]
    variants = {v.split("=", 1)[0]: shlex.split(v.split("=", 1)[1]) for v in args.variant}
    cores = len(os.sched_getaffinity(0))
    target_ratio = args.target_ratio or (TARGET_RATIO_MANY_CORES if cores >= MANY_CORES else TARGET_RATIO_FEW_CORES)
    rss_limit = ckpt["largest_tensor"]["bytes"] + TARGET_RSS_HEADROOM
    rates = hash_rates()
    evicted: set[str] = set()

    def out_of_time() -> bool:
        return result.left() <= 0

    def timed(name: str, cmd: list[str], target: Path) -> dict[str, Any]:
        shutil.rmtree(target, ignore_errors=True)
        evicted.add(evict(sources, args.cache))
        return run_timed(cmd, sample=name not in ("cp", "cp_sync"))

    def convert(name: str, source: Path, t: int, p: int, extra: list[str]) -> dict[str, Any]:
        out = work / f"out_{name}"
        env = [x for x in extra if re.fullmatch(r"[A-Z0-9_]+=.*", x)]  # a variant's environment, e.g. X=1
        options = [x for x in extra if x not in env]
        cmd = [*CLI, "convert", str(source), str(out), "--tp", str(t), "--pp", str(p), *options, "--json"]
        cmd = ["env", *env, *cmd] if env else cmd
        r = timed(name, cmd, out)
        summary = json.loads(r.pop("stdout"))
        r.update(
            convert_seconds=summary["seconds"],
            bytes_written=summary["bytes_written"],
            output_bytes=dir_bytes(out),
            files=len(list(out.glob("*.safetensors"))),
            copy=summary.get("copy"),
        )
        shutil.rmtree(out)
        return r

    runs = {"cp": [], "cp_sync": [], **{f"tp{t}_pp{p}": [] for t, p in splits}, **{v: [] for v in variants}}
    samples: dict[str, list[dict[str, Any]]] = runs
    first = splits[0]
    blob: dict[str, Any] = {}
    for i in range(args.repeat):
        if out_of_time():
            result.skip(f"repetitions {i + 1}-{args.repeat}")
            break
        target = work / "copy"
        r = timed("cp", ["cp", "-r", str(src), str(target)], target)
        samples["cp"].append(r)
        r = timed("cp_sync", ["sh", "-c", f"cp -r '{src}' '{target}' && sync"], target)
        samples["cp_sync"].append(r)
        shutil.rmtree(target)
        for t, p in splits:
            samples[f"tp{t}_pp{p}"].append(convert(f"tp{t}_pp{p}", src, t, p, []))
        for name, extra in variants.items():
            samples[name].append(convert(name, src, *first, extra))
        line = ", ".join(f"{k} {v[-1]['wall_s']:.2f}" for k, v in samples.items() if len(v) > i)
        print(f"  run {i + 1}/{args.repeat}: {line} s", flush=True)
        write_report(args, result, ckpt, splits, variants, samples, blob, target_ratio, rss_limit, rates, evicted)
    if args.blob_check and out_of_time():
        result.skip("blob check")
    elif args.blob_check:
        start = time.perf_counter()
        snapshot = hf_cache_layout(ckpt, work)
        blob = {"layout_s": time.perf_counter() - start, "verify": [], "no_verify": []}
        for _ in range(args.repeat):
            if out_of_time():
                break
            blob["verify"].append(convert("verify", snapshot, *first, ["--verify-blobs"]))
            blob["no_verify"].append(convert("no_verify", snapshot, *first, ["--no-verify-blobs"]))
        print(
            f"  blob check: {[round(r['wall_s'], 2) for r in blob['verify']]} s with sha256, "
            f"{[round(r['wall_s'], 2) for r in blob['no_verify']]} s without",
            flush=True,
        )
    report = write_report(args, result, ckpt, splits, variants, samples, blob, target_ratio, rss_limit, rates, evicted)
    if args.clean:
        shutil.rmtree(src)
        shutil.rmtree(work / "hub", ignore_errors=True)
    print_summary(report)


def write_report(
    args: argparse.Namespace,
    result: Result,
    ckpt: dict[str, Any],
    splits: list[tuple[int, ...]],
    variants: dict[str, list[str]],
    samples: dict[str, list[dict[str, Any]]],
    blob: dict[str, Any],
    target_ratio: float,
    rss_limit: int,
    rates: dict[str, float],
    evicted: set[str],
) -> dict[str, Any]:
    def med(runs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    cp_s, cp_sync_s = med(samples["cp"], "wall_s"), med(samples["cp_sync"], "wall_s")

    def split_result(name: str, runs: list[dict[str, Any]], t: int, p: int, extra: list[str]) -> dict[str, Any]:
        wall = med(runs, "wall_s")
        rss = max(r["peak_rss_bytes"] for r in runs)
        ratio, ratio_sync = wall / cp_s, wall / cp_sync_s  # type: ignore[operator]
        return {
            "split": name,
            "tp": t,
            "pp": p,
            "options": " ".join(extra),
            "wall_s": wall,
            "convert_seconds": med(runs, "convert_seconds"),  # inside the process, without Python start-up
            "user_s": med(runs, "user_s"),
            "sys_s": med(runs, "sys_s"),
            "output_bytes": med(runs, "output_bytes"),
            "ratio_vs_cp": ratio,
            "ratio_vs_cp_sync": ratio_sync,
            "ratio_inside_vs_cp": med(runs, "convert_seconds") / cp_s,  # type: ignore[operator]
            "read_GBps": ckpt["weight_bytes"] / wall / 1e9,  # type: ignore[operator]
            "peak_rss_bytes": rss,
            "peak_rss_vs_largest_tensor": rss / ckpt["largest_tensor"]["bytes"],
            "copy": runs[-1].get("copy"),
            "targets": {
                f"ratio_vs_cp<={target_ratio}": ratio <= target_ratio,
                "peak_rss<=largest+512MiB": rss <= rss_limit,
            },
        }

    results = [
        split_result(f"tp{t}_pp{p}", samples[f"tp{t}_pp{p}"], t, p, []) for t, p in splits if samples[f"tp{t}_pp{p}"]
    ]
    results += [split_result(n, samples[n], *splits[0], variants[n]) for n in variants if samples[n]]
    blob_summary = None
    if blob.get("verify"):
        blob_summary = {
            "split": f"tp{splits[0][0]}_pp{splits[0][1]}",
            "layout_s": blob["layout_s"],
            "verify_blobs_s": med(blob["verify"], "wall_s"),
            "no_verify_blobs_s": med(blob["no_verify"], "wall_s"),
            "samples": blob,
        }
    report = {
        "hash_rates": rates,
        "startup": startup_times(),
        "options": {
            "cache": args.cache,
            "evicted_by": sorted(evicted),
            "repeat": args.repeat,
            "splits": args.splits,
            "variants": {k: " ".join(v) for k, v in variants.items()},
        },
        "checkpoint": {k: v for k, v in ckpt.items() if k != "files"},
        "baseline": {"cp_s": cp_s, "cp_sync_s": cp_sync_s, "cp_GBps": ckpt["bytes"] / cp_s / 1e9 if cp_s else None},
        "targets": {"ratio": target_ratio, "peak_rss_bytes": rss_limit},
        "results": results,
        "blob_check": blob_summary,
        "samples": samples,
    }
    result.results.update(report)
    result.save()
    return {**report, "machine": {**result.envelope["machine"], **rates}}


def print_summary(report: dict[str, Any]) -> None:
    ckpt, machine, base = report["checkpoint"], report["machine"], report["baseline"]
    gb = 1e9
    load = f"{machine['loadavg_before'][0]:.1f} -> {machine['loadavg_after'][0]:.1f}"
    print(
        f"\n{ckpt['preset']}: {ckpt['weight_bytes'] / gb:.2f} GB {ckpt['dtype']} in {ckpt['weight_files']} file(s), "
        f"largest tensor {ckpt['largest_tensor']['bytes'] / gb:.2f} GB; {machine['cpus']} CPUs, load {load}; cache "
        f"{report['options']['cache']} ({', '.join(report['options']['evicted_by'])}); sha256 "
        f"{machine['sha256_single_thread_GBps']:.2f}, xxh3 {machine['xxh3_128_single_thread_GBps']:.2f} "
        "GB/s per thread"
    )
    print(f"cp -r: {base['cp_s']:.2f} s   cp -r + sync: {base['cp_sync_s']:.2f} s")
    for r in report["results"]:
        ok = "ok" if all(r["targets"].values()) else "MISSED " + ",".join(k for k, v in r["targets"].items() if not v)
        cpu = f"{r['user_s']:.1f}+{r['sys_s']:.1f} s"
        print(
            f"{r['split']:>10} {r['options']:>16}: {r['wall_s']:.2f} s ({r['convert_seconds']:.2f} inside) "
            f"x{r['ratio_vs_cp']:.2f} cp, x{r['ratio_vs_cp_sync']:.2f} cp+sync; CPU {cpu}; "
            f"peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB [{ok}]"
        )
    if report["blob_check"]:
        b = report["blob_check"]
        print(
            f"HF cache layout {b['split']}: {b['verify_blobs_s']:.2f} s with --verify-blobs, "
            f"{b['no_verify_blobs_s']:.2f} s without"
        )
