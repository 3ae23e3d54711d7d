#!/usr/bin/env bash
# The serving loop at hardware speed, one H200, one call from the repo root (~8 minutes): synthetic
# plamo-2-1b (bf16) -> the GPU tests of CUDA-graph decode (per-slot sampling modes, the online loop)
# -> bench/runtime.py (decode tokens/s at batch 1/8/64/256, prefill of one sequence vs packed, a
# GSM8K-shaped continuous-batching run split into phases) -> bench/gsm8k.py (the full lm-eval
# GSM8K run, 1,319 documents, split into load / warm-up / prefill / decode / lm-eval).  Results in $OUT.
#
# lm-eval is not in the device image: carry `.whl` (lm-eval 0.4.13 and the pure-Python packages it
# needs, as for bench/gpu_generation.sh); `.whl/gsm8k` with openai/grade-school-math's train.jsonl
# and test.jsonl makes the GSM8K run use the real data, else it writes GSM8K-shaped data itself
# (bench/gsm8k.py --synthetic-data).  Without lm-eval the GSM8K step is skipped; the GSM8K-shaped
# run of bench/runtime.py needs no lm-eval.
# Knobs: SHARDS=<existing bf16 1b shards> (skip synth/convert)  MODES=triton-graphs[,triton-eager,torch-eager]
#        DECODE=1,8,64,256  PREFILL=2048,8192,32768  SCHEDULE=1319  PROMPT_TOKENS=1336  BATCH=auto
#        GSM8K_LIMIT=N  GSM8K_DOCS=1319 (synthetic data)  STEPS=tests,bench,gsm8k  PRESET=plamo-2-1b  DEVICE=cuda
# A CPU dry run of the whole script (tiny model, small sizes; what the tests of bench/ do):
#   PRESET=tiny DEVICE=cpu MODES=torch-eager DECODE=1,4 PREFILL=64 SCHEDULE=40 PROMPT_TOKENS=40 \
#     GSM8K_LIMIT=4 GSM8K_DOCS=20 STEPS=bench,gsm8k bash bench/gpu_serving.sh
set -u
OUT=${OUT:-/tmp/serving-out}; W=${WORK:-/tmp/serving}; mkdir -p "$W" "$OUT"
STEPS=${STEPS:-tests,bench,gsm8k}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
P="python3 -m plamo2_tools.cli"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, never stop the script
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}
{
DEVICE=${DEVICE:-cuda}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2> /dev/null
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ -z "${SHARDS:-}" ]; then
  t0=$SECONDS
  $P synth "$W/src-1b" --preset "${PRESET:-plamo-2-1b}" --dtype bfloat16 --force --json > /dev/null \
    && $P convert "$W/src-1b" "$W/1b" --force --json > /dev/null
  echo "== synth + convert rc=$? in $((SECONDS - t0)) s"
  SHARDS=$W/1b
fi
if has tests; then
  TAIL=6 step pytest-gpu 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/runtime/test_graphs_gpu.py
fi
if has bench; then
  TAIL=30 step bench-1b 270 python3 bench/runtime.py "$SHARDS" --label "${PRESET:-plamo-2-1b}" --device "$DEVICE" \
    --modes "${MODES:-triton-graphs}" --decode "${DECODE:-1,8,64,256}" --prefill "${PREFILL:-2048,8192,32768}" \
    --schedule "${SCHEDULE:-1319}" --prompt-tokens "${PROMPT_TOKENS:-1336}" --batch "${BATCH:-auto}" \
    --out "$OUT/bench_runtime_1b.json"
fi
if has gsm8k; then
  if python3 -c 'import lm_eval' > /dev/null 2>&1; then
    if [ -f .whl/gsm8k/test.jsonl ]; then DATA="--gsm8k-dir .whl/gsm8k"; else DATA="--synthetic-data ${GSM8K_DOCS:-1319}"; fi
    TAIL=40 step gsm8k-1b 240 python3 bench/gsm8k.py "$SHARDS" $DATA --batch-size "${BATCH:-auto}" --device "$DEVICE" \
      ${GSM8K_LIMIT:+--limit $GSM8K_LIMIT} --out "$OUT/gsm8k_1b.json"
  else
    echo "== gsm8k skipped: lm_eval is not importable (carry .whl)"
  fi
fi
} 2>&1 | tee "$OUT/summary.log"
