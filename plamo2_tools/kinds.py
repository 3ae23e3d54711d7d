"""What each result file of ours is: the `"kind"` and `"schema_version"` every JSON result carries.

`plamo2-tools report` recognises a file by these two fields alone (report/inputs.py), so they live
here, in a leaf that imports nothing: the report, and anything else that only needs to know what a
file is, reads them without loading the code that writes them (the runtime, PyTorch).  Producers
import their pair from here and write both fields.

Adding a kind: one line below, and one `Schema` entry in report/inputs.py:SCHEMAS (the section that
renders it, the versions it reads, the fields it needs).  Bump a version when a field changes
meaning or goes away (adding one is compatible); the report keeps reading the older versions.
"""

from __future__ import annotations

# ---- the commands' own output (`--json`, `--output`) -----------------------------------------------
CONVERT_KIND, CONVERT_SCHEMA_VERSION = "plamo2-convert", 1  # convert --json: convert/engine.py
CHECK_KIND, CHECK_SCHEMA_VERSION = "plamo2-check", 1  # check --json: shards/check.py
SOURCE_CHECK_KIND, SOURCE_CHECK_SCHEMA_VERSION = "plamo2-check-source", 1  # check --source: shards/source_check.py
CHECK_EXPORT_KIND, CHECK_EXPORT_SCHEMA_VERSION = "plamo2-check-export", 1  # check EXPORT --source: export/check.py
GGUF_CHECK_KIND, GGUF_CHECK_SCHEMA_VERSION = "plamo2-check-gguf", 1  # check OUT.gguf --source: export/gguf_check.py
INSPECT_KIND, INSPECT_SCHEMA_VERSION = "plamo2-inspect", 1  # inspect --json: inspect.py
VERIFY_KIND, VERIFY_SCHEMA_VERSION = "plamo2-verify", 1  # demo's per-layout verify: verify.py
VERIFY_TARGETS_KIND, VERIFY_TARGETS_SCHEMA_VERSION = "plamo2-verify-targets", 1  # verify TARGET: deploy/verify.py
EVAL_KIND, EVAL_SCHEMA_VERSION = "plamo2-eval", 1  # eval's results.json: eval/harness.py
# The exports' records: 3 since their `verification` is `verify`'s own result (2 is BENCH_SCHEMA_VERSION, the
# benchmark envelope every kind may carry, so an export record skips it).
EXPORT_MLX_KIND, EXPORT_MLX_SCHEMA_VERSION = "plamo2-export-mlx", 3  # OUT/plamo2_export.json: export/mlx.py
EXPORT_FP8_KIND, EXPORT_FP8_SCHEMA_VERSION = "plamo2-export", 3  # OUT/plamo2_export.json: export/fp8.py
EXPORT_GGUF_KIND, EXPORT_GGUF_SCHEMA_VERSION = "plamo2-gguf-export", 1  # OUT.gguf.plamo2-export.json: export/gguf.py

# ---- the benchmark suite (`python -m bench NAME`, docs/benchmarks.md) --------------------------------
# Every benchmark writes one envelope (bench/common.py: benchmark, machine, commit, command,
# started_at, finished_at, complete, args, results), so they all share its version.  Version 1 is the
# files of the per-script benchmarks before the suite, which reports/ keeps and the report still reads.
BENCH_SCHEMA_VERSION = 2
BENCH_THROUGHPUT_KIND = "plamo2-bench-throughput"  # bench/throughput.py: runtime decode, prefill, schedule
BENCH_SERVING_KIND = "plamo2-bench-serving"  # bench/serving.py: `serve` under N streaming clients
BENCH_CONVERT_KIND = "plamo2-bench-convert"  # bench/convert.py (version 1: the same script before the suite)
BENCH_KERNELS_KIND = "plamo2-bench-kernels"  # bench/kernels.py (version 1: kernels.json and kernels.jsonl)
BENCH_ACCURACY_KIND = "plamo2-bench-accuracy"  # bench/accuracy.py: the offline GSM8K run, phase by phase
BENCH_E2E_KIND = "plamo2-bench-e2e"  # bench/e2e.py: the README's commands from the shell, fresh and warm
BENCH_TUNE_KIND = "plamo2-bench-tune"  # bench/tune.py: a card's tuned-kernel table, made on the card

# Version 1 only: written by bench/runtime.py + bench/gsm8k.py and bench/serve.py before the suite
# (now bench/throughput.py + bench/accuracy.py and bench/serving.py).
BENCH_RUNTIME_KIND = "plamo2-bench-runtime"
BENCH_SERVE_KIND = "plamo2-bench-serve"

# ---- checks kept as their own scripts under bench/ (each its own fields) ------------------------------
# Standalone scripts (vllm_compat.py and plamo3_vllm_forward.py even run in vLLM's venv, where this
# package is not importable) spell their pair out; tests/report/test_report_kinds.py keeps every one
# equal to these.  fuzz.py, which puts the repository on its path anyway, imports its pair.
VLLM_COMPAT_KIND, VLLM_COMPAT_SCHEMA_VERSION = "plamo2-vllm-compat", 1  # bench/vllm_compat.py
VLLM_FORWARD_KIND, VLLM_FORWARD_SCHEMA_VERSION = "plamo3-vllm-forward", 1  # bench/plamo3_vllm_forward.py
BENCH_TOKENIZER_KIND, BENCH_TOKENIZER_SCHEMA_VERSION = "plamo2-bench-tokenizer", 1  # bench/tokenizer.py
KILL_RESUME_KIND, KILL_RESUME_SCHEMA_VERSION = "plamo2-bench-kill-resume", 1  # bench/kill_resume.py
BENCH_FUZZ_KIND, BENCH_FUZZ_SCHEMA_VERSION = "plamo2-bench-fuzz", 1  # bench/fuzz.py
MUTANTS_KIND, MUTANTS_SCHEMA_VERSION = "plamo2-mutants", 1  # bench/mutants.py
# Start-up and one-time costs (issue 33), measured on any machine, the CPU included:
BENCH_STARTUP_KIND, BENCH_STARTUP_SCHEMA_VERSION = "plamo2-bench-startup", 1  # bench/startup.py: --help, refusals
BENCH_LOAD_KIND, BENCH_LOAD_SCHEMA_VERSION = "plamo2-bench-load", 1  # bench/load.py: weight loading
BENCH_LM_EVAL_PARTS_KIND, BENCH_LM_EVAL_PARTS_SCHEMA_VERSION = "plamo2-bench-lm-eval-parts", 1  # lm_eval_parts.py
BENCH_EXPORT_MLX_KIND, BENCH_EXPORT_MLX_SCHEMA_VERSION = "plamo2-bench-export-mlx", 1  # bench/export_mlx.py
BENCH_EXPORT_FP8_KIND, BENCH_EXPORT_FP8_SCHEMA_VERSION = "plamo2-bench-export", 1  # bench/export_fp8.py
BENCH_EXPORT_GGUF_KIND, BENCH_EXPORT_GGUF_SCHEMA_VERSION = "plamo2-bench-gguf-export", 1  # bench/gguf_export.py
