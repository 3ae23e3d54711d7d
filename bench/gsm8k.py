"""Wall time of a full offline GSM8K run (lm-eval's gsm8k v3, 5-shot, every test document) on the
runtime, split into warm-up, prefill and decode.

    python bench/gsm8k.py SHARDS --gsm8k-dir DIR --out gsm8k.json [--batch-size 256] [--limit N]

Clock: from loading the shards to lm-eval's scored results (task set-up, few-shot prompts,
tokenisation, generation, filters and metrics all inside).  Warm-up = loading the shards plus one
short generate call that captures the decode graphs of every batch bucket and compiles the decode
kernels.  Prefill and decode are device time (CUDA events around every prefill forward and every
decode burst); `other` is the rest of the wall time (lm-eval, tokenisation, host work the GPU did
not hide).  Writes `kind: plamo2-bench-runtime` with one `phase: gsm8k` record, so that
`plamo2-tools report` shows it beside the decode benchmark.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KIND = "plamo2-bench-runtime"  # the report renders it beside bench/runtime.py's decode numbers
SCHEMA_VERSION = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", type=Path)
    ap.add_argument("--gsm8k-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=8192, help="tokens per decode slot (prompt + answer)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-fewshot", type=int, default=None, help="default: the task's 5")
    ap.add_argument("--static-batches", action="store_true", help="lm-eval's fixed batches, no refill")
    ap.add_argument("--samples", type=Path, default=None, help="also write the per-document responses here")
    args = ap.parse_args()
    print(json.dumps(run(args), indent=2))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
    from plamo2_tools.eval.harness import EvalRequest, evaluate_model
    from plamo2_tools.eval.plamo2_lm import Plamo2LM
    from plamo2_tools.runtime.serving.engine import Runtime
    from plamo2_tools.runtime.serving.generation import PhaseTimer

    data = load_gsm8k_data(args.gsm8k_dir, allow_unverified=True)
    B = args.batch_size
    t0 = time.perf_counter()
    rt = Runtime(args.shards, device=args.device, mode="local", cuda_graph=not args.no_cuda_graph)
    t_load = time.perf_counter() - t0
    # Warm-up: a slot pool big enough for every GSM8K prompt (byte tokens: ~3-4.5k) + answer, its
    # decode graphs for every bucket up to B, decode and prefill kernels compiled.
    rt.engines[0]._runner(B, args.capacity)
    rt.generate([[1, 2, 3] * 1000] * min(B, 10) + [[1, 2, 3]] * max(0, B - 10), 3, max_batch=B)
    _sync()
    t_warm = time.perf_counter() - t0
    timer = PhaseTimer()
    rt.engines[0].timer = timer
    lm = Plamo2LM(runtime=rt, pretrained=str(args.shards), batch_size=B,
                  continuous_batching=not args.static_batches)  # fmt: skip
    request = EvalRequest(shards=str(args.shards), data=data.to_dict(), batch_size=B, device=args.device,
                          limit=args.limit, num_fewshot=args.num_fewshot, bootstrap_iters=0)  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        outcome = evaluate_model(lm, request, cache)
    _sync()
    wall = time.perf_counter() - t0
    assert outcome is not None
    device = timer.seconds()
    samples = outcome.samples.get("gsm8k", [])
    docs = len({s["doc_id"] for s in samples})
    generated = timer.counts["decode_steps"]
    tokens = timer.counts["generated_tokens"]
    metrics = outcome.results["results"]["gsm8k"]
    split = {
        "load": t_load,
        "warm_up": t_warm,
        "prefill_device": device["prefill"],
        "decode_device": device["decode"],
        "other": wall - t_warm - device["prefill"] - device["decode"],
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
        "continuous_batching": not args.static_batches,
        "split_seconds": split,
        "prefill_tokens": timer.counts["prefill_tokens"],
        "decode_steps": generated,
        "generated_tokens": tokens,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "gsm8k_data_verified": data.verified,
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
