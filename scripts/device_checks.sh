#!/usr/bin/env bash
# Run on a lent GPU machine, from the repository root, with .device/ carried (scripts/device_bundle.sh):
# the GPU tests, then `raytool bench trainer` on a Qwen2.5-1.5B-shaped model at the device's default
# settings and at 4,096-token micro-batches. Results go to $OUT (or ./device-out): pytest's log
# and one JSON object per bench variant (trainer_bench.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl
export RAYTOOL_CACHE="$PWD/.device/cache" HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | tail -25
python3 tests/helpers/gpu_trainer_bench.py "$out/trainer_bench.jsonl" ${BENCH_VARIANTS:-default mbt4096}
