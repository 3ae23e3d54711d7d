#!/usr/bin/env bash
# GPU call C of session 4 (one H200, <= 8 min): after the prefill fix (no cuDNN SDPA plans per prompt length;
# square causal blocks of windowed layers go to flash): the README's eval command on synthetic plamo-2-1b bf16
# from the shell, `generate` start-up under the stack sampler, and plamo-3-8b decode/prefill (the graph-capture
# fix of its RoPE tables).
# Steps that would run past the call's deadline are skipped (walls.txt says so).  Carry .whl (lm-eval and its
# pure-Python deps for Python 3.12, .whl/gsm8k the data).  Results: $OUT/call.tar.gz.
. bench/gpu_steps.sh  # $OUT, $W, $P, step (run from the repo root)
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
step synth-1b 60 $P synth $W/src1b --preset plamo-2-1b --dtype bfloat16 --json
step convert-1b 30 $P convert $W/src1b $W/1b --json
rm -rf $W/src1b
TAIL=12 step eval-1b 120 $P eval $W/1b --tasks gsm8k --num-fewshot 5 --gsm8k-dir .whl/gsm8k --device cuda \
  --output-path $OUT/r/eval-1b --json
step generate-second 40 $P generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
TAIL=40 step stacks-generate 40 python3 bench/sample_stacks.py --interval 0.002 --out $OUT/r/stacks_generate.json --module -- \
  plamo2_tools.cli generate $W/1b --prompt "Question: what is 12 times 7? Answer:" --max-new-tokens 256 --device cuda
python3 -X importtime -c "import plamo2_tools.cli" 2> $OUT/r/importtime_cli.txt
TAIL=25 step gsm8k-split-1b 90 python3 bench/gsm8k.py $W/1b --gsm8k-dir .whl/gsm8k --device cuda --out $OUT/r/gsm8k_1b.json
rm -rf $W/1b
m=plamo-3-8b
step synth-$m 80 $P synth $W/src-$m --preset $m --dtype bfloat16 --json
step convert-$m 40 $P convert $W/src-$m $W/$m --json
rm -rf $W/src-$m
TAIL=6 step decode-$m 100 python3 bench/runtime.py $W/$m --label $m --device cuda --modes triton-graphs \
  --decode 1,64,256 --prefill 8192 --out $OUT/r/bench_runtime_$m.json
} 2>&1 | tee "$OUT/r/summary.log"
tar czf "$OUT/call.tar.gz" -C "$OUT" r
