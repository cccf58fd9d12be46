#!/usr/bin/env bash
# Run on a lent GPU machine, from the repository root, with .device/ carried (scripts/device_bundle.sh):
#   bash scripts/device_checks.sh         # both, in one call of under 8 minutes on one H100 (4.4 minutes measured with one bench variant; the second, kernels, is cut off at CHECKS_TIMEOUT_S if it runs long)
#   bash scripts/device_checks.sh tests   # tests/test_gpu.py (about 1 minute)
#   bash scripts/device_checks.sh bench   # `raytool bench trainer` on a Qwen2.5-1.5B-shaped model (about 3 minutes a variant)
# The tests stop after TESTS_TIMEOUT_S seconds, and the bench when CHECKS_TIMEOUT_S have passed since
# the start, so that a call with a 10-minute limit comes back with what finished. BENCH_VARIANTS
# picks the bench's variants (default: "default kernels", the device's auto settings, then the same
# with trainer.kernels on; also mbt4096, nockpt: see tests/helpers/gpu_trainer_bench.py). Results go to $OUT (or ./device-out): gpu.txt,
# test_gpu.log, trainer_bench.log, and one JSON object per bench variant in trainer_bench.jsonl,
# written as each variant finishes.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-device-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl
export RAYTOOL_CACHE="$PWD/.device/cache" HF_HUB_OFFLINE=1 PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout -k 10 "${TESTS_TIMEOUT_S:-210}" python3 -m pytest -p no:cacheprovider -q -rs --durations=8 tests/test_gpu.py 2>&1 |
    tee "$out/test_gpu.log" | tail -25
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  left=$(( ${CHECKS_TIMEOUT_S:-450} - SECONDS )); [ "$left" -gt 30 ] || left=30  # timeout 0 would mean none
  echo "trainer bench: ${left} s left"
  # shellcheck disable=SC2086
  timeout -k 10 "$left" python3 tests/helpers/gpu_trainer_bench.py "$out/trainer_bench.jsonl" ${BENCH_VARIANTS:-default kernels} 2>&1 |
    tee "$out/trainer_bench.log"
  cat "$out/trainer_bench.jsonl" 2>/dev/null
fi
