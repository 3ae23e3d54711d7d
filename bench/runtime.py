"""Runtime throughput on one GPU: decode tokens/s per batch size with CUDA graphs, eager, and the
PyTorch path, against the weight-read floor computed from copy bandwidth measured in the same run;
prefill tokens/s for a few lengths.

    python bench/runtime.py SHARDS --out bench_runtime.json [--decode 1,8,64,256]
        [--modes triton-graphs,triton-eager,torch-eager] [--prefill 2048,8192,32768] [--label 1b]

Decode is measured the way users run it: `Runtime.generate` (continuous-batching loop, tokens
chosen on the GPU, host looking every 8 steps) on `batch` random prompts of `--context` tokens,
timed for N and for 1 new token; tokens/s = batch * (N - 1) / (t_N - t_1), so prefill and set-up
cancel.  The floor: every decode step reads every weight once (the embedding only for its rows)
plus each sequence's recurrent state (read and written) and its visible KV cache; at the measured
device-to-device copy rate (bytes read + written) that gives the best possible step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from plamo2_tools.runtime.serving.engine import Runtime

KIND = "plamo2-bench-runtime"
# Version 1 records (backend, phase, batch | tokens, tokens_per_s) plus fields the report reads
# when present: mode, floor_tokens_per_s, copy_bandwidth_GBps, floor, label.
SCHEMA_VERSION = 1
MODES = {  # name -> (kernel backend, CUDA graphs)
    "triton-graphs": ("triton", True),
    "triton-eager": ("triton", False),
    "torch-graphs": ("torch", True),
    "torch-eager": ("torch", False),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def model_bytes(rt: Runtime) -> dict[str, int]:
    """Bytes one decode step must read, per step (weights) and per sequence (state)."""
    eng = rt.engines[0]
    model = eng.model
    weights = 0
    seen: set[int] = set()
    tensors: list[torch.Tensor] = [model.lm_head, model.final_norm]
    for layer in model.layers:
        tensors += [layer.gate_up, layer.down, *layer.norms.values()]
        tensors += [v for v in vars(layer.mixer).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    states = eng._states(1, 1)
    ssm = sum(st.ssm.numel() * st.ssm.element_size() + st.conv.numel() * st.conv.element_size()
              for st in states.values() if st.ssm is not None)  # fmt: skip
    kv_token = sum(2 * st.k.numel() * st.k.element_size() for st in states.values() if st.k is not None)
    return {"weights": weights, "state_per_seq": 2 * ssm, "kv_per_token": kv_token}


def floor_tokens_per_s(bytes_: dict[str, int], bandwidth: float, batch: int, context: int, window: int) -> float:
    step_bytes = bytes_["weights"] + batch * (bytes_["state_per_seq"] + bytes_["kv_per_token"] * min(context, window))
    return batch * bandwidth / step_bytes


def decode_tokens_per_s(rt: Runtime, batch: int, context: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, rt.config.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]

    def timed(n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        rt.generate(prompts, n, max_batch=batch)
        _sync()
        return time.perf_counter() - t0

    t_warm = timed(steps + 1)  # capture graphs, compile kernels, size the pools
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(steps + 1) for _ in range(2))
    per_step = (tn - t1) / steps
    return {"tokens_per_s": batch / per_step, "step_ms": 1000 * per_step, "first_call_s": t_warm}


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
    return T / statistics.median(times[1:])


def run(args: argparse.Namespace) -> dict[str, Any]:
    bandwidth = copy_bandwidth()
    results: dict[str, Any] = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "label": args.label,
        "shards": str(args.shards),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "context": args.context,
        "decode_steps": args.steps,
        "runs": [],
    }
    if args.profile is not None and args.profile.exists():
        prof = json.loads(args.profile.read_text())
        results["profile_decode"] = {
            "how": "bench/profile_decode.py: kernels of the eager Triton decode step (a graph replays the same "
            "kernels), per step, summed by kernel name",
            "batches": {b: {**{k: v for k, v in p.items() if k != "kernels"}, "top_kernels": p["kernels"][:12]}
                        for b, p in prof.items()},
        }  # fmt: skip
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    for mode in args.modes.split(","):
        backend, graphs = MODES[mode]
        with Runtime(args.shards, device="cuda", backend=backend, mode="local", cuda_graph=graphs) as rt:
            if "floor" not in results:
                b = model_bytes(rt)
                window = rt.config.attention_window_size + 1
                results["bytes"] = b
                results["floor"] = {
                    "weight_read_ms": 1000 * b["weights"] / bandwidth,
                    "weight_read_tokens_per_s_batch1": bandwidth / b["weights"],
                }
            ctx = args.context + args.steps // 2  # mean visible context over the timed steps
            for B in map(int, args.decode.split(",")):
                r = decode_tokens_per_s(rt, B, args.context, args.steps)
                floor = floor_tokens_per_s(results["bytes"], bandwidth, B, ctx, window)
                rec = {"backend": backend, "mode": "graphs" if graphs else "eager", "phase": "decode", "batch": B,
                       **r, "floor_tokens_per_s": floor, "fraction_of_floor": r["tokens_per_s"] / floor}  # fmt: skip
                results["runs"].append(rec)
                print(f"{mode:14s} decode B={B:4d}: {r['tokens_per_s']:10.0f} tok/s  {r['step_ms']:7.3f} ms/step  "
                      f"floor {floor:10.0f} ({rec['fraction_of_floor']:.0%})", flush=True)  # fmt: skip
                args.out.write_text(json.dumps(results, indent=2) + "\n")
            if graphs or backend == "torch":
                for T in map(int, filter(None, args.prefill.split(","))):
                    tps = prefill_tokens_per_s(rt, T)
                    rec = {"backend": backend, "mode": "eager", "phase": "prefill", "tokens": T, "tokens_per_s": tps}
                    results["runs"].append(rec)
                    print(f"{mode:14s} prefill T={T:6d}: {tps:10.0f} tok/s", flush=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--modes", default="triton-graphs,triton-eager,torch-eager")
    ap.add_argument("--decode", default="1,8,64,256")
    ap.add_argument("--prefill", default="2048,8192,32768")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--profile", type=Path, default=None, help="embed bench/profile_decode.py's JSON")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
