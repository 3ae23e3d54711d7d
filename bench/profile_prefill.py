"""Where prefill time goes: one long prompt vs the same tokens as many packed prompts, through the
public API (`Runtime.generate` with one new token), with the CUDA time of every kernel.

    python bench/profile_prefill.py SHARDS --out profile_prefill.json [--tokens 32768] [--prompt 1336]

The runtime reaches ~190k tokens/s on one long sequence but GSM8K-shaped prefill (groups of ~24
prompts of ~1,336 tokens) ran at ~35k (reports/e2e/gsm8k_h200.json): this says which kernels take
the difference.  Writes `kind: plamo2-bench-runtime` records (`phase: prefill-profile`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

KIND = "plamo2-bench-runtime"
SCHEMA_VERSION = 1


def _profile(rt: Any, prompts: list[list[int]], label: str, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    rt.generate(prompts, 1)  # warm-up: compile, autotune
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rt.generate(prompts, 1)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        rt.generate(prompts, 1)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.device_type.name == "CUDA":
            kernels[e.key][0] += cuda_us
            kernels[e.key][1] += e.count
    total = sum(v[0] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    tokens = sum(map(len, prompts))
    return {
        "phase": "prefill-profile", "label": label, "prompts": len(prompts), "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall, "kernel_ms": total / 1000,
        "top_kernels": [{"name": k[:160], "ms": v[0] / 1000, "calls": v[1], "share": v[0] / total} for k, v in ranked],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=1336, help="tokens per packed prompt")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from plamo2_tools.runtime.serving.engine import Runtime

    g = torch.Generator().manual_seed(0)
    with Runtime(args.shards, device="cuda", backend="triton") as rt:
        V = rt.config.vocab_size
        long = [torch.randint(3, V, (args.tokens,), generator=g).tolist()]
        n = max(1, args.tokens // args.prompt)
        packed = [torch.randint(3, V, (args.prompt,), generator=g).tolist() for _ in range(n)]
        runs = [_profile(rt, long, "one sequence", args.top), _profile(rt, packed, f"{n} packed prompts", args.top)]
    result = {"kind": KIND, "schema_version": SCHEMA_VERSION, "runs": runs,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"{r['label']}: {r['tokens']} tokens in {r['wall_s']:.3f} s = {r['tokens_per_s']:.0f} tok/s; "
              f"kernels {r['kernel_ms']:.1f} ms")  # fmt: skip
        for k in r["top_kernels"][:12]:
            print(f"   {k['ms']:8.2f} ms {k['share']:6.1%} x{k['calls']:<5} {k['name'][:100]}")


if __name__ == "__main__":
    main()
