"""Benchmark `plamo2-tools export fp8` against `cp -r` of the same checkpoint (not a test).

    python bench/export_fp8.py --work DIR --out reports/export/fp8_plamo-3-8b.json [--preset plamo-3-8b]

Synthesises the checkpoint in DIR/src (bench/convert.py's `ensure_checkpoint`, reused when already there), then
times, interleaved per repetition so that a noisy neighbour slows every kind of run alike and each reading the
source from disk (bench/convert.py's `evict`): `cp -r` of the checkpoint, `cp -r && sync` (the export fsyncs
every file, cp does not) and `export fp8 --no-verify` (verification runs two reference forwards, a different
cost: tests measure it on tiny models).  Each output is deleted before the next run, so the disk needs the
source plus the larger of one copy and one export (checked before starting).  Peak RSS is each process's own
high-water mark (VmHWM sampled from /proc every 20 ms, bench/convert.py's `run_timed`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import CLI, dir_bytes, ensure_checkpoint, evict, run_timed  # noqa: E402  (bench/convert.py)

# The result file's kind and version, read by `plamo2-tools report` (plamo2_tools/report/inputs.py names the same
# pair; tests/report/test_report_kinds.py keeps the two equal).
KIND = "plamo2-bench-export"
SCHEMA_VERSION = 1
MARGIN = 2 * 2**30  # free space kept beyond the largest output


def runs(src: Path, work: Path, workers: int) -> list[tuple[str, list[str], Path]]:
    copy, export = work / "cp", work / "fp8"
    return [
        ("cp -r", ["cp", "-r", str(src), str(copy)], copy),
        ("cp -r && sync", ["sh", "-c", f'cp -r "{src}" "{copy}" && sync'], copy),
        (
            f"export fp8 --no-verify --workers {workers}",
            [*CLI, "export", "fp8", str(src), str(export), "--no-verify", "--workers", str(workers), "--json"],
            export,
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="plamo-3-8b")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache", choices=("cold", "warm", "drop"), default="cold")
    ap.add_argument("--keep-source", action="store_true", help="leave DIR/src for the next run (16 GB for 8B)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = a.work / "src"
    checkpoint = ensure_checkpoint(src, a.preset, 1, "random")
    need = checkpoint["bytes"] + MARGIN  # a copy is the largest output (the export is about half)
    free = shutil.disk_usage(a.work).free
    if free < need:
        raise SystemExit(f"{a.work}: {free / 1e9:.1f} GB free, a copy of the checkpoint needs {need / 1e9:.1f} GB")
    files = [Path(f) for f in checkpoint.pop("files")]
    records: dict[str, list[dict[str, Any]]] = {}
    started = time.time()
    load = [os.getloadavg()]
    for _ in range(a.repeat):
        for what, cmd, out in runs(src, a.work, a.workers):
            shutil.rmtree(out, ignore_errors=True)
            cache = evict(files, a.cache)
            r = run_timed(cmd, sample=True)
            r.update(what=what, command=" ".join(cmd), cache=cache, bytes_written=dir_bytes(out))
            if what.startswith("export"):
                r["export"] = json.loads(r["stdout"])
            r.pop("stdout")
            records.setdefault(what, []).append(r)
            shutil.rmtree(out, ignore_errors=True)
            print(f"{what}: {r['wall_s']:.1f} s, peak RSS {(r['peak_rss_bytes'] or 0) / 2**20:.0f} MiB", flush=True)
    load.append(os.getloadavg())

    def summary(what: str) -> dict[str, Any]:
        rs = records[what]
        return {
            "what": what,
            "seconds": statistics.median(r["wall_s"] for r in rs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in rs),
            "bytes_written": rs[0]["bytes_written"],
            "runs": rs,
        }

    cp = summary("cp -r")
    results = [summary(w) for w in records if w != "cp -r"]
    for r in results:
        r["ratio_vs_cp"] = r["seconds"] / cp["seconds"]
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([sys.executable, *sys.argv]),
        "preset": a.preset,
        "checkpoint": checkpoint,
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "load_average_start_end": load,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "baseline": cp,
        "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in results:
        print(
            f"{r['what']}: {r['seconds']:.1f} s = {r['ratio_vs_cp']:.2f}x cp -r ({cp['seconds']:.1f} s), "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    if not a.keep_source:
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
