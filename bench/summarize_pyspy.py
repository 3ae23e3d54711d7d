"""Where a server's processes and threads spend their time, from py-spy's raw samples.

    py-spy record --pid SERVE_PID --subprocesses --threads --nonblocking --rate 50 --duration 25 \
        --format raw -o samples.txt
    python bench/summarize_pyspy.py samples.txt > summary.txt

Per (process, thread): its share of all samples (py-spy leaves idle threads out), the most frequent
leaf frames ("self") and the functions anywhere on the stack ("total"), as shares of that thread's
samples.  The process is named by its role in `serve`: the HTTP process runs `serve.front`, the
other one holds the model and its loop.  docs/serve.md, "Where the time goes", has what it found.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

Counter = collections.Counter[str]
THREAD = re.compile(r"thread \(\d+\): ?")


def role(processes: list[str]) -> str:
    return "front (HTTP)" if processes and "serve.front" in processes[-1] else "model (loop)"


def summarize(lines: list[str], top_self: int = 8, top_total: int = 14) -> str:
    per: Counter = collections.Counter()
    leaf: dict[str, Counter] = collections.defaultdict(collections.Counter)
    total: dict[str, Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        name = THREAD.sub("", thread)
        key = f"{role([f for f in frames if f.startswith('process ')])} / {name}"
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        per[key] += n
        if code:
            leaf[key][re.sub(r" \(.*/", " (", code[-1])] += n
            for name in {re.sub(r" \(.*", "", f) for f in code}:
                total[key][name] += n
    everything = sum(per.values()) or 1
    out = []
    for key, n in per.most_common():
        out.append(f"\n## {key}: {n} samples ({100 * n / everything:.0f}% of all)")
        out.append("self: " + "; ".join(f"{f} {100 * c / n:.0f}%" for f, c in leaf[key].most_common(top_self)))
        out.append("total: " + "; ".join(f"{f} {100 * c / n:.0f}%" for f, c in total[key].most_common(top_total)))
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]).read_text().splitlines()))
