"""Where a decode step's GPU time goes: the kernels of one step (eager, so the profiler sees each
launch; a graph replays the same kernels), summed by name, at a few batch sizes.

    python bench/profile_decode.py SHARDS --out profile.json [--batch 1,64,256] [--context 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from plamo2_tools.runtime.serving.engine import Runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    report = {}
    with Runtime(args.shards, device="cuda", backend="triton", mode="local", cuda_graph=False) as rt:
        eng = rt.engines[0]
        for B in map(int, args.batch.split(",")):
            g = torch.Generator().manual_seed(B)
            prompts = [torch.randint(3, rt.config.vocab_size, (args.context,), generator=g).tolist() for _ in range(B)]
            rt.generate(prompts, 4, max_batch=B)  # warm-up: kernels compiled, runner sized
            runner = eng.decode_runner
            for _ in range(2):
                runner.step(B, (0.0, 1.0))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    runner.step(B, (0.0, 1.0))
                torch.cuda.synchronize()
            kernels: dict[str, list[float]] = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.setdefault(ev.name, []).append(ev.device_time)
            rows = sorted(((sum(v) / args.steps, len(v) / args.steps, k) for k, v in kernels.items()), reverse=True)
            total = sum(r[0] for r in rows)
            launches = sum(r[1] for r in rows)
            table = [{"name": k[:120], "us_per_step": us, "calls_per_step": n} for us, n, k in rows]
            report[B] = {"step_gpu_us": total, "launches_per_step": launches, "kernels": table}
            print(f"B={B}: {total:.0f} us of kernels, {launches:.0f} launches per step")
            for us, n, k in rows[:25]:
                print(f"  {us:9.1f} us  {n:5.1f}x  {k[:100]}")
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
