#!/usr/bin/env bash
# End to end on a 2-GPU machine, from the repo root: a synthetic plamo-2-1b checkpoint ->
# convert (TP1, TP2, PP2 in fp32; TP1 in bf16) -> verify against the reference forward (float64 on
# the GPU): Triton kernels in one process, then real NCCL ranks (TP=2 on two GPUs, PP=2) ->
# prefill/decode throughput, Triton vs the PyTorch path.  Results land in $OUT.
set -u
OUT=${OUT:-/tmp/e2e-out}
W=${WORK:-/tmp/e2e}
mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P="python3 -m plamo2_tools.cli"
step() {
  echo "== $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "== rc=$rc in $((SECONDS - t0)) s"
  return 0
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
step $P synth "$W/src" --preset ${PRESET:-plamo-2-1b} --force
step $P convert "$W/src" "$W/tp1" --force
step $P convert "$W/src" "$W/tp2" --tp 2 --force
step $P convert "$W/src" "$W/pp2" --pp 2 --force
step $P convert "$W/src" "$W/tp1-bf16" --dtype bfloat16 --force
step $P verify "$W/tp1" "$W/tp1-bf16" --reference "$W/src" --device ${DEV:-cuda} --backend ${BACKEND:-triton} \
  --reference-device ${DEV:-cuda} --max-new-tokens ${STEPS:-16} --output "$OUT/verify_1b_triton.json"
step $P verify "$W/tp2" "$W/pp2" --reference "$W/src" --device ${DEV:-cuda} --launch \
  --reference-device ${DEV:-cuda} --max-new-tokens ${STEPS:-16} --output "$OUT/verify_1b_nccl.json"
step python3 bench/runtime.py "$W/tp1-bf16" --device ${DEV:-cuda} --backends ${BENCH_BACKENDS:-triton,torch} ${BENCH_ARGS:-} --out "$OUT/bench_runtime_1b.json"
