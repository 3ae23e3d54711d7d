"""Benchmark `plamo2-tools convert` against a plain copy of the same checkpoint (not a test).

    python bench/convert.py --work DIR --out reports/bench_convert.json

Synthesises a plamo-2-1b float32 checkpoint in DIR/src (reused when already there), then times, on
the same disk: `cp -r` of the checkpoint, `cp -r` + `sync` (convert fsyncs every file, cp does
not), and `plamo2-tools convert` to TP2xPP1 and TP4xPP2, each into a fresh directory.  For convert
it records wall time, throughput and the peak RSS of the convert process (os.wait4 rusage, which
on Linux also counts what the child inherited at fork, i.e. this script's ~230 MiB, so it is an
upper bound; plus anonymous/file RSS sampled from /proc), and compares them with the targets:
wall <= 1.5x cp and peak RSS <= largest tensor + 512 MiB.  It also measures what sha256 costs on this machine, since
the manifest needs three digests of every byte (input file, output file, output tensor).

Before every timed command the source's pages are dropped from the page cache (--cache cold,
posix_fadvise DONTNEED after a sync), so cp and convert read the same way; --cache warm leaves
the cache alone.  Outputs are deleted after each run; --clean also deletes DIR/src at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MIB = 2**20
TARGET_RATIO = 1.5
TARGET_RSS_HEADROOM = 512 * MIB
CLI = [sys.executable, "-m", "plamo2_tools.cli"]


def run_timed(cmd: list[str], sample_rss: bool = False) -> dict[str, Any]:
    """Run cmd; wall time, exit status, rusage of exactly this child, peak RSS split by kind."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    stop = threading.Event()

    def sample() -> None:  # /proc/PID/status every 20 ms: anonymous vs file-backed memory
        while not stop.is_set():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
            except (OSError, ValueError):
                pass
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_rss:
        sampler.start()
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stop.set()
    reader.join()
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-2000:]}")
    return {
        "wall_s": wall,
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "sampled_peak": {k: v for k, v in peaks.items()} if sample_rss else None,
        "stdout": b"".join(out_chunks).decode(errors="replace"),
    }


def drop_cache(paths: list[Path]) -> None:
    """Write back everything, then evict these files' clean pages (nobody else's)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_checkpoint(src: Path, preset: str) -> dict[str, Any]:
    from plamo2_tools.checkpoint import HFCheckpoint
    from plamo2_tools.synth import DTYPES, checkpoint_bytes, preset_config

    cfg = preset_config(preset)
    want = checkpoint_bytes(cfg, DTYPES[cfg.torch_dtype])
    made = None
    try:
        with HFCheckpoint(src) as ckpt:
            ok = not ckpt.inventory_problems() and sum(i.nbytes for i in ckpt.tensors.values()) == want
    except Exception:  # noqa: BLE001 - anything wrong: make it again
        ok = False
    if not ok:
        print(f"synthesising {preset} into {src} ...", flush=True)
        made = run_timed([*CLI, "synth", str(src), "--preset", preset, "--force", "--json"])["wall_s"]
    with HFCheckpoint(src) as ckpt:
        largest = max(ckpt.tensors.values(), key=lambda t: t.nbytes)
        files = [f.path for f in ckpt.files]
        return {
            "path": str(src),
            "preset": preset,
            "dtype": cfg.torch_dtype,
            "parameters": cfg.num_parameters(),
            "bytes": dir_bytes(src),
            "weight_bytes": sum(f.stat().st_size for f in files),
            "largest_tensor": {"name": largest.name, "bytes": largest.nbytes},
            "synth_s": made,
            "reused": made is None,
            "files": [str(f) for f in files],
        }


def sha256_rate() -> float:
    """Single-thread sha256 throughput over 1 GiB in memory (bytes/s)."""
    block = bytearray(64 * MIB)
    h = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(16):
        h.update(block)
    return 16 * len(block) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory on the disk to measure")
    ap.add_argument("--out", type=Path, default=Path("reports/bench_convert.json"))
    ap.add_argument("--preset", default="plamo-2-1b")
    ap.add_argument("--splits", default="2x1,4x2", help="TPxPP list, e.g. 2x1,4x2")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions; medians are reported")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--clean", action="store_true", help="also delete the synthesised checkpoint at the end")
    args = ap.parse_args()

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    ckpt = ensure_checkpoint(src, args.preset)
    splits = [tuple(int(x) for x in s.split("x")) for s in args.splits.split(",")]
    load_before = os.getloadavg()

    def prepare(target: Path) -> None:
        shutil.rmtree(target, ignore_errors=True)
        if args.cache == "cold":
            drop_cache([Path(f) for f in ckpt["files"]])
        else:
            os.sync()

    samples: dict[str, list[dict[str, Any]]] = {"cp": [], "cp_sync": []}
    samples.update({f"tp{t}_pp{p}": [] for t, p in splits})
    for i in range(args.repeat):
        # Interleaved, so a noisy neighbour slows every kind of run alike.
        target = work / "copy"
        prepare(target)
        samples["cp"].append(run_timed(["cp", "-r", str(src), str(target)]))
        prepare(target)
        samples["cp_sync"].append(run_timed(["sh", "-c", f"cp -r '{src}' '{target}' && sync"]))
        shutil.rmtree(target)
        for t, p in splits:
            out = work / f"out_tp{t}_pp{p}"
            prepare(out)
            r = run_timed([*CLI, "convert", str(src), str(out), "--tp", str(t), "--pp", str(p), "--json"], True)
            summary = json.loads(r.pop("stdout"))
            r.update(
                convert_seconds=summary["seconds"],
                bytes_written=summary["bytes_written"],
                output_bytes=dir_bytes(out),
                files=len(list(out.glob("*.safetensors"))),
            )
            samples[f"tp{t}_pp{p}"].append(r)
            shutil.rmtree(out)
            print(f"  run {i + 1}/{args.repeat} tp={t} pp={p}: {r['wall_s']:.1f} s", flush=True)
    for runs in samples.values():
        for r in runs:
            r.pop("stdout", None)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in samples[name])

    cp_s, cp_sync_s = med("cp", "wall_s"), med("cp_sync", "wall_s")
    rate = sha256_rate()
    cores = os.cpu_count() or 1
    rss_limit = ckpt["largest_tensor"]["bytes"] + TARGET_RSS_HEADROOM
    results = []
    for t, p in splits:
        name = f"tp{t}_pp{p}"
        wall = med(name, "wall_s")
        rss = max(r["peak_rss_bytes"] for r in samples[name])
        out_bytes = med(name, "output_bytes")
        hash_cpu = (ckpt["weight_bytes"] + 2 * out_bytes) / rate  # input file, output files, output tensors
        results.append({
            "split": name, "tp": t, "pp": p,
            "wall_s": wall,
            "convert_seconds": med(name, "convert_seconds"),  # inside the process, without Python start-up
            "user_s": med(name, "user_s"), "sys_s": med(name, "sys_s"),
            "output_bytes": out_bytes,
            "ratio_vs_cp": wall / cp_s,
            "ratio_vs_cp_sync": wall / cp_sync_s,
            "ratio_inside_vs_cp_sync": med(name, "convert_seconds") / cp_sync_s,  # minus ~1.5 s of imports
            "read_GBps": ckpt["weight_bytes"] / wall / 1e9,
            "write_GBps": out_bytes / wall / 1e9,
            "peak_rss_bytes": rss,
            "peak_rss_vs_checkpoint": rss / ckpt["weight_bytes"],
            "peak_rss_vs_largest_tensor": rss / ckpt["largest_tensor"]["bytes"],
            "sha256_cpu_s": hash_cpu,
            "sha256_floor_s": hash_cpu / cores,
            "targets": {
                "ratio_vs_cp<=1.5": wall / cp_s <= TARGET_RATIO,
                "ratio_vs_cp_sync<=1.5": wall / cp_sync_s <= TARGET_RATIO,
                "peak_rss<=largest+512MiB": rss <= rss_limit,
            },
        })  # fmt: skip
    report = {
        "kind": "plamo2-bench-convert",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": cores,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "sha256_single_thread_GBps": rate / 1e9,
        },
        "options": {"cache": args.cache, "repeat": args.repeat, "splits": args.splits},
        "checkpoint": {k: v for k, v in ckpt.items() if k != "files"},
        "baseline": {"cp_s": cp_s, "cp_sync_s": cp_sync_s, "cp_GBps": ckpt["bytes"] / cp_s / 1e9},
        "targets": {"ratio": TARGET_RATIO, "peak_rss_bytes": rss_limit},
        "results": results,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.clean:
        shutil.rmtree(src)

    gb = 1e9
    print(f"\n{args.preset}: {ckpt['weight_bytes'] / gb:.2f} GB {ckpt['dtype']}, largest tensor "
          f"{ckpt['largest_tensor']['name']} {ckpt['largest_tensor']['bytes'] / gb:.2f} GB; {cores} CPUs, "
          f"load {load_before[0]:.1f} -> {report['machine']['loadavg_after'][0]:.1f}; cache {args.cache}; "
          f"sha256 {rate / gb:.2f} GB/s per thread")  # fmt: skip
    print(f"cp -r: {cp_s:.1f} s ({ckpt['bytes'] / cp_s / gb:.2f} GB/s)   cp -r + sync: {cp_sync_s:.1f} s")
    for r in results:
        ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
        print(
            f"convert tp={r['tp']} pp={r['pp']}: {r['wall_s']:.1f} s wall ({r['convert_seconds']:.1f} s inside), "
            f"{r['read_GBps']:.2f} GB/s read, {r['write_GBps']:.2f} GB/s written; "
            f"x{r['ratio_vs_cp']:.2f} cp [{ok(r['targets']['ratio_vs_cp<=1.5'])}], "
            f"x{r['ratio_vs_cp_sync']:.2f} cp+sync [{ok(r['targets']['ratio_vs_cp_sync<=1.5'])}]; "
            f"peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB = {r['peak_rss_vs_checkpoint']:.2f}x checkpoint, "
            f"{r['peak_rss_vs_largest_tensor']:.2f}x largest tensor (limit {rss_limit / MIB:.0f} MiB) "
            f"[{ok(r['targets']['peak_rss<=largest+512MiB'])}]; CPU {r['user_s']:.1f} user + {r['sys_s']:.1f} sys, "
            f"of which sha256 >= {r['sha256_cpu_s']:.1f} s"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
