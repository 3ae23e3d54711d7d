#!/usr/bin/env bash
# GPU call D of session 4 (one H200, <= 6 min), on main with issues 20-24 merged: `plamo2-tools serve` under
# 1/16/64/256 streaming clients beside in-process Runtime.generate (bench/serve.py), the README's eval command
# again with the Triton cache warm, under the stack sampler (where the wall goes), and the torch-free convert
# against cp -r on the 16-core host (bench/convert_device.sh, what its budget allows).
# Steps that would run past the call's deadline are skipped (walls.txt says so).  Carry .whl (lm-eval and its
# pure-Python deps for Python 3.12, .whl/gsm8k the data).  Results: $OUT/call.tar.gz.
. bench/gpu_steps.sh  # $OUT, $W, $P, step (run from the repo root)
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
step synth-1b 60 $P synth $W/src1b --preset plamo-2-1b --dtype bfloat16 --json
step convert-1b 30 $P convert $W/src1b $W/1b --json
rm -rf $W/src1b
TAIL=16 step serve-1b 150 python3 bench/serve.py $W/1b --device cuda --label plamo-2-1b --clients 1,16,64,256 \
  --per-client 2 --prompt-tokens 256 --max-tokens 128 --max-seconds 110 --out $OUT/r/bench_serve_1b.json
TAIL=30 step eval-1b-warm 80 python3 bench/sample_stacks.py --top 60 --out $OUT/r/stacks_eval_1b.json --module -- \
  plamo2_tools.cli eval $W/1b --tasks gsm8k --num-fewshot 5 --gsm8k-dir .whl/gsm8k --device cuda \
  --output-path $OUT/r/eval-1b --json
rm -rf $W/1b
mkdir -p $OUT/r/convert
TAIL=12 step convert-bench 140 env OUT=$OUT/r/convert bash bench/convert_device.sh ${CONVERT_BUDGET:-120}
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call.tar.gz" -C "$OUT" r
