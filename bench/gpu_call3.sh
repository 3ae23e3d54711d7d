#!/usr/bin/env bash
# GPU call A of session 4 (one H200, <= 9.5 min): the main job as a user meets it on synthetic plamo-2-1b bf16 --
# the README's eval command (full GSM8K, 5-shot, --batch-size auto by default) timed from the shell, `generate`
# 256 tokens on a cold and then a warm cache, decode 1/8/64/256 through Runtime.generate with the batch-1 GEMV on
# and off (PLAMO2_GEMV=0: cuBLAS), then the same GSM8K run split into phases (bench/gsm8k.py) if time is left.
# Steps that would run past the call's deadline are skipped (walls.txt says so).  Carry .whl (lm-eval and its
# pure-Python deps for Python 3.12, .whl/gsm8k the data).  Results: $OUT/call.tar.gz.
. bench/gpu_steps.sh  # $OUT, $W, $P, step (run from the repo root)
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; git log --oneline -1 2>/dev/null
python3 -c 'import torch, triton, lm_eval; print("torch", torch.__version__, "triton", triton.__version__)'
step synth-1b 90 $P synth $W/src1b --preset plamo-2-1b --dtype bfloat16 --json
step convert-1b 40 $P convert $W/src1b $W/1b --json
rm -rf $W/src1b
TAIL=3 step pytest-gemv 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py
# generate: a fresh machine's first run (no Triton or tuning cache yet), then the second run
rm -rf /tmp/tc /tmp/pc
step generate-first 100 $P generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
step generate-second 40 $P generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
# the README's eval command, wall from the shell (batch size auto is the default)
TAIL=12 step eval-1b 120 $P eval $W/1b --tasks gsm8k --num-fewshot 5 --gsm8k-dir .whl/gsm8k --device cuda \
  --output-path $OUT/r/eval-1b --json
TAIL=8 step decode-1b 90 python3 bench/runtime.py $W/1b --label plamo-2-1b --device cuda --modes triton-graphs \
  --decode 1,8,64,256 --prefill 8192 --out $OUT/r/bench_runtime_1b.json
PLAMO2_GEMV=0 TAIL=4 step decode-1b-cublas 50 python3 bench/runtime.py $W/1b --label plamo-2-1b-cublas --device cuda \
  --modes triton-graphs --decode 1,8 --out $OUT/r/bench_runtime_1b_cublas.json
TAIL=25 step gsm8k-split-1b 100 python3 bench/gsm8k.py $W/1b --gsm8k-dir .whl/gsm8k --device cuda --out $OUT/r/gsm8k_1b.json
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call.tar.gz" -C "$OUT" r
