"""Runtime throughput and latency: decode tokens/s and ms/step by batch, prefill tokens/s, a GSM8K-shaped run.

    python -m bench throughput [--shards DIR | --preset plamo-2-1b --dtype bfloat16] [--device cuda]
        [--modes triton-graphs,triton-eager,torch-eager] [--decode 1,8,64,256] [--prefill 2048,8192,32768]
        [--packed 1336] [--schedule 1319 --prompt-tokens 1336 --batch auto] [--profile-decode 1,64,256]
        [--profile-prefill 32768]

Everything goes through the public API (`Runtime.generate`).

Decode: `batch` random prompts of `--context` tokens, timed for N + 1 and for 1 new token;
tokens/s = batch * N / (t_{N+1} - t_1), so prefill and set-up cancel; ms/step is the latency of
one decode step of the whole batch.  Baseline, measured in the same run (CUDA only): the
weight-read floor -- every decode step reads every weight once (the embedding only for its rows)
plus each sequence's recurrent state (read and written) and its visible KV cache, at the
device-to-device copy rate measured first.  The modes are a second baseline: the PyTorch path
(`torch-eager`) beside the Triton kernels with and without CUDA graphs.

Prefill: device time of the prefill forwards of one `generate(..., 1)` call (the runtime's
`PhaseTimer`), for one prompt of T tokens ("prefill") and for about T tokens as T / L prompts of
L = min(`--packed`, T / 4) tokens in one forward ("prefill-packed"), after a warm-up of each shape.

Schedule: `--schedule` requests shaped like GSM8K 5-shot (prompts of `--prompt-tokens` +- 30%,
answers of 64-256 tokens, since a random model never stops on its own) through one `generate`
call with `--batch` slots ("auto": as memory allows): wall time, device time of prefill and
decode, the effective prefill rate of the first fill and of refills, and the loop's own counters.

Profiles (CUDA only): `--profile-decode B,...` the kernels of one eager Triton decode step (a graph
replays the same kernels) summed by name; `--profile-prefill T` the kernels of one T-token prompt
against the same tokens as packed `--packed`-token prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from bench.common import Result, ints, model_inputs, work_dir
from bench.common import prefill_rate as rate
from plamo2_tools.kinds import BENCH_THROUGHPUT_KIND

KIND = BENCH_THROUGHPUT_KIND
MODEL = True
MODES = {  # name -> (kernel backend, CUDA graphs)
    "triton-graphs": ("triton", True),
    "triton-eager": ("triton", False),
    "torch-graphs": ("torch", True),
    "torch-eager": ("torch", False),
}
GSM8K_PROMPT_TOKENS = 1336  # mean 5-shot prompt of the full H200 run (1,762,308 tokens / 1,319)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default="triton-graphs,triton-eager,torch-eager", help=f"of {', '.join(MODES)}")
    ap.add_argument("--decode", default="1,8,64,256", help="decode batch sizes")
    ap.add_argument("--prefill", default="2048,8192,32768", help="prefill sizes T (tokens per call)")
    ap.add_argument("--packed", type=int, default=GSM8K_PROMPT_TOKENS, help="prompt length L of the packed prefill")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of every decode sequence")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed")
    ap.add_argument("--schedule", type=int, default=0, help="requests of the GSM8K-shaped run (0: none)")
    ap.add_argument("--prompt-tokens", type=int, default=GSM8K_PROMPT_TOKENS, help="its mean prompt length")
    ap.add_argument("--batch", default="auto", help="slots of the GSM8K-shaped run: a number or auto")
    ap.add_argument("--profile-decode", default="", metavar="B,...", help="profile the decode step at these batches")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="T", help="profile a T-token prefill")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median)."""
    import torch

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


def model_bytes(rt: Any) -> dict[str, Any]:
    """Bytes one decode step must read, per step (weights) and per sequence (state)."""
    import torch

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
    # Each mixer state knows its bytes: (fixed, per position) for one sequence (model/forward.py).
    per_seq = {i: st.bytes_per_sequence() for i, st in eng.new_states(1, 1).items()}
    fixed = sum(f for f, _ in per_seq.values())
    kv = {i: t for i, (_, t) in per_seq.items() if t}
    # The fixed state (Mamba's conv + SSM) is read and written once per step: twice its bytes.
    return {"weights": weights, "state_per_seq": 2 * fixed, "kv_per_token": sum(kv.values()), "kv_per_layer": kv}


def visible_kv_bytes(rt: Any, kv_per_layer: dict[int, int], context: int) -> int:
    """KV bytes one sequence's decode step reads at this context: a sliding-window layer only its
    window (PLaMo 2's `attention_window`, PLaMo 3's `window_keys`: keys besides the query's own)."""
    cfg = rt.config

    def keys(layer: int) -> int:
        w = cfg.attention_window(layer) if hasattr(cfg, "attention_window") else cfg.window_keys(layer, "hf")
        return context if w is None else min(context, w + 1)

    return sum(b * keys(i) for i, b in kv_per_layer.items())


def floor_tokens_per_s(bytes_: dict[str, Any], bandwidth: float, batch: int, kv_seq: int) -> float:
    step_bytes = bytes_["weights"] + batch * (bytes_["state_per_seq"] + kv_seq)
    return batch * bandwidth / step_bytes


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def decode_tokens_per_s(rt: Any, batch: int, context: int, steps: int) -> dict[str, float]:
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
    if per_step <= 0:  # noise larger than the steps (a loaded CPU, too few --steps): no number, not a wrong one
        return {"tokens_per_s": None, "step_ms": None, "first_call_s": t_warm, "noise": True}
    return {"tokens_per_s": batch / per_step, "step_ms": 1000 * per_step, "first_call_s": t_warm}


def timed_prefill(rt: Any, prompts: list[list[int]], repeats: int = 3) -> dict[str, float]:
    """Median device time of the prefill forwards of one generate(prompts, 1) call (after a warm-up
    call of the same shape), and how many forwards it took."""
    from plamo2_tools.runtime.batching.generation import PhaseTimer

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
    return {
        "tokens": tokens,
        "sequences": len(prompts),
        "seconds": median,
        "tokens_per_s": tokens / median,
        "forwards": forwards,
    }


def prefill_records(rt: Any, size: int, packed: int, backend: str) -> list[dict[str, Any]]:
    V = rt.config.vocab_size
    single = timed_prefill(rt, random_prompts(V, [size], size))
    L = max(1, min(packed, size // 4))  # at least 4 prompts in the forward
    n = size // L
    many = timed_prefill(rt, random_prompts(V, [L] * n, size + 1))
    print(
        f"{backend:7s} prefill T={size:6d}: one sequence {single['tokens_per_s']:10.0f} tok/s, "
        f"{n} x {L} packed {many['tokens_per_s']:10.0f} tok/s ({many['forwards']} forward(s))",
        flush=True,
    )
    return [
        {
            "backend": backend,
            "mode": "eager",
            "phase": "prefill",
            "tokens": size,
            "tokens_per_s": single["tokens_per_s"],
            "seconds": single["seconds"],
        },
        {
            "backend": backend,
            "mode": "eager",
            "phase": "prefill-packed",
            **many,
            "prompt_tokens": L,
            "vs_single": many["tokens_per_s"] / single["tokens_per_s"],
        },
    ]


def gsm8k_shaped(vocab: int, n: int, mean: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    spread = 3 * mean // 10  # GSM8K's 5-shot prompts: about +-30% around the mean
    lengths = (mean + torch.randint(-spread, spread + 1, (n,), generator=g)).clamp_min(1).tolist()
    answers = torch.randint(64, 257, (n,), generator=g).tolist()
    return random_prompts(vocab, lengths, seed + 1), answers


def schedule_record(rt: Any, n: int, batch: int | str, mean: int, backend: str, mode: str) -> dict[str, Any]:
    """A GSM8K-shaped run through one generate call, split into phases (see the module doc)."""
    from plamo2_tools.runtime.batching.generation import LoopStats, PhaseTimer

    eng = rt.engines[0]
    prompts, answers = gsm8k_shaped(rt.config.vocab_size, n, mean)
    capacity = max(len(p) + a for p, a in zip(prompts, answers, strict=True))
    slots = rt.auto_batch_size(capacity).slots if batch == "auto" else int(batch)
    slots = min(slots, n)
    # Warm-up outside the clock: the pool and its graphs for this call, and prefill forwards of the
    # sizes the run will make (kernel compilation, the SSD kernels' per-shape pick).
    rt.prepare_decode(slots, capacity)
    rt.generate(prompts[: min(n, 2 * slots)], 4, max_batch=slots)
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
    first = [f for f in forwards if not f[2]]
    refill = [f for f in forwards if f[2]]
    generated = sum(map(len, gen.tokens))
    record = {
        "backend": backend,
        "mode": mode,
        "phase": "schedule",
        "batch": gen.slots,
        "requests": n,
        "tokens_per_s": generated / wall,
        "wall_seconds": wall,
        "prompt_tokens": sum(map(len, prompts)),
        "generated_tokens": generated,
        "prefill_device_seconds": device["prefill"],
        "decode_device_seconds": device["decode"],
        "host_other_seconds": wall - device["prefill"] - device["decode"],
        "prefill_tokens_per_s": rate(forwards),
        "prefill_tokens_per_s_first_fill": rate(first),
        "prefill_tokens_per_s_refill": rate(refill),
        "refill_forwards": len(refill),
        "decode_steps_per_s": stats.decode_steps / device["decode"] if device["decode"] else None,
        "loop": stats.summary(),
        "auto_batch": rt.batch_plan.to_dict() if batch == "auto" and rt.batch_plan else None,
    }
    rates = [record[k] or 0 for k in ("prefill_tokens_per_s", "prefill_tokens_per_s_refill")]
    print(
        f"{backend:7s} schedule: {n} requests in {wall:.1f} s ({gen.slots} slots): prefill {device['prefill']:.2f} s "
        f"at {rates[0]:,.0f} tok/s (refills {rates[1]:,.0f}), decode {device['decode']:.2f} s, {stats.summary()}",
        flush=True,
    )
    return record


def profile_decode(rt: Any, batch: int, context: int, steps: int = 8) -> dict[str, Any]:
    """The kernels of one eager decode step at this batch, per step, summed by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng = rt.engines[0]
    prompts = random_prompts(rt.config.vocab_size, [context] * batch, batch)
    rt.generate(prompts, 4, max_batch=batch)  # warm-up: kernels compiled, runner sized
    runner = eng.decode_runner
    for _ in range(2):
        runner.step(batch, (0.0, 1.0))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(batch, (0.0, 1.0))
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time)
    rows = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in kernels.items()), reverse=True)
    print(f"profile B={batch}: {sum(r[0] for r in rows):.0f} us of kernels per step", flush=True)
    return {
        "step_gpu_us": sum(r[0] for r in rows),
        "launches_per_step": sum(r[1] for r in rows),
        "top_kernels": [{"name": k[:120], "us_per_step": us, "calls_per_step": n} for us, n, k in rows[:12]],
    }


def profile_prefill(rt: Any, tokens: int, packed: int, top: int = 25) -> list[dict[str, Any]]:
    """One prompt of `tokens` tokens against the same tokens as packed prompts: wall and kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = []
    V = rt.config.vocab_size
    for label, prompts in (
        ("one", random_prompts(V, [tokens], 1)),
        ("packed", random_prompts(V, [packed] * max(1, tokens // packed), 2)),
    ):
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
        total = sum(v[0] for v in kernels.values()) or 1.0
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        n = sum(map(len, prompts))
        out.append(
            {
                "phase": "prefill-profile",
                "label": label,
                "prompts": len(prompts),
                "tokens": n,
                "wall_s": wall,
                "tokens_per_s": n / wall,
                "kernel_ms": total / 1000,
                "top_kernels": [
                    {"name": k[:160], "ms": v[0] / 1000, "calls": v[1], "share": v[0] / total} for k, v in ranked
                ],
            }
        )
        print(f"profile prefill {label}: {n / wall:,.0f} tok/s", flush=True)
    return out


def run(args: argparse.Namespace, result: Result) -> None:
    import torch

    from plamo2_tools import Runtime

    cuda = args.device.startswith("cuda")
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        res = result.results
        res.update(shards=str(shards), context=args.context, decode_steps=args.steps, runs=[])
        bandwidth = copy_bandwidth() if cuda else None
        if bandwidth is not None:
            res["copy_bandwidth_GBps"] = bandwidth / 1e9
            print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
        batch: int | str = args.batch if args.batch == "auto" else int(args.batch)
        for i, mode in enumerate(args.modes.split(",")):
            backend, graphs = MODES[mode]
            if result.left() < 30:
                result.skip(f"mode {mode}")
                continue
            with Runtime(shards, device=args.device, backend=backend, mode="local", cuda_graph=graphs) as rt:
                _measure(rt, args, result, mode, first=i == 0, bandwidth=bandwidth, batch=batch)
            if cuda:
                torch.cuda.empty_cache()
        if cuda and (args.profile_decode or args.profile_prefill):
            if result.left() < 30:
                result.skip("profiles")
                return
            # Eager Triton: the profiler sees each launch (a graph replays the same kernels).
            with Runtime(shards, device=args.device, backend="triton", mode="local", cuda_graph=False) as rt:
                if args.profile_decode:
                    batches = {str(B): profile_decode(rt, B, args.context) for B in ints(args.profile_decode)}
                    res["profile_decode"] = {
                        "how": "kernels of the eager Triton decode step (a graph replays the "
                        "same kernels), per step, summed by kernel name",
                        "batches": batches,
                    }
                    result.save()
                if args.profile_prefill:
                    res["runs"] += profile_prefill(rt, args.profile_prefill, args.packed)
                    result.save()


def _measure(
    rt: Any, args: argparse.Namespace, result: Result, mode: str, first: bool, bandwidth: float | None, batch: int | str
) -> None:
    """Every measurement of one mode (one Runtime), each skipped once --max-seconds is near."""
    backend, graphs = MODES[mode]
    res = result.results
    if "bytes" not in res:
        res["bytes"] = model_bytes(rt)
    if bandwidth is not None and "floor" not in res:
        b = res["bytes"]
        res["floor"] = {
            "weight_read_ms": 1000 * b["weights"] / bandwidth,
            "weight_read_tokens_per_s_batch1": bandwidth / b["weights"],
        }
    ctx = args.context + args.steps // 2  # mean visible context over the timed steps
    for B in ints(args.decode):
        if result.left() < 10:
            result.skip(f"{mode} decode batch {B}")
            continue
        r = decode_tokens_per_s(rt, B, args.context, args.steps)
        rec = {"backend": backend, "mode": "graphs" if graphs else "eager", "phase": "decode", "batch": B, **r}
        floor_text = ""
        if r["tokens_per_s"] is None:
            print(f"{mode:14s} decode B={B:4d}: lost in noise (t(N+1) <= t(1)); more --steps", flush=True)
            res["runs"].append(rec)
            continue
        if bandwidth is not None:
            kv_seq = visible_kv_bytes(rt, res["bytes"]["kv_per_layer"], ctx)
            floor = floor_tokens_per_s(res["bytes"], bandwidth, B, kv_seq)
            rec.update(floor_tokens_per_s=floor, fraction_of_floor=r["tokens_per_s"] / floor)
            floor_text = f"  floor {floor:10.0f} ({rec['fraction_of_floor']:.0%})"
        res["runs"].append(rec)
        print(
            f"{mode:14s} decode B={B:4d}: {r['tokens_per_s']:10.0f} tok/s  {r['step_ms']:7.3f} ms/step{floor_text}",
            flush=True,
        )
        result.save()
    if graphs or backend == "torch":  # prefill never uses graphs: once per backend
        for T in ints(args.prefill):
            if result.left() < 10:
                result.skip(f"{backend} prefill T={T}")
                continue
            res["runs"] += prefill_records(rt, T, args.packed, backend)
            result.save()
    if args.schedule and first:  # the first (fastest) mode only
        if result.left() < 20:
            result.skip("schedule")
        else:
            how = "graphs" if graphs else "eager"
            res["runs"].append(schedule_record(rt, args.schedule, batch, args.prompt_tokens, backend, how))
            result.save()
