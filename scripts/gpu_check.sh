#!/usr/bin/env bash
# The GPU check (one GPU, < 10 min): installs the gpu extra, runs tests/gpu with output shown.
set -euo pipefail
cd "$(dirname "$0")/.."
SAAF_EXTRA=gpu bash scripts/setup.sh
nvidia-smi -L
.venv/bin/python -m pytest tests/gpu -s -q -p no:cacheprovider 2>&1 | tee gpu-check.log
