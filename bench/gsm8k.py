"""Wall time of a full offline GSM8K run (lm-eval's gsm8k v3, 5-shot, every test document) on the
runtime, through the public API (`Runtime`, `Plamo2LM`, the harness), split into its phases.

    python bench/gsm8k.py SHARDS (--gsm8k-dir DIR | --synthetic-data N) --out gsm8k.json
        [--batch-size auto] [--limit N] [--device cuda] [--samples rows.jsonl]

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

`--batch-size auto` (default) takes the runtime's memory plan for slots of `--capacity` tokens;
the plan is in the output.  `--synthetic-data N` writes GSM8K-shaped files (the real schema,
questions and worked answers of GSM8K's lengths, made-up words) with N test problems, for machines
without the data (the model is synthetic anyway; the timing needs only the shapes).  Writes
`kind: plamo2-bench-runtime` with one `phase: gsm8k` record, so that `plamo2-tools report` shows it
beside the decode benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KIND = "plamo2-bench-runtime"  # the report renders it beside bench/runtime.py's decode numbers
SCHEMA_VERSION = 1
WORDS = ("apples", "boxes", "each", "costs", "dollars", "more", "than", "twice", "many", "how", "she", "buys",
         "sells", "week", "pages", "reads", "left", "total", "per", "hour", "friends", "shares", "equally",
         "tickets", "garden", "rows", "plants", "minutes", "saves", "spends")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--gsm8k-dir", type=Path)
    data.add_argument("--synthetic-data", type=int, metavar="N", help="GSM8K-shaped files with N test problems")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-size", default="auto", help="decode slots: a number or auto")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=4096, help="tokens per decode slot (prompt + answer)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--num-fewshot", type=int, default=None, help="default: the task's 5")
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--static-batches", action="store_true", help="lm-eval's fixed batches, no refill")
    ap.add_argument("--samples", type=Path, default=None, help="also write the per-document responses here")
    args = ap.parse_args()
    print(json.dumps(run(args), indent=2))


def _sync() -> None:
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
        steps = [f"{sentence(rng.randint(6, 14))} = <<{a}*{b}={a * b}>>{a * b}."
                 for a, b in ((rng.randint(2, 20), rng.randint(2, 20)) for _ in range(rng.randint(2, 5)))]  # fmt: skip
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
    from plamo2_tools.eval.harness import EvalRequest, evaluate_model
    from plamo2_tools.eval.plamo2_lm import Plamo2LM
    from plamo2_tools.runtime.serving.engine import Runtime
    from plamo2_tools.runtime.serving.generation import LoopStats, PhaseTimer

    with tempfile.TemporaryDirectory(prefix="plamo2-bench-gsm8k-") as tmp:
        folder = args.gsm8k_dir or synthetic_gsm8k(Path(tmp) / "data", args.synthetic_data)
        data = load_gsm8k_data(folder, allow_unverified=True)
        t0 = time.perf_counter()
        rt = Runtime(args.shards, device=args.device, backend=args.backend, mode="local",
                     cuda_graph=not args.no_cuda_graph)  # fmt: skip
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
        lm = Plamo2LM(runtime=timed, pretrained=str(args.shards), batch_size=B, max_gen_toks=args.max_gen_toks,
                      continuous_batching=not args.static_batches)  # fmt: skip
        request = EvalRequest(shards=str(args.shards), data=data.to_dict(), batch_size=B, device=args.device,
                              limit=args.limit, num_fewshot=args.num_fewshot, bootstrap_iters=0,
                              max_gen_toks=args.max_gen_toks)  # fmt: skip
        t1 = time.perf_counter()
        outcome = evaluate_model(lm, request, Path(tmp) / "hf")
        _sync()
        t_eval = time.perf_counter() - t1
        wall = time.perf_counter() - t0
    assert outcome is not None
    eng.timer = None
    device = timer.seconds()
    forwards = timer.forward_seconds()

    def rate(rows: list[tuple[int, int, bool, float]]) -> float | None:
        secs = sum(r[3] for r in rows)
        return sum(r[0] for r in rows) / secs if secs else None

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
    record = {"backend": rt.kernels, "mode": "eager" if args.no_cuda_graph else "graphs", "phase": "gsm8k",
              "batch": B, "documents": docs, "tokens_per_s": tokens / wall, "wall_seconds": wall}  # fmt: skip
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "label": "gsm8k",
        "shards": str(args.shards),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
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
        "runs": [record],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.samples:
        rows = [{"doc_id": s["doc_id"], "filter": s["filter"], "resps": s["resps"]} for s in samples]
        args.samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rt.close()
    return result


if __name__ == "__main__":
    main()
