#!/usr/bin/env bash
# One GPU call for the generation and multi-GPU work, from the repo root: the full offline GSM8K run
# (bench/gpu_generation.sh STEPS=gsm8k) and TP/PP verification and timing on however many GPUs are
# there (bench/gpu_multi.sh).  Carry .whl (see bench/gpu_generation.sh).  Results in $OUT.
set -u
OUT=${OUT:-/tmp/wave-out}; mkdir -p "$OUT/gen" "$OUT/multi"
OUT=$OUT/gen STEPS=${GEN_STEPS:-gsm8k} bash bench/gpu_generation.sh
OUT=$OUT/multi bash bench/gpu_multi.sh
