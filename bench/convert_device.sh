#!/bin/bash
# bench/convert.py on the GPU machine's CPU side (16 cores, local disk), in one call of the device
# tool: plamo-2-1b fp32 (TP2xPP1, TP4xPP2, + user-space copies, + no early writeback, + HF-cache
# blob sha256), then plamo-2-8b bf16 TP4xPP2 if disk and time allow.  JSON and a log go to $OUT.
#   usage (repo root, device machine): bash bench/convert_device.sh [seconds for the whole script]
set -u
budget=${1:-240}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
nproc; uname -r; python3 -c "import torch, xxhash, safetensors; print('torch', torch.__version__, 'xxhash', xxhash.VERSION)"
# the scratch must be on the disk: /tmp may be memory
if [ "$(stat -f -c %T /tmp)" = tmpfs ]; then work=$PWD/.bench-convert; else work=/tmp/bench-convert; fi
mkdir -p "$work"; df -h "$work"; stat -f -c 'fs %T' "$work"
python3 bench/convert.py --work "$work/1b" --synth fast --cache cold --repeat 3 \
    --variant "user=--copy user" --variant "nowb=PLAMO2_NO_EARLY_WRITEBACK=1" --blob-check \
    --time-budget $(( $(left) * 55 / 100 )) --out "$OUT/h200-1b.json" --clean
rm -rf "$work/1b"
free_gb=$(df --output=avail -B1G "$work" | tail -1)
if [ "$free_gb" -ge 40 ] && [ "$(left)" -ge 90 ]; then
    python3 bench/convert.py --work "$work/8b" --preset plamo-2-8b --files 4 --synth fast --cache cold \
        --splits 4x2 --repeat 3 --time-budget $(( $(left) - 45 )) --out "$OUT/h200-8b.json" --clean
else
    echo "skipped plamo-2-8b: ${free_gb} GB free, $(left) s left"
fi
rm -rf "$work"
echo "script took $(( $(date +%s) - start )) s"
