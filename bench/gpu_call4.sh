#!/usr/bin/env bash
# GPU call B of session 4 (one H200, <= 9.5 min): why the real GSM8K run prefills at 39k tokens/s where the
# GSM8K-shaped schedule reaches 179k (call A): the same harness on synthetic GSM8K-shaped data, and the real data
# under a stack sampler (bench/sample_stacks.py); then plamo-3-8b beside plamo-2-8b (bf16): synth, cp -r vs
# convert, decode 1/64/256 and prefill 8k through Runtime.generate.
# Steps that would run past the call's deadline are skipped (walls.txt says so).  Carry .whl (lm-eval and its
# pure-Python deps for Python 3.12, .whl/gsm8k the data).  Results: $OUT/call.tar.gz.
. bench/gpu_steps.sh  # $OUT, $W, $P, step (run from the repo root)
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
python3 -c 'import torch, triton, lm_eval; print("torch", torch.__version__, "triton", triton.__version__)'
step synth-1b 60 $P synth $W/src1b --preset plamo-2-1b --dtype bfloat16 --json
step convert-1b 30 $P convert $W/src1b $W/1b --json
rm -rf $W/src1b
TAIL=30 step gsm8k-synthetic-1b 90 python3 bench/gsm8k.py $W/1b --synthetic-data 1319 --device cuda --out $OUT/r/gsm8k_synthetic_1b.json
TAIL=70 step stacks-gsm8k-1b 90 python3 bench/sample_stacks.py --out $OUT/r/stacks_gsm8k_1b.json -- bench/gsm8k.py $W/1b \
  --gsm8k-dir .whl/gsm8k --limit 600 --device cuda --out $OUT/r/gsm8k_1b_limit600.json
rm -rf $W/1b
for m in plamo-3-8b plamo-2-8b; do
  step synth-$m 110 $P synth $W/src-$m --preset $m --dtype bfloat16 --json
  step cp-$m 40 bash -c "cp -r $W/src-$m $W/cp-$m && rm -rf $W/cp-$m"
  step convert-$m 60 $P convert $W/src-$m $W/$m --json
  rm -rf $W/src-$m
  TAIL=6 step decode-$m 100 python3 bench/runtime.py $W/$m --label $m --device cuda --modes triton-graphs \
    --decode 1,64,256 --prefill 8192 --out $OUT/r/bench_runtime_$m.json
  rm -rf $W/$m
done
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call.tar.gz" -C "$OUT" r
