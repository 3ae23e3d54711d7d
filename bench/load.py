"""Weight loading of one shard directory on this machine, before and after issue 33 (not a test).

    python bench/load.py SHARDS --out reports/startup/NAME.json [--repeat 5] [--cache warm|cold] [--device cpu]

Times, interleaved round by round (a noisy neighbour slows every kind alike), in this process:
* `read`: every shard file read once into one reusable buffer (`preadv`): the page cache's (warm)
  or the disk's (cold) speed, the floor of any load;
* `before`: what main did up to 97d0f15 — `verify_shard_files` with digests (one pass over every
  byte, XXH3 on every core), then each tensor through `safetensors.safe_open(...).get_tensor`
  (on the CPU: tensors left on safetensors' mapping of the file, nothing copied);
* `before_copied`: the same, each tensor then copied into memory of its own (on the CPU: the copy
  `after` makes, and the CUDA path's work on the way to the card; on CUDA the same as `before`);
* `after`: header checks only, then `runtime/rank/weights.load_rank_weights`: one `preadv` pass
  into the tensors' memory with each file's digest taken from the loaded bytes on a second thread;
* `after_no_verify`: the same without the digests (`--no-verify`): the copy alone.
Per kind: median wall seconds, GB/s over the shard bytes, and CPU seconds of this process (all
threads) per run.  `--cache cold` drops the files from the page cache before every timed run
(`posix_fadvise` DONTNEED after a sync), so each run reads from the disk.  Every kind's tensors are
checked equal to the first `after` load's once (a benchmark of a wrong loader is worthless).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

KIND = "plamo2-bench-load"
SCHEMA_VERSION = 1


def evict(paths: list[Path]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_BUFFER = memoryview(bytearray(32 << 20))


def read_all(paths: list[Path]) -> None:
    view = _BUFFER
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [view], offset):
                offset += n
        finally:
            os.close(fd)


def load_before(m: Any, device: torch.device, copied: bool = False) -> dict[str, torch.Tensor]:
    """main's runtime/rank/weights.py at 97d0f15, after main's verify_shard_files(digests=True).
    On the CPU safetensors hands out tensors backed by its mapping of the file (no copy: the first
    forward faults the pages in, and a file rewritten after the check is what runs); `copied`
    also copies each into memory of its own, the work the CUDA path does on its way to the card."""
    from safetensors import safe_open

    from plamo2_tools.shards.integrity import verify_shard_files

    verify_shard_files(m, range(m.mapping.world_size), digests=True)
    out: dict[str, torch.Tensor] = {}
    for rank in range(m.mapping.world_size):
        for name in m.rank_files(rank):
            with safe_open(str(m.path / name), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - a safe_open handle
                    out[key] = f.get_tensor(key).clone() if copied and device.type == "cpu" else f.get_tensor(key)
    return out


def load_after(m: Any, device: torch.device, verify: bool = True) -> dict[str, torch.Tensor]:
    from plamo2_tools.runtime.rank.weights import load_rank_weights
    from plamo2_tools.shards.integrity import verify_shard_files

    verify_shard_files(m, range(m.mapping.world_size), digests=False)
    out: dict[str, torch.Tensor] = {}
    for rank in range(m.mapping.world_size):
        out.update(load_rank_weights(m, rank, device, verify=verify))
    return out


def git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().reshape(-1).view(torch.uint8)


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime), value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from plamo2_tools.shards.manifest import load_manifest

    m = load_manifest(args.shards)
    device = torch.device(args.device)
    paths = [m.path / n for r in range(m.mapping.world_size) for n in m.rank_files(r)]
    total = sum(p.stat().st_size for p in paths)
    kinds: dict[str, Callable[[], Any]] = {
        "read": lambda: read_all(paths),
        "before": lambda: load_before(m, device),
        "before_copied": lambda: load_before(m, device, copied=True),
        "after": lambda: load_after(m, device),
        "after_no_verify": lambda: load_after(m, device, verify=False),
    }
    if device.type != "cpu":
        del kinds["before_copied"]  # get_tensor already copies to the device
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    reference = None
    read_all(paths)  # warm start: the page cache holds the files
    for round_ in range(args.repeat):
        for kind, fn in kinds.items():
            if args.cache == "cold":
                evict(paths)
            wall, cpu, value = timed(fn)
            runs[kind].append({"wall_s": wall, "cpu_s": cpu})
            if isinstance(value, dict):
                if reference is None:
                    reference = {k: t.cpu() for k, t in value.items()}
                elif round_ == 0:
                    assert set(value) == set(reference), kind
                    for k, t in value.items():
                        assert torch.equal(_bytes(t), _bytes(reference[k])), (kind, k)
            del value
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]['wall_s']:.2f}s" for k, v in runs.items()), flush=True)
    summary = {}
    for kind, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        summary[kind] = {
            "wall_s_median": wall,
            "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
            "gb_per_s": total / wall / 1e9,
            "runs": rs,
        }
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "commit": os.environ.get("PLAMO2_BENCH_COMMIT") or git_commit(),
        "shards": str(args.shards),
        "bytes": total,
        "files": len(paths),
        "format_version": m.format.version,
        "hash": m.hash,
        "device": args.device,
        "cache": args.cache,
        "repeat": args.repeat,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg": os.getloadavg(),
        },
        "kinds": summary,
        "after_vs_before_wall": summary["after"]["wall_s_median"] / summary["before"]["wall_s_median"],
        "after_vs_before_copied_wall": (
            summary["after"]["wall_s_median"] / summary["before_copied"]["wall_s_median"]
            if "before_copied" in summary
            else None
        ),
        "after_vs_read_wall": summary["after"]["wall_s_median"] / summary["read"]["wall_s_median"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for kind, s in summary.items():
        print(f"{kind:<16} wall {s['wall_s_median']:.3f} s  {s['gb_per_s']:.2f} GB/s  cpu {s['cpu_s_median']:.2f} s")


if __name__ == "__main__":
    main()
