#!/usr/bin/env bash
# GPU call 1 of this session (one H200, ~9 min): correctness of the new GPU code (gemv in bf16, per-slot sampling
# graphs, graphs on real shapes with Triton), where packed prefill loses time (bench/profile_prefill.py), the decode
# and prefill sweep (bench/runtime.py) and the full GSM8K run split into phases (bench/gsm8k.py), plamo-2-1b bf16.
# Carry .whl (lm-eval + pure-Python deps, .whl/gsm8k the data).  Results: $OUT/call1.tar.gz.
set -u
OUT=${OUT:-/tmp/call1}; W=/tmp/w; mkdir -p "$W" "$OUT/r"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PLAMO2_CACHE_DIR=/tmp/pc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH
P="python3 -m plamo2_tools.cli"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  [[ -z "${ONLY:-}" || ",$ONLY," == *",$name,"* ]] || return 0
  timeout "$limit" "$@" > "$OUT/r/$name.log" 2>&1; echo "== $name rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-8}" "$OUT/r/$name.log"; tar czf "$OUT/call1.tar.gz" -C "$OUT" r; }  # whatever ran comes back
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
python3 -c 'import torch, triton, lm_eval; print("torch", torch.__version__, "triton", triton.__version__)'
[ -d $W/1b ] || step synth 90 $P synth $W/src --preset plamo-2-1b --dtype bfloat16 --json
[ -d $W/1b ] || step convert 40 $P convert $W/src $W/1b --json
TAIL=15 step pytest-gemv 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kernels/test_gemv.py
TAIL=10 step pytest-graphs-tiny 50 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/runtime/test_graphs_gpu.py
PLAMO2_GPU_TEST_SHARDS=$W/1b TAIL=10 step pytest-graphs-1b 70 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/runtime/test_graphs_gpu.py
TAIL=30 step profile-prefill 60 python3 bench/profile_prefill.py $W/1b --out $OUT/r/profile_prefill_1b.json
TAIL=30 step bench-1b 110 python3 bench/runtime.py $W/1b --label plamo-2-1b --device cuda --modes triton-graphs \
  --decode 1,8,64,256 --prefill 8192,32768 --schedule 1319 --prompt-tokens 1336 --batch auto --out $OUT/r/bench_runtime_1b.json
TAIL=40 step gsm8k-1b 110 python3 bench/gsm8k.py $W/1b --gsm8k-dir .whl/gsm8k --batch-size auto --device cuda \
  --out $OUT/r/gsm8k_1b.json --samples $OUT/r/gsm8k_1b_samples.jsonl
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call1.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"
