#!/usr/bin/env bash
# GGUF on the GPU (issues 30 §3 and 31, "Benchmarks"): llama.cpp built with CUDA from llama-cpp-python 0.3.36's
# vendored tree; synthetic plamo-2-1b and plamo-3-8b exported by `plamo2-tools export gguf` as bf16, q8_0 and
# q4_0 (timed); llama.cpp's decode speed on each (llama-bench, tok/s, all layers on the GPU); and each file
# verified against our reference forward on the GPU: `plamo2-tools kld-base` (the reference on CUDA: float64 for
# plamo-2-1b, float32 for plamo-3-8b, whose float64 weights would not fit 80 GB) then llama.cpp's own
# `llama-perplexity --kl-divergence` with the CUDA build (timed), read back by deploy.kld.read_kld_report.
#
#   bash bench/gguf_gpu.sh pack     # HERE, once: .gguf-gpu/llama.cpp.tar.gz (the sdist's llama.cpp tree without
#                                   # its models, docs and other backends: ~10 MB) and .gguf-gpu/whl/ (gguf 0.19.0)
#   bash bench/gguf_gpu.sh all      # ON THE GPU MACHINE (carry .gguf-gpu and .whl): build, plamo-2-1b, plamo-3-8b;
#                                   # resumable: each call does what fits in $BUDGET s (540) and skips what is done;
#                                   # run it again until it prints "all: done".  Results: $OUT/gguf-gpu-*.json
#   bash bench/gguf_gpu.sh build | plamo-2-1b | plamo-3-8b | tiny3     # one step
#
# CPU smoke test of everything but the CUDA build (the CPU tools bench/llama_cpp.sh --tools built):
#   BIN=~/.cache/plamo2-tools/llama-cpp-python-0.3.36/tools/bin DEVICE=cpu NGL=0 bash bench/gguf_gpu.sh tiny3
#
# State between calls lives in $STATE (default .gguf-gpu/ in the repo: ignored, kept while the machine is warm):
# the unpacked tree, the CUDA build, one JSON per finished model.  Needs there: nvcc, cmake, ninja, python3 with
# torch (the device image has them) and the CLI's pure-Python packages as wheels in .whl/ (docs/benchmarks.md).
set -euo pipefail

VERSION=0.3.36
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${STATE:-$REPO/.gguf-gpu}
CACHE=${PLAMO2_LLAMA_CPP_CACHE:-$HOME/.cache/plamo2-tools/llama-cpp-python-$VERSION}
TREE=${LLAMA_TREE:-$STATE/llama.cpp}
BUILD=${LLAMA_CUDA_BUILD:-$STATE/cuda-build}
BIN=${BIN:-$BUILD/bin}
OUT=${OUT:-$REPO/runs/gguf-gpu}
WORK=${WORK:-${TMPDIR:-/tmp}/gguf-gpu}
DEVICE=${DEVICE:-cuda}
NGL=${NGL:-99}
CTX=${CTX:-512}
CHUNKS=${CHUNKS:-4}
BUDGET=${BUDGET:-540}
START=$SECONDS
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NO_COLOR=1 COLUMNS=200
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CLI="python3 -m plamo2_tools.cli"

pack() {
    local tree=$CACHE/src/llama_cpp_python-$VERSION/vendor
    [[ -f "$tree/llama.cpp/CMakeLists.txt" ]] || { echo "no llama.cpp tree at $tree: run bench/llama_cpp.sh" >&2; exit 3; }
    mkdir -p "$STATE/whl"
    local ex=() d
    for d in models docs tests benches conversion tools/server/webui tools/ui; do ex+=("--exclude=llama.cpp/$d"); done
    for d in metal sycl vulkan opencl hexagon et cann musa; do ex+=("--exclude=llama.cpp/ggml/src/ggml-$d"); done
    tar -C "$tree" -czf "$STATE/llama.cpp.tar.gz" "${ex[@]}" "--exclude=llama.cpp/tools/server/public*" \
        "--exclude=*.gguf" llama.cpp
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$STATE/whl" gguf==0.19.0
    du -sh "$STATE/llama.cpp.tar.gz" "$STATE/whl"
}

install_wheels() {
    local w=() f
    for f in "$REPO"/.whl/*.whl "$STATE"/whl/*.whl; do [[ -f "$f" ]] && w+=("$f"); done
    if ((${#w[@]})) && ! python3 -c 'import typer, rich, xxhash, gguf' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${w[@]}"
        export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
}

left() { echo $((BUDGET - (SECONDS - START))); }

build() {
    if [[ ! -f "$TREE/CMakeLists.txt" ]]; then
        [[ -f "$STATE/llama.cpp.tar.gz" ]] || { echo "no llama.cpp tree: run 'bench/gguf_gpu.sh pack' here, carry .gguf-gpu" >&2; exit 3; }
        tar -xzf "$STATE/llama.cpp.tar.gz" -C "$(dirname "$TREE")"
    fi
    if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
        # The card's own architecture only, static, no server/tests/examples: the build fits the calls.
        cmake -S "$TREE" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$STATE/cmake.log" 2>&1 \
            || { tail -20 "$STATE/cmake.log"; exit 3; }
    fi
    local t0=$SECONDS
    if timeout "$(left)" cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-perplexity >"$STATE/build.log" 2>&1; then
        echo "build: done ($((SECONDS - t0)) s this call)"
        touch "$STATE/build.done"
    else
        tail -5 "$STATE/build.log"
        echo "build: not finished ($((SECONDS - t0)) s this call): run again"
        exit 0
    fi
}

model() {
    local preset=$1 dir=$WORK/$1 precision=float64
    [[ $preset == plamo-3-8b ]] && precision=float32
    local bench=$BIN/llama-bench ppl=$BIN/llama-perplexity json=$STATE/gguf-gpu-$preset.json
    [[ -x "$bench" && -x "$ppl" ]] || { echo "no llama-bench / llama-perplexity in $BIN: build first" >&2; exit 3; }
    rm -rf "$dir" && mkdir -p "$dir"
    local t0=$SECONDS
    $CLI synth "$dir/src" --preset "$preset" --dtype bfloat16 >/dev/null
    local synth_s=$((SECONDS - t0))
    python3 - "$dir/text.txt" <<'EOF'
import random, sys
random.seed(0)
words = "the model writes tokens on a GPU and checks every logit against the reference".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(40000)))
EOF
    local r0=$SECONDS
    $CLI kld-base "$dir/src" "$dir/base.kld" --text "$dir/text.txt" --ctx "$CTX" --chunks "$CHUNKS" --device "$DEVICE" \
        --precision "$precision" --json >"$dir/kld-base.json"
    local kld_base_s=$((SECONDS - r0))
    for type in bf16 q8_0 q4_0; do
        local f=$dir/$type.gguf e0 e1 b0 b1 p0 p1
        e0=$(date +%s.%N); $CLI export gguf "$dir/src" "$f" --type "$type" --no-verify --json >"$dir/export-$type.json"; e1=$(date +%s.%N)
        b0=$(date +%s.%N); "$bench" -m "$f" -ngl "$NGL" -p 512 -n 128 -r 3 -o json >"$dir/bench-$type.json" 2>"$dir/bench-$type.log"; b1=$(date +%s.%N)
        p0=$(date +%s.%N)
        "$ppl" -m "$f" -ngl "$NGL" -c "$CTX" -b "$CTX" -fa off --kl-divergence-base "$dir/base.kld" --kl-divergence \
            >"$dir/ppl-$type.txt" 2>&1
        p1=$(date +%s.%N)
        echo "$type $e0 $e1 $b0 $b1 $p0 $p1" >>"$dir/times.txt"
        rm -f "$f"
    done
    python3 - "$dir" "$preset" "$precision" "$synth_s" "$kld_base_s" "$json" <<'EOF'
import json, subprocess, sys
from pathlib import Path
from plamo2_tools.deploy.kld import read_kld_report
d, preset, precision, synth_s, base_s, out = Path(sys.argv[1]), *sys.argv[2:]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
except FileNotFoundError:
    gpu = subprocess.CompletedProcess([], 1, "", "")
rows = []
for line in (d / "times.txt").read_text().splitlines():
    t, e0, e1, b0, b1, p0, p1 = line.split()
    e0, e1, b0, b1, p0, p1 = map(float, (e0, e1, b0, b1, p0, p1))
    bench = json.loads((d / f"bench-{t}.json").read_text())
    tg = [r for r in bench if r.get("n_gen", 0) > 0]
    pp = [r for r in bench if r.get("n_prompt", 0) > 0]
    kld = read_kld_report((d / f"ppl-{t}.txt").read_text())
    export = json.loads((d / f"export-{t}.json").read_text())
    rows.append({"type": t, "bytes": export["bytes"], "export_seconds": e1 - e0,
                 "decode_tok_s": tg[0]["avg_ts"] if tg else None, "prefill_tok_s": pp[0]["avg_ts"] if pp else None,
                 "llama_bench_seconds": b1 - b0, "kld_seconds": p1 - p0, "mean_kld": kld.get("mean_kld"),
                 "max_kld": kld.get("max_kld"), "same_top_p": kld.get("same_top_p"), "ppl_ratio": kld.get("ppl_ratio")})
record = {"kind": "plamo2-bench-gguf-gpu", "schema_version": 1, "preset": preset,
          "gpu": gpu.stdout.strip().splitlines()[0] if gpu.returncode == 0 and gpu.stdout.strip() else "none",
          "reference_precision": precision, "synth_seconds": float(synth_s), "kld_base_seconds": float(base_s),
          "kld_base": json.loads((d / "kld-base.json").read_text()), "files": rows,
          "command": f"bash bench/gguf_gpu.sh {preset}"}
Path(out).write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps(record, indent=1))
EOF
    rm -rf "$dir"
}

step() {  # a model step, skipped when its JSON exists, stopped at the call's budget
    local preset=$1
    [[ -f "$STATE/gguf-gpu-$preset.json" ]] && { echo "$preset: done before"; return 0; }
    local t=$(left)
    ((t > 60)) || { echo "$preset: not started (budget spent): run again"; exit 0; }
    if ! timeout "$t" bash "$0" "$preset"; then
        echo "$preset: not finished within this call's budget: run again"
        exit 0
    fi
}

collect() { mkdir -p "$OUT" && cp "$STATE"/gguf-gpu-*.json "$OUT"/ 2>/dev/null || true; }

mkdir -p "$STATE"
case "${1:-}" in
pack) pack ;;
build) build ;;
plamo-* | tiny*) install_wheels; model "$1"; collect ;;
all)
    install_wheels
    trap collect EXIT
    [[ -f "$STATE/build.done" ]] || build
    step plamo-2-1b
    step plamo-3-8b
    echo "all: done"
    ;;
*) sed -n 2,22p "$0"; exit 2 ;;
esac
