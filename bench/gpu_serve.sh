#!/usr/bin/env bash
# `plamo2-tools serve` under load on one H200, one call from the repo root: synthetic plamo-2-1b
# and plamo-2-8b (bf16) -> bench/serve.py (1, 16, 64, 256 concurrent streaming clients against
# the server, then the same requests through in-process Runtime.generate) -> $OUT/bench_serve_<m>.json
# and a rendered report.  ~4 minutes per model; MODELS=1b or MODELS=8b splits it over two calls.
#
# The server needs fastapi, starlette, uvicorn and what they import (h11, anyio, click,
# annotated-doc, pydantic, ...): carry `.whl` with those wheels if the device image lacks them
# (checked first, one line if missing).  On a machine with network access, for the device's Python:
#   pip download fastapi uvicorn -d .whl --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
# Knobs: AB_SWITCH=0.0005 adds a second server pass per model (64 and 256 clients) with
#        PLAMO2_SERVE_SWITCH_INTERVAL set (the GIL hand-over interval; serve/service.py says why)
#        MODELS=1b,8b  CLIENTS=1,16,64,256  PER_CLIENT=2  PROMPT_TOKENS=256  MAX_TOKENS=128
#        SECONDS_PER_MODEL=240  DEVICE=cuda  SHARDS_1B=... SHARDS_8B=... (skip synth/convert)
# A CPU dry run (tiny model, small sizes):
#   MODELS=tiny DEVICE=cpu CLIENTS=1,4 PROMPT_TOKENS=16 MAX_TOKENS=8 SECONDS_PER_MODEL=120 bash bench/gpu_serve.sh
set -u
OUT=${OUT:-/tmp/serve-out}; W=${WORK:-/tmp/serve-bench}; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
P="python3 -m plamo2_tools.cli"
DEVICE=${DEVICE:-cuda}
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null
if ! python3 -c 'import fastapi, uvicorn, pydantic, starlette, h11, anyio, click' 2>&1; then
  echo "== serve bench skipped: the server's packages are not importable (carry .whl, see the top of this file)"; exit 3
fi
MODELS=${MODELS:-1b,8b}
for m in ${MODELS//,/ }; do
  case $m in 1b) preset=plamo-2-1b; given=${SHARDS_1B:-} ;; 8b) preset=plamo-2-8b; given=${SHARDS_8B:-} ;;
             *) preset=$m; given= ;; esac
  if [ -n "$given" ]; then src=("$given"); else src=(--synth "$preset" --dtype bfloat16); fi
  [ "$preset" = tiny ] && src=(--synth tiny)
  t0=$SECONDS
  timeout $(( ${SECONDS_PER_MODEL:-240} + 300 )) python3 bench/serve.py "${src[@]}" --device "$DEVICE" --label "$m" \
    --clients "${CLIENTS:-1,16,64,256}" --per-client "${PER_CLIENT:-2}" --prompt-tokens "${PROMPT_TOKENS:-256}" \
    --max-tokens "${MAX_TOKENS:-128}" --max-seconds "${SECONDS_PER_MODEL:-240}" --out "$OUT/bench_serve_$m.json" \
    > "$OUT/bench_serve_$m.log" 2>&1
  echo "== bench_serve $m rc=$? in $((SECONDS - t0)) s"
  tail -n 14 "$OUT/bench_serve_$m.log"
  if [ -n "${AB_SWITCH:-}" ]; then
    t0=$SECONDS
    PLAMO2_SERVE_SWITCH_INTERVAL=$AB_SWITCH timeout $(( ${SECONDS_PER_MODEL:-240} + 300 )) python3 bench/serve.py \
      "${src[@]}" --device "$DEVICE" --label "$m switch $AB_SWITCH" --clients 64,256 --per-client "${PER_CLIENT:-2}" \
      --prompt-tokens "${PROMPT_TOKENS:-256}" --max-tokens "${MAX_TOKENS:-128}" --max-seconds "${SECONDS_PER_MODEL:-240}" \
      --out "$OUT/bench_serve_${m}_switch.json" > "$OUT/bench_serve_${m}_switch.log" 2>&1
    echo "== bench_serve $m switch $AB_SWITCH rc=$? in $((SECONDS - t0)) s"
    tail -n 6 "$OUT/bench_serve_${m}_switch.log"
  fi
done
$P report "$OUT" --out "$OUT/serve-report.md" > /dev/null 2>&1 && grep -A14 "## Server under load" "$OUT/serve-report.md"
} 2>&1 | tee "$OUT/summary.log"
