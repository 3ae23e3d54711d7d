#!/usr/bin/env bash
# Generation on one H200, in one call from the repo root: synthetic plamo-2-1b (bf16) -> GPU tests
# of CUDA-graph decode -> decode profile -> decode/prefill throughput (graphs, eager, PyTorch path,
# weight-read floor) -> full offline GSM8K wall time; optionally plamo-2-8b.  Results land in $OUT.
#
# Carry `.whl` (lm-eval 0.4.13 and the pure-Python packages it needs that the device image lacks,
# see README) with `.whl/gsm8k` holding openai/grade-school-math's train.jsonl and test.jsonl.
# Knobs: STEPS=tests,profile,bench,gsm8k,8b  GSM8K_LIMIT=N  BATCH=256  DECODE=1,8,64,256
set -u
OUT=${OUT:-/tmp/gen-out}; W=${WORK:-/tmp/gen}; mkdir -p "$W" "$OUT"
STEPS=${STEPS:-tests,profile,bench,gsm8k}
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
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
step synth-1b 120 $P synth "$W/src-1b" --preset plamo-2-1b --dtype bfloat16 --force --json
step convert-1b 120 $P convert "$W/src-1b" "$W/1b" --force --json
if has tests; then
  PLAMO2_GPU_TEST_SHARDS=$W/1b step pytest-gpu-1b 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/runtime/test_graphs_gpu.py
  TAIL=3 step pytest-gpu-kernels 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -x -n 4 tests/kernels
fi
has profile && TAIL=60 step profile-1b 150 python3 bench/profile_decode.py "$W/1b" --out "$OUT/profile_1b.json"
has bench && TAIL=40 step bench-1b 420 python3 bench/runtime.py "$W/1b" --label plamo-2-1b \
  --decode "${DECODE:-1,8,64,256}" --modes "${MODES:-triton-graphs,triton-eager,torch-eager}" \
  --profile "$OUT/profile_1b.json" --out "$OUT/bench_runtime_1b.json"
if has gsm8k; then
  step gsm8k-1b 400 python3 bench/gsm8k.py "$W/1b" --gsm8k-dir .whl/gsm8k --batch-size "${BATCH:-256}" \
    ${GSM8K_LIMIT:+--limit $GSM8K_LIMIT} --out "$OUT/gsm8k_h200.json" --samples "$OUT/gsm8k_samples.jsonl"
fi
if has 8b; then
  step synth-8b 200 $P synth "$W/src-8b" --preset plamo-2-8b --force --json
  step convert-8b 200 $P convert "$W/src-8b" "$W/8b" --force --json
  TAIL=20 step bench-8b 300 python3 bench/runtime.py "$W/8b" --label plamo-2-8b --decode "${DECODE:-1,8,64,256}" \
    --modes "${MODES_8B:-triton-graphs,triton-eager}" --prefill 8192 --out "$OUT/bench_runtime_8b.json"
fi
