"""Runtime throughput through the public API (`Runtime.generate`): decode tokens/s per batch size,
prefill tokens/s of one sequence and of many packed into one forward, and a GSM8K-shaped
continuous-batching run split into its phases.

    python bench/runtime.py SHARDS --out bench_runtime.json [--decode 1,8,64,256]
        [--modes triton-graphs,triton-eager,torch-eager] [--prefill 2048,8192,32768] [--packed 1336]
        [--schedule 1319] [--batch auto] [--label 1b] [--device cuda]

Decode: `batch` random prompts of `--context` tokens, timed for N + 1 and for 1 new token;
tokens/s = batch * N / (t_{N+1} - t_1), so prefill and set-up cancel.  Against the weight-read
floor: every decode step reads every weight once (the embedding only for its rows) plus each
sequence's recurrent state (read and written) and its visible KV cache, at the device-to-device
copy rate measured in the same run (CUDA only).

Prefill: device time of the prefill forwards of one `generate(..., 1)` call (the runtime's
`PhaseTimer`), for one prompt of T tokens ("prefill", as before) and for about T tokens as T / L
prompts of L = min(`--packed`, T / 4) tokens in one forward ("prefill-packed"), after a warm-up of
each shape.

Schedule: `--schedule` requests shaped like GSM8K 5-shot (prompts of 1,336 +- 30% tokens, the mean
of the real run; answers of 64-256 tokens, since a random model never stops on its own) through
one `generate` call with `--batch` slots ("auto": as memory allows): wall time, device time of
prefill and decode, the effective prefill rate of the first fill and of refills, and the loop's
own counters (forwards, tokens per forward, groups, padding, stalled forwards).  One record
`phase: schedule`.
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
from plamo2_tools.runtime.serving.generation import LoopStats, PhaseTimer

KIND = "plamo2-bench-runtime"
# Version 1 records (backend, phase, batch | tokens, tokens_per_s) plus fields the report reads
# when present: mode, floor_tokens_per_s, copy_bandwidth_GBps, floor, label.  Phases the report
# does not draw ("prefill-packed", "schedule") carry the same keys.
SCHEMA_VERSION = 1
MODES = {  # name -> (kernel backend, CUDA graphs)
    "triton-graphs": ("triton", True),
    "triton-eager": ("triton", False),
    "torch-graphs": ("torch", True),
    "torch-eager": ("torch", False),
}
GSM8K_PROMPT_TOKENS = 1336  # mean 5-shot prompt of the full H200 run (1,762,308 tokens / 1,319)


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
    per_seq = {i: st.bytes_per_sequence() for i, st in eng.new_states(1, 1).items()}  # (fixed, per token)
    fixed = sum(f for f, _ in per_seq.values())
    kv = {i: t for i, (_, t) in per_seq.items() if t}
    return {"weights": weights, "state_per_seq": 2 * fixed, "kv_per_token": sum(kv.values()), "kv_per_layer": kv}


def visible_kv_bytes(rt: Runtime, kv_per_layer: dict[int, int], context: int) -> int:
    """KV bytes one sequence's decode step reads at this context: a sliding-window layer only its
    window (PLaMo 2's `attention_window`, PLaMo 3's `window_keys`: keys besides the query's own)."""
    cfg = rt.config

    def keys(layer: int) -> int:
        w = cfg.attention_window(layer) if hasattr(cfg, "attention_window") else cfg.window_keys(layer, "hf")
        return context if w is None else min(context, w + 1)

    return sum(b * keys(i) for i, b in kv_per_layer.items())


def floor_tokens_per_s(bytes_: dict, bandwidth: float, batch: int, kv_seq: int) -> float:
    step_bytes = bytes_["weights"] + batch * (bytes_["state_per_seq"] + kv_seq)
    return batch * bandwidth / step_bytes


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def decode_tokens_per_s(rt: Runtime, batch: int, context: int, steps: int) -> dict[str, float]:
    prompts = random_prompts(rt.config.vocab_size, [context] * batch, batch)

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


def timed_prefill(rt: Runtime, prompts: list[list[int]], repeats: int = 3) -> dict[str, float]:
    """Median device time of the prefill forwards of one generate(prompts, 1) call (after a warm-up
    call of the same shape), and how many forwards it took."""
    eng = rt.engines[0]
    seconds, forwards = [], 0
    for i in range(repeats + 1):
        timer = PhaseTimer()
        eng.timer = timer
        try:
            rt.generate(prompts, 1, max_batch=len(prompts))
        finally:
            eng.timer = None
        _sync()
        if i:
            seconds.append(timer.seconds()["prefill"])
            forwards = len(timer.forwards)
    tokens = sum(map(len, prompts))
    median = statistics.median(seconds)
    return {"tokens": tokens, "sequences": len(prompts), "seconds": median, "tokens_per_s": tokens / median,
            "forwards": forwards}  # fmt: skip


def prefill_records(rt: Runtime, sizes: list[int], packed: int, backend: str) -> list[dict[str, Any]]:
    V = rt.config.vocab_size
    out = []
    for T in sizes:
        single = timed_prefill(rt, random_prompts(V, [T], T))
        out.append({"backend": backend, "mode": "eager", "phase": "prefill", "tokens": T,
                    "tokens_per_s": single["tokens_per_s"], "seconds": single["seconds"]})  # fmt: skip
        L = max(1, min(packed, T // 4))  # at least 4 prompts in the forward
        n = T // L
        many = timed_prefill(rt, random_prompts(V, [L] * n, T + 1))
        out.append({"backend": backend, "mode": "eager", "phase": "prefill-packed", **many,
                    "prompt_tokens": L, "vs_single": many["tokens_per_s"] / single["tokens_per_s"]})  # fmt: skip
        print(f"{backend:7s} prefill T={T:6d}: one sequence {single['tokens_per_s']:10.0f} tok/s, "
              f"{n} x {L} packed {many['tokens_per_s']:10.0f} tok/s ({many['forwards']} forward(s))",
              flush=True)  # fmt: skip
    return out


def gsm8k_shaped(vocab: int, n: int, mean: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    spread = 3 * mean // 10  # GSM8K's 5-shot prompts: about +-30% around the mean
    lengths = (mean + torch.randint(-spread, spread + 1, (n,), generator=g)).clamp_min(1).tolist()
    answers = torch.randint(64, 257, (n,), generator=g).tolist()
    return random_prompts(vocab, lengths, seed + 1), answers


def schedule_record(rt: Runtime, n: int, batch: int | str, mean: int, backend: str, mode: str) -> dict[str, Any]:
    """A GSM8K-shaped run through one generate call, split into phases (see the module doc)."""
    eng = rt.engines[0]
    prompts, answers = gsm8k_shaped(rt.config.vocab_size, n, mean)
    capacity = max(len(p) + a for p, a in zip(prompts, answers, strict=True))
    slots = rt.auto_batch_size(capacity).slots if batch == "auto" else int(batch)
    slots = min(slots, n)
    # Warm-up outside the clock: the pool and its graphs for this call, and prefill forwards of the
    # sizes the run will make (kernel compilation, the SSD kernels' per-shape pick).
    rt.prepare_decode(slots, capacity)
    warm = min(n, 2 * slots)
    rt.generate(prompts[:warm], 4, max_batch=slots)
    _sync()
    timer = PhaseTimer()
    eng.timer, eng.stats = timer, LoopStats()  # this call's counters only
    t0 = time.perf_counter()
    try:
        gen = rt.generate(prompts, answers, max_batch=slots)
        _sync()
    finally:
        eng.timer = None
    wall = time.perf_counter() - t0
    device = timer.seconds()
    forwards = timer.forward_seconds()
    stats = eng.stats

    def rate(rows: list[tuple[int, int, bool, float]]) -> float | None:
        secs = sum(r[3] for r in rows)
        return sum(r[0] for r in rows) / secs if secs else None

    first = [f for f in forwards if not f[2]]
    refill = [f for f in forwards if f[2]]
    generated = sum(map(len, gen.tokens))
    record = {
        "backend": backend, "mode": mode, "phase": "schedule", "batch": gen.slots, "requests": n,
        "tokens_per_s": generated / wall, "wall_seconds": wall,
        "prompt_tokens": sum(map(len, prompts)), "generated_tokens": generated,
        "prefill_device_seconds": device["prefill"], "decode_device_seconds": device["decode"],
        "host_other_seconds": wall - device["prefill"] - device["decode"],
        "prefill_tokens_per_s": rate(forwards), "prefill_tokens_per_s_first_fill": rate(first),
        "prefill_tokens_per_s_refill": rate(refill), "refill_forwards": len(refill),
        "decode_steps_per_s": stats.decode_steps / device["decode"] if device["decode"] else None,
        "loop": stats.summary(),
        "auto_batch": rt.batch_plan.to_dict() if batch == "auto" and rt.batch_plan else None,
    }  # fmt: skip
    rates = [record[k] or 0 for k in ("prefill_tokens_per_s", "prefill_tokens_per_s_refill")]
    print(f"{backend:7s} schedule: {n} requests in {wall:.1f} s ({gen.slots} slots): prefill {device['prefill']:.2f} s "
          f"at {rates[0]:,.0f} tok/s (refills {rates[1]:,.0f}), decode {device['decode']:.2f} s, {stats.summary()}",
          flush=True)  # fmt: skip
    return record


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    bandwidth = copy_bandwidth() if cuda else None
    results: dict[str, Any] = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "label": args.label,
        "shards": str(args.shards),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "decode_steps": args.steps,
        "runs": [],
    }
    if bandwidth is not None:
        results["copy_bandwidth_GBps"] = bandwidth / 1e9
        print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    if args.profile is not None and args.profile.exists():
        prof = json.loads(args.profile.read_text())
        results["profile_decode"] = {
            "how": "bench/profile_decode.py: kernels of the eager Triton decode step (a graph replays the same "
            "kernels), per step, summed by kernel name",
            "batches": {b: {**{k: v for k, v in p.items() if k != "kernels"}, "top_kernels": p["kernels"][:12]}
                        for b, p in prof.items()},
        }  # fmt: skip
    batch: int | str = args.batch if args.batch == "auto" else int(args.batch)
    for i, mode in enumerate(args.modes.split(",")):
        backend, graphs = MODES[mode]
        with Runtime(args.shards, device=args.device, backend=backend, mode="local", cuda_graph=graphs) as rt:
            if "bytes" not in results:
                results["bytes"] = model_bytes(rt)
            if bandwidth is not None and "floor" not in results:
                b = results["bytes"]
                results["floor"] = {
                    "weight_read_ms": 1000 * b["weights"] / bandwidth,
                    "weight_read_tokens_per_s_batch1": bandwidth / b["weights"],
                }
            ctx = args.context + args.steps // 2  # mean visible context over the timed steps
            for B in map(int, filter(None, args.decode.split(","))):
                r = decode_tokens_per_s(rt, B, args.context, args.steps)
                rec = {"backend": backend, "mode": "graphs" if graphs else "eager", "phase": "decode", "batch": B, **r}
                if bandwidth is not None:
                    kv_seq = visible_kv_bytes(rt, results["bytes"]["kv_per_layer"], ctx)
                    floor = floor_tokens_per_s(results["bytes"], bandwidth, B, kv_seq)
                    rec.update(floor_tokens_per_s=floor, fraction_of_floor=r["tokens_per_s"] / floor)
                results["runs"].append(rec)
                floor_text = (
                    f"  floor {rec['floor_tokens_per_s']:10.0f} ({rec['fraction_of_floor']:.0%})" if bandwidth else ""
                )
                speed = f"{r['tokens_per_s']:10.0f} tok/s  {r['step_ms']:7.3f} ms/step"
                print(f"{mode:14s} decode B={B:4d}: {speed}{floor_text}", flush=True)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
            if graphs or backend == "torch":
                sizes = list(map(int, filter(None, args.prefill.split(","))))
                results["runs"] += prefill_records(rt, sizes, args.packed, backend)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
            if args.schedule and i == 0:  # the first (fastest) mode only
                how = "graphs" if graphs else "eager"
                results["runs"].append(schedule_record(rt, args.schedule, batch, args.prompt_tokens, backend, how))
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        if cuda:
            torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="triton-graphs,triton-eager,torch-eager")
    ap.add_argument("--decode", default="1,8,64,256")
    ap.add_argument("--prefill", default="2048,8192,32768", help="prefill sizes T (tokens per call)")
    ap.add_argument("--packed", type=int, default=GSM8K_PROMPT_TOKENS, help="prompt length L of the packed prefill")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--schedule", type=int, default=0, help="requests of the GSM8K-shaped run (0: none)")
    ap.add_argument("--prompt-tokens", type=int, default=GSM8K_PROMPT_TOKENS, help="its mean prompt length")
    ap.add_argument("--batch", default="auto", help="slots of the GSM8K-shaped run: a number or auto")
    ap.add_argument("--profile", type=Path, default=None, help="embed bench/profile_decode.py's JSON")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
