#!/usr/bin/env bash
# Issue 33 on one GPU, one call from the repo root (or a carried copy of it): the README's commands
# as a user meets them, fresh and warm, with their in-process split; this card's tuned-kernel
# table; decode against the card's weight-read floor.  Everything goes through `python -m
# bench.session`, so results land as one tar under $OUT (session.tar.gz + session.json + report.md).
#
#   PLAMO2_BENCH_COMMIT=<sha> GSM8K_DIR=runs/gsm8k bash bench/gpu_startup.sh [--deadline 300] [--no-e2e]
#       [--no-tune] [--no-decode-1b] [--no-decode-8b] [--no-load] [--warmup] [--limit N]
#
# In order of value (the session's deadline, default 300 s, cuts from the end: what does not fit is
# skipped and listed in session.json; --deadline 450 fits all four on an H100; each part can be
# left out by a flag):
# 1. e2e (plamo-2-1b bf16): `--help`, `generate --max-new-tokens 256`, `eval --tasks gsm8k
#    --num-fewshot 5` on the full test set, from the shell: pass 1 with empty Triton/tuning caches
#    (a fresh machine), pass 2 warm; each record carries the command's own split (`timeline`:
#    imports, load, lm-eval, tokens).  Targets: GSM8K <= 45 s fresh / 25 s warm, generate <= 10 / 4 s.
#    --warmup adds `plamo2-tools warmup SHARDS` as the first step of each pass (the "after warmup"
#    user), at the cost of its own seconds.
# 2. tune: `PLAMO2_TUNED=0 plamo2-tools warmup --tuned-out` reading the caches e2e just filled (so
#    it is quick); the table is written beside the tar as $OUT/<card>.json: commit it as
#    plamo2_tools/kernels/tuned/<card>.json (results/tune.json in the tar holds it too).
# 3. throughput plamo-2-1b: decode at batch 1 / 64 / 256 (CUDA graphs), against the weight-read
#    floor (targets: >= 75 % at 1, >= 60 % at 64).
# 4. throughput plamo-3-8b: the same (synth + convert of 16 GB first: about a minute).
# 5. after the session (about 20 s, outside its deadline): bench/load.py on the plamo-2-1b shards
#    onto the card, main's load (digest pass, then safetensors to the device) against the one-pass
#    load with digests on the loaded bytes: $OUT/load_cuda.json.
#
# GSM8K: the official train/test.jsonl, never committed: copy /work/shared/data/gsm8k/*.jsonl into
# an ignored folder of the carried tree (runs/gsm8k/) and carry it; without it eval runs on 1,319
# GSM8K-shaped synthetic problems (same shape, the scores then mean nothing).
# Wheels (the device image lacks typer, rich, xxhash, lm-eval...): carried in .whl/ (docs/benchmarks.md).
# A CPU dry run: DEVICE=cpu MODES=torch-eager PRESET1=tiny PRESET8=tiny3 bash bench/gpu_startup.sh --limit 4 --no-tune
set -u
DEADLINE=300 E2E=1 TUNE=1 D1=1 D8=1 LOAD=1 WARMUP=0 LIMIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --deadline) DEADLINE=$2; shift ;;
    --no-e2e) E2E=0 ;;
    --no-tune) TUNE=0 ;;
    --no-decode-1b) D1=0 ;;
    --no-decode-8b) D8=0 ;;
    --no-load) LOAD=0 ;;
    --warmup) WARMUP=1 ;;
    --limit) LIMIT="--limit $2"; shift ;;
    *) echo "gpu_startup.sh: unknown option $1 (see the comment at its top)" >&2; exit 2 ;;
  esac
  shift
done
DEVICE=${DEVICE:-cuda}; PRESET1=${PRESET1:-plamo-2-1b}; PRESET8=${PRESET8:-plamo-3-8b}
WORK=${WORK:-/tmp/plamo2-session}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=200 NO_COLOR=1
if [ -n "${GSM8K_DIR:-}" ] && [ -f "$GSM8K_DIR/test.jsonl" ]; then
  DATA="--gsm8k-dir $(cd "$GSM8K_DIR" && pwd)"
elif [ -f runs/gsm8k/test.jsonl ]; then
  DATA="--gsm8k-dir $PWD/runs/gsm8k"
else
  echo "gpu_startup.sh: no GSM8K files (GSM8K_DIR or runs/gsm8k/): eval runs on synthetic GSM8K-shaped data" >&2
  DATA="--synthetic-data 1319"
fi
STEPS=help,generate,eval
[ "$WARMUP" = 1 ] && STEPS=warmup,$STEPS
B=()
[ "$E2E" = 1 ] && B+=("e2e --preset $PRESET1 --steps $STEPS --repeat 2 --max-new-tokens 256 $DATA $LIMIT")
[ "$TUNE" = 1 ] && B+=("tune --preset $PRESET1 --caches $WORK/e2e/caches/this")
DECODE="--modes ${MODES:-triton-graphs} --decode 1,64,256 --prefill , --steps 128 --context 256"
[ "$D1" = 1 ] && B+=("throughput --preset $PRESET1 $DECODE")
[ "$D8" = 1 ] && B+=("throughput --preset $PRESET8 $DECODE")
[ ${#B[@]} -gt 0 ] || { echo "gpu_startup.sh: every part left out" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null
[ "$DEVICE" = cpu ] && B=("${B[@]/%/ --device cpu}")
python3 -m bench.session --deadline "$DEADLINE" --work "$WORK" --dtype bfloat16 --min-seconds 25 \
  ${OUT:+--out "$OUT"} --preset "$PRESET1" "${B[@]}"
rc=$?
# The card's table beside the tar, ready to commit as plamo2_tools/kernels/tuned/<its name>.
python3 - "$WORK/session/results/tune.json" "${OUT:-runs/session}" <<'PY' || true
import json, pathlib, sys
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
if src.is_file() and (res := json.loads(src.read_text()).get("results") or {}).get("table"):
    (out / res["table_file"]).write_text(json.dumps(res["table"], indent=1) + "\n")
    print(f"tuned table: {out / res['table_file']} (commit it as plamo2_tools/kernels/tuned/{res['table_file']})")
PY
SHARDS=$WORK/models/$PRESET1-bfloat16/tp1pp1
if [ "$LOAD" = 1 ] && [ -f "$SHARDS/plamo2_shards.json" ]; then  # after the session: its model, warm page cache
  timeout 90 python3 bench/load.py "$SHARDS" --device "$DEVICE" --repeat 3 --out "${OUT:-runs/session}/load_$DEVICE.json"
fi
exit $rc
