# What every session-4 GPU call script (bench/gpu_call3.sh ... gpu_call6.sh) starts with, sourced from
# the repo root on the device machine: the carried wheels (.whl) ahead of the image's packages, the caches,
# and `step NAME LIMIT CMD...`, which runs CMD with a time limit into $OUT/r/NAME.log, appends its rc and
# wall to $OUT/r/walls.txt, and re-tars $OUT/r after every step (whatever ran comes back); a step that
# would run past the call's deadline ($BUDGET s, default 560) is skipped and says so; ONLY=a,b runs those.
set -u
OUT=${OUT:-/tmp/call}; W=/tmp/w; mkdir -p "$W" "$OUT/r"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2> /dev/null \
  && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TRITON_CACHE_DIR=/tmp/tc PLAMO2_CACHE_DIR=/tmp/pc
P="python3 -m plamo2_tools.cli"
DEADLINE=$((SECONDS + ${BUDGET:-560}))
now() { date +%s.%N; }
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(now)
  [[ -z "${ONLY:-}" || ",$ONLY," == *",$name,"* ]] || return 0
  if (( SECONDS + limit > DEADLINE )); then echo "== $name skipped: ${limit} s would pass the deadline" | tee -a "$OUT/r/walls.txt"; return 0; fi
  timeout "$limit" "$@" > "$OUT/r/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc wall $(python3 -c "print(f'{$(now) - $t0:.2f}')") s" | tee -a "$OUT/r/walls.txt"
  tail -n "${TAIL:-6}" "$OUT/r/$name.log"; tar czf "$OUT/call.tar.gz" -C "$OUT" r; }
