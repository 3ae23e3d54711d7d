#!/bin/bash
# bench/convert.py on the GPU machine's CPU side (16 cores, local disk), in one call of the device
# tool (issue 22: the torch-free convert): plamo-2-1b fp32 TP2xPP1 and TP4xPP2 with a warm cache
# (+ --sync file and --sync none on TP2xPP1: what durability costs), plamo-2-8b bf16 TP4xPP2 (warm)
# if disk and time allow, then plamo-2-1b again with a cold cache in the time left.  Every part is
# budgeted so that the whole script ends within its first argument (seconds, default 240; about 300
# gives every part its 3 repetitions; a part cut short keeps the repetitions it made); JSON and a
# log go to $OUT.
#   usage (repo root, device machine): bash bench/convert_device.sh [seconds for the whole script]
set -u
budget=${1:-240}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
nproc; uname -r; python3 -c "import numpy, xxhash, safetensors; print('numpy', numpy.__version__, 'xxhash', xxhash.VERSION)"
# the scratch must be on the disk: /tmp may be memory
if [ "$(stat -f -c %T /tmp)" = tmpfs ]; then work=$PWD/.bench-convert; else work=/tmp/bench-convert; fi
mkdir -p "$work"; df -h "$work"; stat -f -c 'fs %T' "$work"
note="16-core GPU host, nothing else running; torch-free convert (issue 22)"
python3 bench/convert.py --work "$work/1b" --synth fast --cache warm --repeat 3 --splits 2x1,4x2 \
    --variant "sync_file=--sync file" --variant "sync_none=--sync none" --target-ratio 1.15 --note "$note" \
    --time-budget $(( $(left) * 28 / 100 )) --out "$OUT/h200-1b-warm.json"
free_gb=$(df --output=avail -B1G "$work" | tail -1)
if [ "$free_gb" -ge 45 ] && [ "$(left)" -ge 100 ]; then
    python3 bench/convert.py --work "$work/8b" --preset plamo-2-8b --files 4 --synth fast --cache warm \
        --splits 4x2 --repeat 3 --note "$note" --time-budget $(( $(left) * 60 / 100 )) --out "$OUT/h200-8b.json" --clean
    rm -rf "$work/8b"
else
    echo "skipped plamo-2-8b: ${free_gb} GB free, $(left) s left"
fi
if [ "$(left)" -ge 40 ]; then  # the 1b source is still there: cold cache (drop_caches where allowed)
    python3 bench/convert.py --work "$work/1b" --synth fast --cache drop --repeat 3 --splits 2x1,4x2 \
        --note "$note" --time-budget $(( $(left) - 30 )) --out "$OUT/h200-1b-cold.json"
fi
rm -rf "$work"
echo "script took $(( $(date +%s) - start )) s"
