#!/usr/bin/env bash
# llama.cpp for `export gguf`, `verify FILE.gguf` and their tests (issues 30 §3, 31 §1): llama-cpp-python
# 0.3.36 built ONCE from its sdist (portable: GGML_NATIVE=OFF, so a wheel built here runs on any x86-64 CI
# machine), cached OUTSIDE the repo and reused between runs.
#
#   bench/llama_cpp.sh [--install-into VENV] [--tools] [--cache DIR]
#
# The cache ($PLAMO2_LLAMA_CPP_CACHE, else ~/.cache/plamo2-tools/llama-cpp-python-0.3.36) holds:
#   sdist/llama_cpp_python-0.3.36.tar.gz    pip download --no-binary :all: (the source of everything below)
#   src/llama_cpp_python-0.3.36/            the sdist unpacked: vendor/llama.cpp/convert_hf_to_gguf.py is the
#                                           converter tests/export/test_gguf_converter.py compares our export with
#   wheels/llama_cpp_python-0.3.36-*.whl    the CPU build (measured: 56 min on 2 cores shared with other jobs)
#   .ready                                  written only after a complete build (an interrupted one is redone)
#   tools/bin/llama-quantize, llama-perplexity, llama-bench   with --tools: the same tree's CMake targets
#                                           (k-quant exports, kld-base against a real llama-perplexity)
# --install-into VENV (default: the repo's .venv when it exists) installs the cached wheel and gguf==0.19.0
# there: seconds once the wheel exists.  CI: `bash bench/llama_cpp.sh --install-into .venv` before pytest; the
# tests marked llama_cpp skip cleanly without it.
set -euo pipefail

VERSION=0.3.36
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${PLAMO2_LLAMA_CPP_CACHE:-$HOME/.cache/plamo2-tools/llama-cpp-python-$VERSION}
VENV=""
[[ -x "$REPO/.venv/bin/python" ]] && VENV=$REPO/.venv
TOOLS=0
while [[ $# -gt 0 ]]; do
    case "$1" in
    --install-into) VENV=$2; shift 2 ;;
    --install-into=*) VENV=${1#--install-into=}; shift ;;
    --tools) TOOLS=1; shift ;;
    --cache) CACHE=$2; shift 2 ;;
    -h | --help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "llama_cpp: unknown argument $1" >&2; exit 2 ;;
    esac
done
PY=${VENV:+$VENV/bin/python}
PY=${PY:-python3}
SDIST=$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz
TREE=$CACHE/src/llama_cpp_python-$VERSION
# No multimodal library (LLAVA_BUILD=OFF): nothing here loads it, and it is a quarter of the build.
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
JOBS=$(nproc)

if [[ "$(head -1 "$CACHE/.ready" 2>/dev/null)" != "llama-cpp-python==$VERSION" ]]; then
    mkdir -p "$CACHE/sdist" "$CACHE/src" "$CACHE/wheels"
    avail_kb=$(df -Pk "$CACHE" | awk 'NR==2 {print $4}')
    if ((avail_kb < 3 * 1024 * 1024)); then
        echo "llama_cpp: need ~3 GB free at $CACHE for the build, have $((avail_kb / 1024)) MB" >&2
        exit 3
    fi
    [[ -f "$SDIST" ]] || "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" \
        -d "$CACHE/sdist"
    [[ -f "$TREE/vendor/llama.cpp/convert_hf_to_gguf.py" ]] || tar -xzf "$SDIST" -C "$CACHE/src"
    echo "llama_cpp: building llama-cpp-python $VERSION for the CPU ($CMAKE_FLAGS, $JOBS jobs; an hour on 2 busy cores) ..." >&2
    t0=$(date +%s)
    rm -f "$CACHE"/wheels/*.whl
    CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip wheel -q --no-deps -w "$CACHE/wheels" "$SDIST"
    t1=$(date +%s)
    ls "$CACHE"/wheels/llama_cpp_python-"$VERSION"-*.whl >/dev/null
    printf 'llama-cpp-python==%s\nbuild_seconds=%s\ncmake_args=%s\nbuilt_at=%s\n' "$VERSION" "$((t1 - t0))" \
        "$CMAKE_FLAGS" "$(date -u +%FT%TZ)" >"$CACHE/.ready"
    echo "llama_cpp: built in $((t1 - t0)) s" >&2
fi

if [[ -n "$VENV" ]]; then
    "$VENV/bin/python" -m pip install -q "$CACHE"/wheels/llama_cpp_python-"$VERSION"-*.whl "gguf==0.19.0"
    "$VENV/bin/python" -c "import llama_cpp, gguf; assert llama_cpp.__version__ == '$VERSION', llama_cpp.__version__"
    echo "llama_cpp: llama-cpp-python $VERSION and gguf installed into $VENV" >&2
fi

if ((TOOLS)) && [[ "$(head -1 "$CACHE/tools/.ready" 2>/dev/null)" != "llama.cpp-tools==$VERSION" ]]; then
    echo "llama_cpp: building llama-quantize, llama-perplexity and llama-bench from the same tree ..." >&2
    t0=$(date +%s)
    cmake -S "$TREE/vendor/llama.cpp" -B "$CACHE/tools/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF >/dev/null
    cmake --build "$CACHE/tools/build" -j "$JOBS" --target llama-quantize llama-perplexity llama-bench >/dev/null
    mkdir -p "$CACHE/tools/bin"
    cp "$CACHE"/tools/build/bin/llama-{quantize,perplexity,bench} "$CACHE/tools/bin/"
    t1=$(date +%s)
    printf 'llama.cpp-tools==%s\nbuild_seconds=%s\n' "$VERSION" "$((t1 - t0))" >"$CACHE/tools/.ready"
    echo "llama_cpp: tools built in $((t1 - t0)) s: $CACHE/tools/bin (put it on PATH for k-quant exports)" >&2
fi
