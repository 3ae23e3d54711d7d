"""Where lm-eval's own time goes in a GSM8K run (not a test): everything but the model, on the CPU,
with the real GSM8K files (issue 33: 13 s of the warm H200 run, `reports/e2e/session4/callC`).

    python bench/lm_eval_parts.py --gsm8k-dir /path/to/gsm8k --out reports/startup/NAME.json
        [--tokenizer-preset plamo-2-1b] [--limit N] [--num-fewshot 5] [--no-fix]

The run is `plamo2-tools eval`'s own (`eval.harness.evaluate_model` with our lm-eval model
`Plamo2LM`, lm-eval's gsm8k task v3, log_samples and an output directory), except the model: a
stand-in runtime answers every request at once with `max_gen_toks` random tokens, as the random
synthetic weights of the GPU runs do (they never stop early: 1,319 x 256 tokens there), and runs our
stop-string watcher over them at the real loop's cadence (every `sync_every` tokens, through the
scheduler's own `first_stop`).  The tokenizer is synth's for `--tokenizer-preset` (the one those
GPU runs had).  Each part is timed by wrapping the function that does it:

  imports           lm_eval and what it pulls (after torch, as in `eval`)
  task_load         TaskManager.load: the task config, the dataset read into its Arrow cache
  build_requests    Task.build_all_requests: few-shot sampling, Jinja templates, Instances
  glue_tokenize     Plamo2LM.tok_encode_many: the prompts through our tokenizer
  glue_watch        the stop-string watcher over the generated tokens (ours)
  glue_finish       finish_text: decoding and cutting each answer (ours)
  glue_other        the rest of Plamo2LM.generate_until (collator, bookkeeping)
  filters           Task.apply_filters (the two regex filters)
  process_results   Task.process_results for every document (exact_match)
  write_outputs     EvaluationTracker's results and samples files, our results.json
  other             the rest of simple_evaluate (aggregation, stderr, sample logging, table)

and a cProfile of the whole run keeps the 40 costliest functions by own time.  `--without NAME`
(repeatable) runs without one of our workarounds of lm-eval's costs, for the comparison:
`compiled_templates`, `env_info_ahead` (harness.LM_EVAL_WORKAROUNDS) and `eval_cache` (the
persistent Arrow cache of the data, harness.eval_cache_root; without it a temporary one, as before)
and `decode_kept` (ours: the stop-string watcher's decode without transformers' wrapper).
Run twice with the cache: the first run builds it, the second reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import platform
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

KIND = "plamo2-bench-lm-eval-parts"
SCHEMA_VERSION = 1
WORKAROUNDS = ("compiled_templates", "env_info_ahead", "eval_cache", "decode_kept")


class Timers:
    """Wall and CPU seconds (this thread's: the parts run on the main thread) per part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active: set[str] = set()

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if part in self.active:  # nested (recursive) calls count once
                return original(*args, **kwargs)
            self.active.add(part)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.cpu[part] += time.thread_time() - c0
                self.calls[part] += 1
                self.active.discard(part)

        setattr(owner, name, timed)


class StandInRuntime:
    """What `Plamo2LM` needs of a `Runtime`, with generation replaced by random tokens (module doc)."""

    def __init__(self, path: Path, sync_every: int, seed: int = 0) -> None:
        from plamo2_tools.model import load_config
        from plamo2_tools.parallel import Mapping

        self.path, self.sync_every = path, sync_every
        self.config = load_config(path)
        self.manifest = type("M", (), {"mapping": Mapping.even(self.config.num_hidden_layers, 1, 1)})()
        self.is_main, self.mode, self.kernels, self.engines, self.rank = True, "local", "stand-in", [], 0
        self.forward_options: dict[str, Any] = {}
        self.batch_plan = None
        self.rng = random.Random(seed)
        self.watch_seconds = self.watch_cpu = 0.0

    @property
    def dtype(self) -> Any:
        import torch

        return torch.bfloat16

    def auto_batch_size(self, capacity: int, memory_budget: int | None = None) -> Any:
        return type("Plan", (), {"slots": 1024, "to_dict": lambda self: {"slots": 1024}})()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: Any,
        eos_token_ids: Any = (),
        stop: Any = None,
        on_finish: Any = None,
        **kwargs: Any,
    ) -> Any:
        from plamo2_tools.runtime.batching.engine import Generation
        from plamo2_tools.runtime.batching.scheduler import first_stop

        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        vocab = int(self.config.vocab_size)
        out, reasons = [], []
        for i, limit in enumerate(limits):
            tokens = [self.rng.randrange(3, min(vocab, 100_000)) for _ in range(limit)]
            t0, c0 = time.perf_counter(), time.thread_time()
            hit, checked = None, 0
            for end in range(self.sync_every, limit + self.sync_every, self.sync_every):
                end = min(end, limit)
                if stop is not None:
                    hit = first_stop(stop, i, tokens[:end], checked)
                checked = end
                if hit is not None:
                    break
            self.watch_seconds += time.perf_counter() - t0
            self.watch_cpu += time.thread_time() - c0
            out.append(tokens[:hit] if hit is not None else tokens)
            reasons.append("stop" if hit is not None else "length")
            if on_finish is not None:
                on_finish(i)
        return Generation(out, None, reasons, min(len(prompts), 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k-dir", type=Path, default=os.environ.get("PLAMO2_GSM8K_DIR"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-preset", default="plamo-2-1b")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--num-fewshot", type=int, default=5)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--without", action="append", default=[], choices=WORKAROUNDS, help="leave one workaround out")
    args = ap.parse_args()
    if args.gsm8k_dir is None:
        raise SystemExit("--gsm8k-dir (or PLAMO2_GSM8K_DIR) is required")
    import torch  # noqa: F401 - imported before lm_eval, as in `plamo2-tools eval`

    timers = Timers()
    t0, c0 = time.perf_counter(), time.thread_time()
    import lm_eval  # noqa: F401
    import lm_eval.models  # noqa: F401

    from plamo2_tools.eval import harness, plamo2_lm, stop_rules

    timers.seconds["imports"] = time.perf_counter() - t0
    timers.cpu["imports"] = time.thread_time() - c0
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
    from plamo2_tools.model import family_of
    from plamo2_tools.model.synth import preset_config, write_tokenizer

    harness.LM_EVAL_WORKAROUNDS = tuple(
        w for w in harness.LM_EVAL_WORKAROUNDS if w.__name__.lstrip("_") not in args.without
    )
    if "decode_kept" in args.without:  # the watcher's decode through transformers' wrapper, as before
        from plamo2_tools.tokenizer.hf import PlamoTokenizerNative

        PlamoTokenizerNative.decode_kept = None  # type: ignore[assignment,method-assign]
    timers.wrap(TaskManager, "load", "task_load")
    timers.wrap(ConfigurableTask, "build_all_requests", "build_requests")
    timers.wrap(plamo2_lm.Plamo2LM, "tok_encode_many", "glue_tokenize")
    timers.wrap(plamo2_lm.Plamo2LM, "generate_until", "generate_until")
    timers.wrap(plamo2_lm, "finish_text", "glue_finish")
    timers.wrap(ConfigurableTask, "apply_filters", "filters")
    timers.wrap(ConfigurableTask, "process_results", "process_results")
    for name in ("save_results_aggregated", "save_results_samples"):
        timers.wrap(EvaluationTracker, name, "write_outputs")
    timers.wrap(harness, "write_stable_results", "write_outputs")
    del stop_rules
    data = load_gsm8k_data(args.gsm8k_dir, allow_unverified=True)
    with tempfile.TemporaryDirectory(prefix="plamo2-bench-lm-eval-") as tmp:
        model_dir = Path(tmp) / "model"
        cfg = preset_config(args.tokenizer_preset)  # synth's config, generation config and tokenizer, no weights
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
        (model_dir / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
        )
        write_tokenizer(model_dir, cfg.vocab_size, flavour=family_of(cfg).tokenizer_flavour)
        runtime = StandInRuntime(model_dir, args.sync_every)
        lm = plamo2_lm.Plamo2LM(
            runtime=runtime, pretrained=str(model_dir), batch_size=1024, max_gen_toks=args.max_gen_toks
        )
        request = harness.EvalRequest(
            shards=str(model_dir),
            data=data.to_dict(),
            batch_size=1024,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            max_gen_toks=args.max_gen_toks,
            output_path=str(Path(tmp) / "out"),
            log_samples=True,
        )
        profile = cProfile.Profile()
        t1, c1 = time.perf_counter(), time.thread_time()
        profile.enable()
        with contextlib.ExitStack() as stack:
            cache = Path(tmp) / "hf" if "eval_cache" in args.without else stack.enter_context(harness.eval_cache_root())
            outcome = harness.evaluate_model(lm, request, Path(cache) / "rank0")
        profile.disable()
        total, total_cpu = time.perf_counter() - t1, time.thread_time() - c1
    assert outcome is not None
    parts, cpu = split(timers.seconds, total, runtime.watch_seconds), split(timers.cpu, total_cpu, runtime.watch_cpu)
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(40)
    samples = outcome.samples.get("gsm8k", [])
    result = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "commit": os.environ.get("PLAMO2_BENCH_COMMIT"),
        "workarounds": [w for w in WORKAROUNDS if w not in args.without],
        "documents": len(samples),
        "num_fewshot": args.num_fewshot,
        "max_gen_toks": args.max_gen_toks,
        "tokenizer_preset": args.tokenizer_preset,
        "gsm8k_verified": data.verified,
        "total_seconds": total,
        "total_cpu_seconds": total_cpu,
        "parts_seconds": parts,
        "parts_cpu_seconds": cpu,
        "calls": dict(timers.calls),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg": os.getloadavg(),
        },
        "profile_top_tottime": stream.getvalue().splitlines()[:80],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{k:<16} {v:7.2f} s wall {cpu[k]:7.2f} s cpu")
    print(f"{'total':<16} {total:7.2f} s wall {total_cpu:7.2f} s cpu (imports not included)")


def split(seconds: dict[str, float], total: float, watch: float) -> dict[str, float]:
    """The parts, with generate_until split into ours and the rest of it, and `other` the remainder."""
    parts = dict(seconds)
    parts["glue_watch"] = watch
    generate = parts.pop("generate_until", 0.0)
    parts["glue_other"] = generate - parts.get("glue_tokenize", 0.0) - watch - parts.get("glue_finish", 0.0)
    parts["other"] = total - sum(v for k, v in parts.items() if k != "imports")
    return parts


if __name__ == "__main__":
    main()
