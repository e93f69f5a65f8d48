#!/usr/bin/env bash
# Issue 17's GPU run, one command, < 5 min: install the carried nixl-cu13 wheel (--no-deps, into a
# scratch --target dir; the box has torch and numpy, no internet), then run benchmarks/gpu_nixl.py under
# a hard time limit. Results: $OUT/gpu_nixl.json (rewritten after every step), gpu_nixl.md, gpu_nixl.log.
#   OUT=/some/dir bash scripts/gpu_nixl.sh [extra benchmarks.gpu_nixl flags]
# Env: PYTHON (default python3), SAAF_NIXL_WHEEL (default: the wheel under shared/wheels/ or .whl/),
#      SAAF_GPU_LIMIT_S (hard limit for the benchmark, default 270), SAAF_GPU_BUDGET_S (default 210).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu_nixl}
PY=${PYTHON:-python3}
SITE=${SAAF_NIXL_SITE:-/tmp/saaf-nixl-site}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_nixl.log") 2>&1
t0=$(date +%s)
echo "== $(date -Is) $(uname -n) python=$($PY -V 2>&1) repo=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi -L 2>&1 || echo "no nvidia-smi"
WHEEL=${SAAF_NIXL_WHEEL:-$(ls shared/wheels/nixl_cu13-*.whl .whl/nixl_cu13-*.whl 2>/dev/null | head -1)}
if [ -n "$WHEEL" ] && [ -f "$WHEEL" ]; then
    echo "== installing $WHEEL ($(stat -c %s "$WHEEL") bytes) into $SITE"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL" \
        || echo "!! pip install of $WHEEL failed: the nixl step will say so"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "!! no nixl_cu13 wheel found (shared/wheels/ or .whl/, or set SAAF_NIXL_WHEEL): using any nixl installed"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "== install took $(( $(date +%s) - t0 )) s"
export PYTHONUNBUFFERED=1
# NOTE: loopback only (project rule); UCX prints which transport carries each kind of transfer.
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}
# NOTE: timeout signals the whole process group it starts, so the NIXL child processes go too.
timeout -k 10 "${SAAF_GPU_LIMIT_S:-270}" "$PY" -m benchmarks.gpu_nixl --out "$OUT" \
    --budget-s "${SAAF_GPU_BUDGET_S:-210}" "$@"
rc=$?
echo "== benchmarks.gpu_nixl exit $rc after $(( $(date +%s) - t0 )) s; files in $OUT:"
ls -l "$OUT"
exit $rc
