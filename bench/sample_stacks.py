"""Where a Python program's threads spend their time: a poor man's py-spy (the GPU host has none).

    python bench/sample_stacks.py --out stacks.json [--interval 0.005] [--module] -- SCRIPT [ARGS...]

Runs SCRIPT in this process (as `python SCRIPT ARGS` would, via runpy; with --module SCRIPT is a
module name, as `python -m SCRIPT ARGS`) while a daemon thread reads
every other thread's stack (`sys._current_frames`) each `--interval` seconds.  Reports, per thread
name, the most frequent leaf frames ("self" time) and the frames that appear anywhere in the stack
("total" time), as fractions of that thread's samples.  A thread waiting in a C call (a CUDA sync,
a lock) shows that call's Python caller as its leaf.
"""

from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
import threading
import time
from pathlib import Path


def _where(frame) -> str:  # noqa: ANN001
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--module", action="store_true")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    done = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not done.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                samples[name] += 1
                leaf[name][_where(frame)] += 1
                seen = set()
                f = frame
                while f is not None:
                    w = f"{Path(f.f_code.co_filename).name} {f.f_code.co_name}"
                    if w not in seen:
                        total[name][w] += 1
                        seen.add(w)
                    f = f.f_back
            time.sleep(a.interval)

    threading.Thread(target=sample, daemon=True, name="sampler").start()
    sys.argv = [a.script, *a.args]
    t0 = time.perf_counter()
    try:
        if a.module:
            runpy.run_module(a.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(a.script, run_name="__main__")
    except SystemExit:
        pass
    finally:
        done.set()
        wall = time.perf_counter() - t0
        report = {
            "kind": "plamo2-stack-samples",
            "wall_seconds": wall,
            "interval": a.interval,
            "threads": {
                name: {
                    "samples": n,
                    "self": [(w, c / n) for w, c in leaf[name].most_common(a.top)],
                    "total": [(w, c / n) for w, c in total[name].most_common(a.top)],
                }
                for name, n in samples.most_common()
                if n > 10
            },
        }
        Path(a.out).write_text(json.dumps(report, indent=1))
        for name, t in report["threads"].items():
            print(f"--- thread {name}: {t['samples']} samples")
            for w, f in t["self"][:12]:
                print(f"  self  {f:6.1%}  {w}")
            for w, f in t["total"][:12]:
                print(f"  total {f:6.1%}  {w}")


if __name__ == "__main__":
    main()
