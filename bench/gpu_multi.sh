#!/usr/bin/env bash
# TP and PP on GPUs, in one call from the repo root (issue 15): synthetic plamo-2-1b -> TP2xPP1 and
# TP1xPP2 (fp32 and bf16) -> verify against the float64 reference on the GPU -> decode throughput
# of the same layouts beside TP1.  With >= 2 GPUs the ranks are real torchrun processes over NCCL
# (`verify --launch`); with one GPU they run as threads of one process on that GPU (the same SPMD
# program; the collectives are then in-process sums, so their cost is not NCCL's).  Results in $OUT.
set -u
OUT=${OUT:-/tmp/multi-out}; W=${WORK:-/tmp/multi}; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P="python3 -m plamo2_tools.cli"
step() {  # step NAME SECONDS CMD...: time-limited, logged to $OUT/NAME.log, never stops the script
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}
GPUS=$(nvidia-smi -L | wc -l)
LAUNCH=""; [ "$GPUS" -ge 2 ] && LAUNCH="--launch"
echo "gpus=$GPUS mode=${LAUNCH:-threads on one GPU}" | tee "$OUT/mode.txt"
step synth 150 $P synth "$W/src" --preset "${PRESET:-plamo-2-1b}" --force --json
for spec in "tp2 2 1 auto" "pp2 1 2 auto" "tp2-bf16 2 1 bfloat16" "pp2-bf16 1 2 bfloat16" "tp1-bf16 1 1 bfloat16"; do
  set -- $spec
  step "convert-$1" 120 $P convert "$W/src" "$W/$1" --tp "$2" --pp "$3" --dtype "$4" --force --json
done
TAIL=25 step verify-fp32 150 $P verify "$W/tp2" "$W/pp2" --reference "$W/src" --device cuda --reference-device cuda \
  --max-new-tokens 16 $LAUNCH --output "$OUT/verify_multi_fp32.json"
TAIL=25 step verify-bf16 120 $P verify "$W/tp2-bf16" "$W/pp2-bf16" --reference "$W/src" --device cuda \
  --reference-device cuda --max-new-tokens 16 $LAUNCH --output "$OUT/verify_multi_bf16.json"
for layout in tp1-bf16 tp2-bf16 pp2-bf16; do
  TAIL=15 step "bench-$layout" 75 python3 bench/runtime.py "$W/$layout" --label "plamo-2-1b $layout ($GPUS GPU)" \
    --decode "${DECODE:-1,64,256}" --modes "${MODES:-triton-graphs,triton-eager}" --prefill 2048 \
    --out "$OUT/bench_runtime_1b_$layout.json"
done
