#!/usr/bin/env bash
# `plamo2-tools verify TARGET...` on one GPU, one call from the repo root: a synthetic real-shape
# checkpoint (bf16 storage, so every shard dtype below is a faithful cast of the same weights) ->
# shards in fp32, bf16 and fp16 -> verify all three in-process against the float64 reference on
# the GPU -> serve the bf16 shards -> verify the server (echo + prompt logprobs, top-20) on the
# GSM8K-like text prompts.  Writes $OUT/verify_shards_<preset>.json, $OUT/verify_serve_<preset>.json
# (kind plamo2-verify-targets: `plamo2-tools report` reads them) and $OUT/verify_timings_<preset>.json.
#
#   PRESET=plamo-2-1b bash bench/gpu_verify_targets.sh     # or plamo-3-2b (both window conventions)
#
# The device image lacks the CLI's and the server's pure-Python packages: carry `.whl` (see
# bench/gpu_serve.sh for the pip download line); they are installed into /tmp/site here.
# A CPU dry run: PRESET=tiny DEVICE=cpu bash bench/gpu_verify_targets.sh
set -u
OUT=${OUT:-/tmp/verify-out}; W=${WORK:-/tmp/verify-work}; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLUMNS=200 NO_COLOR=1
if ls .whl/*.whl > /dev/null 2>&1 && ! python3 -c 'import typer, rich, xxhash, fastapi, uvicorn, jinja2' 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
PRESET=${PRESET:-plamo-2-1b}; DEVICE=${DEVICE:-cuda}; STEPS=${STEPS:-32}; PORT=${PORT:-8765}
P="python3 -m plamo2_tools.cli"
LOG=$OUT/verify_log_$PRESET.txt
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null
python3 -c 'import torch, numpy, transformers; print("torch", torch.__version__, "numpy", numpy.__version__, "transformers", transformers.__version__)'
t0=$SECONDS
$P synth "$W/ckpt" --preset "$PRESET" --dtype bfloat16 --seed 7 --force > /dev/null || exit 1
for d in float32 bfloat16 float16; do
  $P convert "$W/ckpt" "$W/shards-$d" --dtype "$d" --force --json > /dev/null || exit 1
done
t_prep=$((SECONDS - t0))
t0=$SECONDS
$P verify "$W/shards-float32" "$W/shards-bfloat16" "$W/shards-float16" --reference "$W/ckpt" --device "$DEVICE" \
  --reference-device "$DEVICE" --random 4 --max-new-tokens "$STEPS" --output "$OUT/verify_shards_$PRESET.json"
rc_shards=$?
t_shards=$((SECONDS - t0))
$P serve "$W/shards-bfloat16" --device "$DEVICE" --port "$PORT" > "$W/serve.log" 2>&1 &
spid=$!
for _ in $(seq 1 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2> /dev/null && break
  sleep 1
done
t0=$SECONDS
$P verify "http://127.0.0.1:$PORT" --reference "$W/ckpt" --reference-device "$DEVICE" --gsm8k-like \
  --max-new-tokens "$STEPS" --output "$OUT/verify_serve_$PRESET.json"
rc_serve=$?
t_serve=$((SECONDS - t0))
kill -TERM $spid; wait $spid
tail -3 "$W/serve.log"
python3 - "$OUT/verify_timings_$PRESET.json" <<EOF
import json, sys
json.dump({"preset": "$PRESET", "device": "$DEVICE", "steps": $STEPS, "prepare_s": $t_prep,
           "verify_shards_s": $t_shards, "verify_shards_rc": $rc_shards, "verify_serve_s": $t_serve,
           "verify_serve_rc": $rc_serve,
           "commands": ["PRESET=$PRESET DEVICE=$DEVICE STEPS=$STEPS bash bench/gpu_verify_targets.sh"]},
          open(sys.argv[1], "w"), indent=1)
EOF
} 2>&1 | tee "$LOG"
