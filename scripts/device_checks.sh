#!/usr/bin/env bash
# Run on a lent GPU machine, from the repository root, with .device/ carried (scripts/device_bundle.sh):
#   bash scripts/device_checks.sh tests   # tests/test_gpu.py (about 2 minutes)
#   bash scripts/device_checks.sh bench   # `raytool bench trainer` on a Qwen2.5-1.5B-shaped model (about 5 minutes a variant)
#   bash scripts/device_checks.sh         # both
# Two calls keep each under the device's 10-minute command limit. BENCH_VARIANTS picks the bench's
# variants (default: "default", the device's auto settings; also mbt4096, nockpt: see
# tests/helpers/gpu_trainer_bench.py). Results go to $OUT (or ./device-out): gpu.txt, test_gpu.log,
# and one JSON object per bench variant in trainer_bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-device-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl
export RAYTOOL_CACHE="$PWD/.device/cache" HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | tail -25
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  # shellcheck disable=SC2086
  python3 tests/helpers/gpu_trainer_bench.py "$out/trainer_bench.jsonl" ${BENCH_VARIANTS:-default}
fi
