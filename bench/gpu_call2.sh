#!/usr/bin/env bash
# GPU call 2 of this session (one H200, <= 9.5 min): the main job as a user runs it on synthetic plamo-2-1b bf16 --
# the README's eval command (full GSM8K, 5-shot, --batch-size auto) timed from the shell, the same run split into
# phases (bench/gsm8k.py), `generate` 256 tokens on a cold and then a warm cache, decode 1/8/64/256 with the
# batch-1 GEMV on and off (PLAMO2_GEMV) -- then plamo-3-8b beside plamo-2-8b (bf16): synth, convert vs cp -r,
# decode 1/64/256 and prefill 8k.  Carry .whl (lm-eval + deps, .whl/gsm8k).  Results: $OUT/call2.tar.gz.
set -u
OUT=${OUT:-/tmp/call2}; W=/tmp/w; mkdir -p "$W" "$OUT/r"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2> /dev/null \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TRITON_CACHE_DIR=/tmp/tc PLAMO2_CACHE_DIR=/tmp/pc
P="python3 -m plamo2_tools.cli"
now() { date +%s.%N; }
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(now)
  [[ -z "${ONLY:-}" || ",$ONLY," == *",$name,"* ]] || return 0
  timeout "$limit" "$@" > "$OUT/r/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc wall $(python3 -c "print(f'{$(now) - $t0:.2f}')") s" | tee -a "$OUT/r/walls.txt"
  tail -n "${TAIL:-6}" "$OUT/r/$name.log"; tar czf "$OUT/call2.tar.gz" -C "$OUT" r; }
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
step synth-1b 90 $P synth $W/src1b --preset plamo-2-1b --dtype bfloat16 --json
step convert-1b 40 $P convert $W/src1b $W/1b --json
TAIL=3 step pytest-gemv 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py
# generate: a fresh machine's first run (no Triton or tuning cache yet), then the second run
rm -rf /tmp/tc /tmp/pc
step generate-first 120 $P generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
step generate-second 60 $P generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
# the README's eval command, wall from the shell (batch size auto is the default)
TAIL=12 step eval-1b 150 $P eval $W/1b --tasks gsm8k --num-fewshot 5 --gsm8k-dir .whl/gsm8k --device cuda \
  --output-path $OUT/r/eval-1b --json
TAIL=25 step gsm8k-split-1b 150 python3 bench/gsm8k.py $W/1b --gsm8k-dir .whl/gsm8k --device cuda --out $OUT/r/gsm8k_1b.json
TAIL=8 step decode-1b 100 python3 bench/runtime.py $W/1b --label plamo-2-1b --device cuda --modes triton-graphs \
  --decode 1,8,64,256 --prefill 8192 --out $OUT/r/bench_runtime_1b.json
PLAMO2_GEMV=0 TAIL=4 step decode-1b-cublas 60 python3 bench/runtime.py $W/1b --label plamo-2-1b-cublas --device cuda \
  --modes triton-graphs --decode 1 --out $OUT/r/bench_runtime_1b_cublas.json
for m in plamo-3-8b plamo-2-8b; do
  step synth-$m 110 $P synth $W/src-$m --preset $m --dtype bfloat16 --json
  step cp-$m 40 bash -c "cp -r $W/src-$m $W/cp-$m && rm -rf $W/cp-$m"
  step convert-$m 60 $P convert $W/src-$m $W/$m --json
  rm -rf $W/src-$m
  TAIL=6 step decode-$m 120 python3 bench/runtime.py $W/$m --label $m --device cuda --modes triton-graphs \
    --decode 1,64,256 --prefill 8192 --out $OUT/r/bench_runtime_$m.json
  rm -rf $W/$m
done
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call2.tar.gz" -C "$OUT" r
