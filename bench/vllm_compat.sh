#!/usr/bin/env bash
# Compatibility check against vLLM itself (issue 9): build vLLM 0.26.0's model class (Plamo2ForCausalLM or
# Plamo3ForCausalLM, as the checkpoint's config names it) on CPU per TP rank and compare what its HF loader and its
# ShardedStateLoader put into the model (bench/vllm_compat.py).
#
#   bench/vllm_compat.sh [--venv DIR] [--install-only] [HARNESS ARGS...]   (e.g. --presets plamo3 --dtype bfloat16)
#
# vLLM lives in its own venv OUTSIDE the repo (it pins its own torch, ~8 GB): $PLAMO2_VLLM_VENV, else
# ~/.cache/plamo2-tools/vllm-0.26.0. Created on first use, reused afterwards (a stamp file written only
# after a complete install and an import check marks it ready, so an interrupted install is resumed).
# Our package is NOT installed there: the harness drives synth/inspect/convert through the project's
# own CLI ($PLAMO2_TOOLS_CLI, else .venv/bin/plamo2-tools) and reads the shards with safetensors only.
set -euo pipefail

VLLM_VERSION=0.26.0 # the last release that ships Plamo2ForCausalLM (0.27 removed it)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PLAMO2_VLLM_VENV:-$HOME/.cache/plamo2-tools/vllm-$VLLM_VERSION}
CLI=${PLAMO2_TOOLS_CLI:-$REPO/.venv/bin/plamo2-tools}
INSTALL_ONLY=0
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#--venv=}; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    -h | --help) sed -n 2,12p "$0"; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
    esac
done
STAMP=$VENV/.plamo2-vllm-ready

if [[ "$(head -1 "$STAMP" 2>/dev/null)" != "vllm==$VLLM_VERSION" ]]; then
    mkdir -p "$(dirname "$VENV")"
    avail_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
    if ((avail_kb < 12 * 1024 * 1024)); then
        # The CUDA build of torch and vLLM's kernels unpack to ~8 GB; pip needs room for the wheels too.
        echo "vllm_compat: need ~12 GB free for the vLLM venv at $VENV, have $((avail_kb / 1024)) MB" >&2
        exit 3
    fi
    echo "vllm_compat: installing vllm==$VLLM_VERSION into $VENV (~8 GB, ~10 min) ..." >&2
    t0=$(date +%s)
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    # pip's own resolver picks vLLM's pinned torch (2.11.0, CUDA build from PyPI: the CPU-only host
    # never runs a CUDA kernel, vLLM's CpuPlatform is forced by the harness).
    "$VENV/bin/python" -m pip install -q "vllm==$VLLM_VERSION"
    "$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__"
    t1=$(date +%s)
    printf 'vllm==%s\ninstall_seconds=%s\ninstalled_at=%s\n' "$VLLM_VERSION" "$((t1 - t0))" "$(date -u +%FT%TZ)" \
        >"$STAMP"
    echo "vllm_compat: installed in $((t1 - t0)) s; $(du -sh "$VENV" | cut -f1) on disk" >&2
fi

((INSTALL_ONLY)) && exit 0
if [[ ! -x "$CLI" ]]; then
    echo "vllm_compat: project CLI not found at $CLI (set PLAMO2_TOOLS_CLI)" >&2
    exit 2
fi
exec "$VENV/bin/python" "$REPO/bench/vllm_compat.py" --plamo2-tools "$CLI" "${ARGS[@]}"
