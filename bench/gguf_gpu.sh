#!/usr/bin/env bash
# GGUF on the GPU (issues 30 §3 and 31, "Benchmarks"): llama.cpp built with CUDA from llama-cpp-python 0.3.36's
# vendored tree; synthetic plamo-2-1b and plamo-3-8b exported by `plamo2-tools export gguf` as bf16, q8_0 and
# q4_0 (timed); llama.cpp's decode speed on each (llama-bench, tok/s, all layers on the GPU); and each file
# verified against our reference forward on the GPU: `plamo2-tools kld-base` (float64 reference on CUDA) then
# llama.cpp's own `llama-perplexity --kl-divergence` with the CUDA build (timed), KL read back with
# plamo2_tools.deploy.kld.read_kld_report.  JSON per model in $OUT (default runs/gguf-gpu/).
#
#   bench/gguf_gpu.sh build            # resumable: run again until it prints "build: done" (10 min a call)
#   bench/gguf_gpu.sh plamo-2-1b       # synth, export x3, llama-bench x3, kld-base, llama-perplexity x3
#   bench/gguf_gpu.sh plamo-3-8b       # the same (~16 GB bf16 source; the work dir is removed after)
#
# Needs: the repo's venv with torch CUDA (plamo2-tools), cmake, nvcc; the sdist at $PLAMO2_LLAMA_CPP_CACHE or
# ~/.cache/plamo2-tools/llama-cpp-python-0.3.36 (bench/llama_cpp.sh fetches it), or $LLAMA_TREE pointing at
# a llama.cpp tree (e.g. the sdist carried to the GPU machine).
set -euo pipefail

VERSION=0.3.36
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${PLAMO2_LLAMA_CPP_CACHE:-$HOME/.cache/plamo2-tools/llama-cpp-python-$VERSION}
TREE=${LLAMA_TREE:-$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp}
BUILD=${LLAMA_CUDA_BUILD:-$CACHE/cuda-build}
OUT=${OUT:-$REPO/runs/gguf-gpu}
WORK=${WORK:-${TMPDIR:-/tmp}/gguf-gpu}
CLI=${PLAMO2_TOOLS_CLI:-plamo2-tools}
DEVICE=${DEVICE:-cuda}  # where the reference of kld-base runs (DEVICE=cpu NGL=0: a smoke run without a GPU)
NGL=${NGL:-99}
CTX=${CTX:-512}
CHUNKS=${CHUNKS:-4}
mkdir -p "$OUT"

build() {
    [[ -f "$TREE/CMakeLists.txt" ]] || { echo "no llama.cpp tree at $TREE (set LLAMA_TREE)" >&2; exit 2; }
    if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
        # One GPU architecture (the card's own) and no FlashAttention kernel variants: the build fits the calls.
        cmake -S "$TREE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF >/dev/null
    fi
    local t0=$(date +%s)
    timeout "${BUILD_SLICE:-540}" cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-perplexity \
        >"$OUT/build.log" 2>&1 || { echo "build: not finished yet ($(($(date +%s) - t0)) s this call): run it again"; exit 0; }
    echo "build: done ($(($(date +%s) - t0)) s this call)"
}

seconds() { python3 -c "import time; print(f'{time.time():.3f}')"; }

model() {
    local preset=$1 dir=$WORK/$1
    local bench=$BUILD/bin/llama-bench ppl=$BUILD/bin/llama-perplexity
    [[ -x "$bench" && -x "$ppl" ]] || { echo "run '$0 build' first" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir"
    local t0 t1 json="$OUT/$preset.json"
    t0=$(seconds); "$CLI" synth "$dir/src" --preset "$preset" >/dev/null; t1=$(seconds)
    echo "{\"preset\": \"$preset\", \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo none)\"," \
        "\"synth_seconds\": $(python3 -c "print($t1 - $t0)"), \"files\": [" >"$json.tmp"
    python3 - "$dir/text.txt" <<'EOF'
import random, sys
random.seed(0)
words = "the model writes tokens on a GPU and checks every logit against the reference".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(40000)))
EOF
    t0=$(seconds)
    "$CLI" kld-base "$dir/src" "$dir/base.kld" --text "$dir/text.txt" --ctx "$CTX" --chunks "$CHUNKS" --device "$DEVICE" --json \
        >"$dir/kld-base.json"
    t1=$(seconds); local kld_base_s; kld_base_s=$(python3 -c "print($t1 - $t0)")
    local first=1
    for type in bf16 q8_0 q4_0; do
        local f=$dir/$type.gguf e0 e1 b0 b1 p0 p1
        e0=$(seconds); "$CLI" export gguf "$dir/src" "$f" --type "$type" --no-verify --json >"$dir/export-$type.json"; e1=$(seconds)
        b0=$(seconds); "$bench" -m "$f" -ngl "$NGL" -p 512 -n 128 -r 3 -o json >"$dir/bench-$type.json" 2>/dev/null; b1=$(seconds)
        p0=$(seconds)
        "$ppl" -m "$f" -ngl "$NGL" -c "$CTX" --kl-divergence-base "$dir/base.kld" --kl-divergence >"$dir/ppl-$type.txt" 2>&1
        p1=$(seconds)
        python3 - "$dir" "$type" "$e0" "$e1" "$b0" "$b1" "$p0" "$p1" "$first" >>"$json.tmp" <<'EOF'
import json, sys
from pathlib import Path
from plamo2_tools.deploy.kld import read_kld_report
d, t = Path(sys.argv[1]), sys.argv[2]
e0, e1, b0, b1, p0, p1 = map(float, sys.argv[3:9])
bench = json.loads((d / f"bench-{t}.json").read_text())
tg = [r for r in bench if r.get("n_gen", 0) > 0]
pp = [r for r in bench if r.get("n_prompt", 0) > 0]
kld = read_kld_report((d / f"ppl-{t}.txt").read_text())
row = {"type": t, "bytes": (d / f"{t}.gguf").stat().st_size, "export_seconds": e1 - e0,
       "decode_tok_s": tg[0]["avg_ts"] if tg else None, "prefill_tok_s": pp[0]["avg_ts"] if pp else None,
       "llama_bench_seconds": b1 - b0, "kld_seconds": p1 - p0, "mean_kld": kld["mean_kld"],
       "max_kld": kld["max_kld"], "same_top_p": kld["same_top_p"], "ppl_ratio": kld["ppl_ratio"]}
print(("" if sys.argv[9] == "1" else ",") + json.dumps(row))
EOF
        first=0
        rm -f "$f"
    done
    echo "], \"kld_base\": $(cat "$dir/kld-base.json"), \"kld_base_seconds\": $kld_base_s," \
        "\"command\": \"bench/gguf_gpu.sh $preset\"}" >>"$json.tmp"
    python3 -m json.tool "$json.tmp" >"$json" && rm "$json.tmp"
    rm -rf "$dir"
    cat "$json"
}

case "${1:-}" in
build) build ;;
plamo-* | tiny*) model "$1" ;;
*) sed -n 2,16p "$0"; exit 2 ;;
esac
