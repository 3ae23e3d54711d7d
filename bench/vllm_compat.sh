#!/usr/bin/env bash
# Compatibility check against vLLM itself (issues 9, 31): build vLLM's model class (Plamo2ForCausalLM or
# Plamo3ForCausalLM, as the checkpoint's config names it) on CPU per TP rank and compare what its HF loader and its
# ShardedStateLoader put into the model (bench/vllm_compat.py).
#
#   bench/vllm_compat.sh [--vllm-version V] [--venv DIR] [--install-only] [--skip-dep PKG]... [HARNESS ARGS...]
#       e.g. --vllm-version 0.34.0 --skip-dep flashinfer-python --presets plamo3 --dtype bfloat16
#
# --vllm-version (or $PLAMO2_VLLM_VERSION): 0.26.0 by default, the last release with Plamo2ForCausalLM (0.27 removed
# it); PLaMo 3 users are on the newest (0.34.0 when this was written: `pip index versions vllm`). --skip-dep PKG
# installs vLLM's requirements without PKG (a GPU-kernel pin the index lacks, e.g. 0.34.0's flashinfer-python==0.7.3).
# vLLM lives in its own venv OUTSIDE the repo (it pins its own torch, ~8 GB), one per version: $PLAMO2_VLLM_VENV, else
# ~/.cache/plamo2-tools/vllm-$VERSION. Created on first use, reused afterwards (a stamp file written only
# after a complete install and an import check marks it ready, so an interrupted install is resumed).
# Our package is NOT installed there: the harness drives synth/inspect/convert through the project's
# own CLI ($PLAMO2_TOOLS_CLI, else .venv/bin/plamo2-tools) and reads the shards with safetensors only.
set -euo pipefail

VLLM_VERSION=${PLAMO2_VLLM_VERSION:-0.26.0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PLAMO2_VLLM_VENV:-}
CLI=${PLAMO2_TOOLS_CLI:-$REPO/.venv/bin/plamo2-tools}
INSTALL_ONLY=0
SKIP_DEPS=()
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --vllm-version) VLLM_VERSION=$2; shift 2 ;;
    --vllm-version=*) VLLM_VERSION=${1#--vllm-version=}; shift ;;
    --venv) VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#--venv=}; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --skip-dep) SKIP_DEPS+=("$2"); shift 2 ;;
    -h | --help) sed -n 2,16p "$0"; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
    esac
done
if [[ ! "$VLLM_VERSION" =~ ^[0-9]+(\.[0-9]+)*(\.post[0-9]+)?$ ]]; then
    echo "vllm_compat: --vllm-version must be a release number like 0.34.0, not '$VLLM_VERSION'" >&2
    exit 2
fi
VENV=${VENV:-$HOME/.cache/plamo2-tools/vllm-$VLLM_VERSION}
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
    # pip's own resolver picks vLLM's pinned torch (0.26: 2.11.0, 0.34: 2.14.0; the CUDA build from PyPI: the
    # CPU-only host never runs a CUDA kernel, vLLM's CpuPlatform is forced by the harness).
    if ((${#SKIP_DEPS[@]} == 0)); then
        "$VENV/bin/python" -m pip install -q "vllm==$VLLM_VERSION"
    else
        # A pin the index cannot satisfy (vLLM 0.34.0 pins flashinfer-python==0.7.3, which is not on PyPI's index
        # here: "No matching distribution found"): install vLLM's own requirement list without the named
        # packages, then vLLM itself without dependencies. Only for GPU-kernel packages the CPU loaders never import.
        dl=$(mktemp -d)
        trap 'rm -rf "$dl"' EXIT
        "$VENV/bin/python" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$dl"
        "$VENV/bin/python" - "$dl" "${SKIP_DEPS[@]}" <<'PY'
import re, sys, zipfile
from pathlib import Path
dl, skip = Path(sys.argv[1]), {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2:]}
(wheel,) = dl.glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
keep = [r for r in reqs if "extra ==" not in r and re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", r)[0]).lower() not in skip]
missing = skip - {re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", r)[0]).lower() for r in reqs}
if missing:
    sys.exit(f"vllm_compat: --skip-dep {', '.join(sorted(missing))}: not a requirement of {wheel.name}")
(dl / "requirements.txt").write_text("\n".join(keep) + "\n")
PY
        "$VENV/bin/python" -m pip install -q -r "$dl/requirements.txt"
        "$VENV/bin/python" -m pip install -q --no-deps "$dl"/vllm-*.whl
    fi
    "$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__"
    t1=$(date +%s)
    printf 'vllm==%s\ninstall_seconds=%s\ninstalled_at=%s\nskipped_deps=%s\n' "$VLLM_VERSION" "$((t1 - t0))" \
        "$(date -u +%FT%TZ)" "${SKIP_DEPS[*]}" >"$STAMP"
    echo "vllm_compat: installed in $((t1 - t0)) s; $(du -sh "$VENV" | cut -f1) on disk" >&2
fi

((INSTALL_ONLY)) && exit 0
if [[ ! -x "$CLI" ]]; then
    echo "vllm_compat: project CLI not found at $CLI (set PLAMO2_TOOLS_CLI)" >&2
    exit 2
fi
exec "$VENV/bin/python" "$REPO/bench/vllm_compat.py" --plamo2-tools "$CLI" "${ARGS[@]}"
