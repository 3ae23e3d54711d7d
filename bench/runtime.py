"""End-to-end runtime throughput on one GPU: prefill tokens/s and decode tokens/s of a shard
directory, Triton kernels against the PyTorch path, in one run.

    python bench/runtime.py SHARDS --out reports/bench_runtime.json [--prefill 2048,8192] [--decode 1,32,128]

Eager execution (no CUDA graphs): small-batch decode therefore includes Python and launch overhead,
which is what a user of this runtime sees.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from plamo2_tools.runtime.engine import Runtime


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_tokens_per_s(rt: Runtime, T: int, repeats: int = 3) -> float:
    eng = rt.engines[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.cfg.vocab_size, (T,), generator=g).tolist()
    times = []
    for _ in range(repeats + 1):  # the first run warms up (Triton compile, autotune, allocator)
        states = eng._states(1, T)
        batch = eng._batch([prompt], [0], decode=False, logits_index=[T - 1])
        _sync()
        t0 = time.perf_counter()
        eng.model.forward(batch, states)
        _sync()
        times.append(time.perf_counter() - t0)
    return T / sorted(times[1:])[len(times[1:]) // 2]


def decode_tokens_per_s(rt: Runtime, batch_size: int, context: int = 256, steps: int = 32) -> float:
    eng = rt.engines[0]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, eng.cfg.vocab_size, (context,), generator=g).tolist() for _ in range(batch_size)]
    states = eng._states(batch_size, context + steps + 8)
    eng._prefill(prompts, states, all_logits=False)
    tokens = [[5] for _ in range(batch_size)]
    warm = 4
    _sync()
    for step in range(warm + steps):
        if step == warm:
            _sync()
            t0 = time.perf_counter()
        batch = eng._batch(tokens, [context + step] * batch_size, decode=True, logits_index=None)
        logits = eng.model.forward(batch, states)
        tokens = [[t] for t in logits.argmax(-1).tolist()]  # the host sync a real loop has too
    _sync()
    return batch_size * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--decode", default="1,32,128")
    args = ap.parse_args()
    results = {"kind": "plamo2-bench-runtime", "shards": str(args.shards), "device": args.device,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "runs": []}  # fmt: skip
    for backend in args.backends.split(","):
        with Runtime(args.shards, device=args.device, backend=backend, mode="local") as rt:
            for T in map(int, args.prefill.split(",")):
                tps = prefill_tokens_per_s(rt, T)
                results["runs"].append({"backend": backend, "phase": "prefill", "tokens": T, "tokens_per_s": tps})
                print(f"{backend:6s} prefill T={T:6d}: {tps:12.0f} tokens/s", flush=True)
            for B in map(int, args.decode.split(",")):
                tps = decode_tokens_per_s(rt, B)
                results["runs"].append({"backend": backend, "phase": "decode", "batch": B, "tokens_per_s": tps})
                print(f"{backend:6s} decode  B={B:6d}: {tps:12.1f} tokens/s", flush=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    by = {(r["backend"], r["phase"], r.get("tokens", r.get("batch"))): r["tokens_per_s"] for r in results["runs"]}
    for (backend, phase, n), v in sorted(by.items()):
        if backend == "triton" and ("torch", phase, n) in by:
            print(f"triton/torch {phase} {n}: {v / by[('torch', phase, n)]:.2f}x")


if __name__ == "__main__":
    main()
