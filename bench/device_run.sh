#!/usr/bin/env bash
# One call on the lent GPU machine (see bench/README.md): install the carried wheels, run the GPU
# tests against the carried tiny bundle, then bench/gpu_check.py on the carried reference bundle.
# Everything worth keeping lands in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/pipeline PYTHONUNBUFFERED=1 DUALTRACK_CACHE_DIR=/tmp/dtcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
echo "commit ${DUALTRACK_COMMIT:-unknown}"
step=${1:-all}
if [ "$step" = all ] || [ "$step" = test ]; then
  for t in tests/gpu/test_engine_gpu.py tests/gpu/test_runtime_gpu.py; do
    DUALTRACK_TEST_BUNDLE=$PWD/.carry/tiny python3 -m pytest -q -m gpu "$t" -p no:cacheprovider -rfE --tb=short 2>&1 | tee -a "$OUT/gpu-test.log"
  done
fi
if [ "$step" = all ] || [ "$step" = check ]; then
  python3 bench/gpu_check.py --bundle .carry/unet --image .carry/sample.png --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
fi
