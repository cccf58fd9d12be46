#!/usr/bin/env bash
# Prepare .device/ for a lent GPU machine, which has PyTorch, transformers and peft but reaches no
# package registry and takes at most 64 MiB (Ray and vLLM do not travel): the wheels raytool's
# trainer-side code and the GPU tests need beyond that machine's packages, and the tiny test model.
# The tracked tree travels by itself; carry this folder with the run (carry: [".device"]) and run
#   bash scripts/device_checks.sh
# there. Needs this checkout's .venv (./scripts/setup.sh) and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device
mkdir -p .device/wheels .device/cache/models
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d .device/wheels msgspec pyzmq xxhash pytest pluggy iniconfig packaging pygments liger-kernel==0.8.5
.venv/bin/python -c "from raytool.models import resolve_model; print(resolve_model('tiny-random'))" |
  xargs -I{} cp -r {} .device/cache/models/
du -sh .device
