#!/usr/bin/env bash
# Final GPU check of the committed kernels (one H200): the GPU kernel tests, a synthetic plamo-2-1b
# verified with Triton kernels (fp32 and bf16 shards), and runtime throughput.  Results in $OUT.
set -u
OUT=${OUT:-/tmp/final-out}; W=/tmp/final; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
P="python3 -m plamo2_tools.cli"
( timeout 120 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider -n 6 > "$OUT/pytest_gpu_final.txt" 2>&1; echo "gpu tests rc=$?" ) &
$P synth "$W/src" --preset plamo-2-1b --force > /dev/null 2>&1 && $P convert "$W/src" "$W/tp1" > /dev/null 2>&1 \
  && $P convert "$W/src" "$W/tp1-bf16" --dtype bfloat16 > /dev/null 2>&1; echo "prep rc=$?"
wait
timeout 150 $P verify "$W/tp1" "$W/tp1-bf16" --reference "$W/src" --device cuda --backend triton --reference-device cuda \
  --max-new-tokens 8 --output "$OUT/verify_1b_triton_final.json"; echo "verify rc=$?"
timeout 100 python3 bench/runtime.py "$W/tp1-bf16" --out "$OUT/bench_runtime_1b_final.json"; echo "bench rc=$?"
tail -3 "$OUT/pytest_gpu_final.txt"
