"""Benchmark `plamo2-tools export mlx` against a plain copy of the same checkpoint (not a test).

    python bench/export_mlx.py --work DIR --out reports/export/mlx.json [--presets plamo-2-1b,plamo-3-8b]

For each preset, synthesises DIR/<preset> in bfloat16 (reused when there), then times, one after
the other and each into a fresh directory deleted afterwards (the disk holds one output at a time):
`cp -r` of the checkpoint, `export mlx` unquantized (bfloat16, as the source), `--bits 4`,
`--bits 4 --mixed` and `--bits 8`, all with `--no-verify` (the float64 reference of a 1B+ model
on CPU is a separate cost, not the export's).  Before every run the source's pages leave the page
cache (posix_fadvise DONTNEED on each source file, after a sync), so the copy and the exports read
from the disk alike.  Peak RSS is the child's own high-water mark (VmHWM, sampled from /proc every
20 ms).  The JSON is rewritten after every run, with the command line that made it.
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
import threading
import time
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "plamo2_tools.cli"]
KIND = "plamo2-bench-export-mlx"
SCHEMA_VERSION = 1
RUNS = {
    "bf16": [],
    "4bit": ["--bits", "4"],
    "4bit-mixed": ["--bits", "4", "--mixed"],
    "8bit": ["--bits", "8"],
}


def evict(directory: Path) -> None:
    """Take a directory's files out of the page cache (ours only: no global drop_caches)."""
    os.sync()
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def vm_hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_timed(cmd: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], vm_hwm(proc.pid) or 0)
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": peak[0] or None, "stdout": out.decode()}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", default="plamo-2-1b,plamo-3-8b")
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "cache": "source evicted (posix_fadvise DONTNEED) before every run",
        "presets": {},
    }
    for preset in args.presets.split(","):
        src = args.work / preset
        if not (src / "config.json").is_file():
            subprocess.run(
                [*CLI, "synth", str(src), "--preset", preset, "--dtype", "bfloat16", "--force", "--json"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        entry: dict[str, Any] = {"source_bytes": du(src), "runs": {}}
        result["presets"][preset] = entry
        dst = args.work / f"{preset}.out"
        shutil.rmtree(dst, ignore_errors=True)
        evict(src)
        cp = run_timed(["cp", "-r", str(src), str(dst)])
        entry["runs"]["cp"] = {"wall_s": cp["wall_s"], "peak_rss_bytes": cp["peak_rss_bytes"], "bytes": du(dst)}
        shutil.rmtree(dst)
        for name in args.runs.split(","):
            evict(src)
            r = run_timed([*CLI, "export", "mlx", str(src), str(dst), *RUNS[name], "--no-verify", "--json"])
            record = json.loads(r["stdout"])
            entry["runs"][name] = {
                "wall_s": r["wall_s"],
                "vs_cp": r["wall_s"] / cp["wall_s"],
                "peak_rss_bytes": r["peak_rss_bytes"],
                "bytes": du(dst),
                "bits_per_weight": record["bits_per_weight"],
                "quantized_tensors": record["quantized_tensors"],
                "args": RUNS[name],
            }
            shutil.rmtree(dst)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            print(preset, name, f"{r['wall_s']:.1f} s ({r['wall_s'] / cp['wall_s']:.2f}x cp)", flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
