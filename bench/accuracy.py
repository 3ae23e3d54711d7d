"""The offline GSM8K run (lm-eval's gsm8k, 5-shot): its scores and its wall time, phase by phase.

    python -m bench accuracy [--shards DIR | --preset plamo-2-1b --dtype bfloat16] [--device cuda]
        (--gsm8k-dir DIR | --synthetic-data N) [--batch-size auto] [--limit N] [--samples rows.jsonl]

lm-eval's gsm8k v3 on every test document (or --limit), through the public API (`Runtime`,
`PlamoLM`, the harness).  Scores: flexible-extract and strict-match exact match; the baseline for
them is vLLM's published run of pfnet/plamo-2-1b (0.202 / 0.520 at TP1xPP1, vLLM PR #19674), which
only real weights can meet (a synthesized model scores about 0: its runs time the pipeline).

Clock: from loading the shards to lm-eval's scored results.  Phases:
* load: `Runtime(...)`;
* warm_up: the decode slot pool and its graphs for every bucket (`Runtime.prepare_decode`), then
  one short generate call whose prefill forwards have the run's sizes (kernel compilation, the
  SSD kernels' per-shape pick);
* generate: wall time inside `Runtime.generate` (lm-eval calls it once per gen_kwargs group), of
  which prefill and decode are device time (CUDA events around every prefill forward and every
  decode burst, `PhaseTimer`) and `generate_host` the rest (the host work the device did not hide);
* lm_eval_other: everything else (task set-up, few-shot prompts, tokenisation, filters, metrics).
The effective prefill rate is prompt tokens / prefill device time, for all forwards and separately
for the first fill (no sequence decoding yet) and for refills (forwards that ran while sequences
decoded), with the loop's counters (forwards, tokens per forward, groups, padding).

The baseline for the time is inside the same run: the runtime's own device time (prefill and
decode) against everything lm-eval and the host add around it.

`--batch-size auto` (default) takes the runtime's memory plan for slots of `--capacity` tokens;
the plan is in the output.  `--synthetic-data N` writes GSM8K-shaped files (the real schema,
questions and worked answers of GSM8K's lengths, made-up words) with N test problems, for machines
without the data (the model is synthetic anyway; the timing needs only the shapes).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Result, model_inputs, work_dir
from bench.common import prefill_rate as rate
from plamo2_tools.kinds import BENCH_ACCURACY_KIND

KIND = BENCH_ACCURACY_KIND
MODEL = True
# vLLM's published run of pfnet/plamo-2-1b, 5-shot, TP1xPP1 (vLLM PR #19674; the README's table).
PUBLISHED = {"model": "pfnet/plamo-2-1b", "flexible-extract": 0.202, "strict-match": 0.520, "source": "vLLM PR #19674"}
WORDS = (
    "apples",
    "boxes",
    "each",
    "costs",
    "dollars",
    "more",
    "than",
    "twice",
    "many",
    "how",
    "she",
    "buys",
    "sells",
    "week",
    "pages",
    "reads",
    "left",
    "total",
    "per",
    "hour",
    "friends",
    "shares",
    "equally",
    "tickets",
    "garden",
    "rows",
    "plants",
    "minutes",
    "saves",
    "spends",
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--gsm8k-dir", type=Path, help="train.jsonl + test.jsonl of openai/grade-school-math")
    data.add_argument("--synthetic-data", type=int, metavar="N", help="GSM8K-shaped files with N test problems")
    ap.add_argument("--batch-size", default="auto", help="decode slots: a number or auto")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=4096, help="tokens per decode slot (prompt + answer)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--num-fewshot", type=int, default=None, help="default: the task's 5")
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--static-batches", action="store_true", help="lm-eval's fixed batches, no refill")
    ap.add_argument("--samples", type=Path, default=None, help="also write the per-document responses here")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synthetic_gsm8k(out: Path, test: int, train: int = 7473, seed: int = 0) -> Path:
    """GSM8K-shaped train/test.jsonl: questions of ~45 words, answers of ~55 words of worked steps
    ending in '#### N' (GSM8K's mean lengths), words drawn from a small vocabulary."""
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(2, 99)) for _ in range(n))

    def row() -> dict[str, str]:
        q = sentence(rng.randint(25, 70)).capitalize() + "?"
        steps = [
            f"{sentence(rng.randint(6, 14))} = <<{a}*{b}={a * b}>>{a * b}."
            for a, b in ((rng.randint(2, 20), rng.randint(2, 20)) for _ in range(rng.randint(2, 5)))
        ]
        return {"question": q, "answer": "\n".join(steps) + f"\n#### {rng.randint(1, 999)}"}

    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row()) + "\n" for _ in range(n)))
    return out


class TimedRuntime:
    """The runtime as lm-eval's model sees it, with the wall time of every generate call kept."""

    def __init__(self, runtime: Any) -> None:
        self._runtime, self.generate_seconds, self.calls = runtime, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._runtime.generate(*args, **kwargs)
        finally:
            _sync()
            self.generate_seconds += time.perf_counter() - t0
            self.calls += 1


def run(args: argparse.Namespace, result: Result) -> None:
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        result.results.update(evaluate(args, shards))


def evaluate(args: argparse.Namespace, shards: Path) -> dict[str, Any]:
    from plamo2_tools import Runtime
    from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
    from plamo2_tools.eval.harness import EvalRequest, evaluate_model
    from plamo2_tools.eval.plamo2_lm import PlamoLM
    from plamo2_tools.runtime.batching.generation import LoopStats, PhaseTimer

    with tempfile.TemporaryDirectory(prefix="plamo2-bench-gsm8k-") as tmp:
        folder = args.gsm8k_dir or synthetic_gsm8k(Path(tmp) / "data", args.synthetic_data)
        data = load_gsm8k_data(folder, allow_unverified=True)
        t0 = time.perf_counter()
        rt = Runtime(shards, device=args.device, backend=args.backend, mode="local", cuda_graph=not args.no_cuda_graph)
        t_load = time.perf_counter() - t0
        eng = rt.engines[0]
        if args.batch_size == "auto":
            plan = rt.auto_batch_size(args.capacity)
            B = plan.slots
        else:
            plan, B = None, int(args.batch_size)
        if args.limit is not None:
            B = min(B, args.limit)
        # Warm-up: the slot pool and its decode graphs for every bucket up to B, then prefill
        # forwards of the run's sizes (a few budget-sized groups of GSM8K-long prompts).
        rt.prepare_decode(B, args.capacity)
        warm = [[3 + (i % 97) for i in range(1200 + 7 * k)] for k in range(min(B, 48))]
        rt.generate(warm, 2, max_batch=B)
        _sync()
        t_warm = time.perf_counter() - t0 - t_load
        timer = PhaseTimer()
        eng.timer, eng.stats = timer, LoopStats()
        timed = TimedRuntime(rt)
        lm = PlamoLM(
            runtime=timed,
            pretrained=str(shards),
            batch_size=B,
            max_gen_toks=args.max_gen_toks,
            continuous_batching=not args.static_batches,
        )
        request = EvalRequest(
            shards=str(shards),
            data=data.to_dict(),
            batch_size=B,
            device=args.device,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            bootstrap_iters=0,
            max_gen_toks=args.max_gen_toks,
        )
        t1 = time.perf_counter()
        outcome = evaluate_model(lm, request, Path(tmp) / "hf")
        _sync()
        t_eval = time.perf_counter() - t1
        wall = time.perf_counter() - t0
    assert outcome is not None
    eng.timer = None
    device = timer.seconds()
    forwards = timer.forward_seconds()

    samples = outcome.samples.get("gsm8k", [])
    docs = len({s["doc_id"] for s in samples}) or outcome.results["n-samples"]["gsm8k"]["effective"]
    tokens = timer.counts["generated_tokens"]
    metrics = outcome.results["results"]["gsm8k"]
    split = {
        "load": t_load,
        "warm_up": t_warm,
        "generate": timed.generate_seconds,
        "prefill_device": device["prefill"],
        "decode_device": device["decode"],
        "generate_host": timed.generate_seconds - device["prefill"] - device["decode"],
        "lm_eval_other": t_eval - timed.generate_seconds,
    }
    prefill = {
        "tokens": timer.counts["prefill_tokens"],
        "tokens_per_s": rate(forwards),
        "first_fill_tokens_per_s": rate([f for f in forwards if not f[2]]),
        "refill_tokens_per_s": rate([f for f in forwards if f[2]]),
        "refill_forwards": sum(1 for f in forwards if f[2]),
        "mean_prompt_tokens": timer.counts["prefill_tokens"] / docs if docs else None,
    }
    result = {
        "shards": str(shards),
        "backend": rt.kernels,
        "mode": "eager" if args.no_cuda_graph else "graphs",
        "tokens_per_s": tokens / wall,
        "wall_seconds": wall,
        "documents": docs,
        "batch_size": B,
        "auto_batch": plan.to_dict() if plan is not None else None,
        "continuous_batching": not args.static_batches,
        "split_seconds": split,
        "prefill": prefill,
        "prefill_tokens": timer.counts["prefill_tokens"],
        "decode_steps": timer.counts["decode_steps"],
        "generated_tokens": tokens,
        "loop": eng.stats.summary(),
        "generate_calls": timed.calls,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "gsm8k_data_verified": data.verified,
        "synthetic_data": args.synthetic_data is not None,
        "published": PUBLISHED,
    }
    if args.samples:
        rows = [{"doc_id": s["doc_id"], "filter": s["filter"], "resps": s["resps"]} for s in samples]
        args.samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rt.close()
    return result
