#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, then run the steps named on the
# command line (default: all) — `test` (GPU tests on the carried tiny bundle), `check`
# (bench/gpu_check.py on the reference bundle), `serve` (the service under the load test),
# `bench` (bench/bench.py: dualtrack against PyTorch). Everything worth keeping lands in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/pipeline PYTHONUNBUFFERED=1 DUALTRACK_CACHE_DIR=/tmp/dtcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=.carry
# Bundles of the same model share model.onnx: it travels once (the 64 MiB carry limit).
for b in "$C"/unet_seed_split "$C"/iree_only; do [ -d "$b" ] && [ ! -f "$b/model.onnx" ] && cp "$C/unet/model.onnx" "$b/"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
echo "commit ${DUALTRACK_COMMIT:-unknown}"
dt() { python3 -c 'from dualtrack.cli import main; main()' "$@"; }
steps=${*:-test check serve bench}
for step in $steps; do
  echo "=== $step"
  case $step in
    test)
      DUALTRACK_TEST_BUNDLE=$PWD/$C/tiny DUALTRACK_TEST_FULL_BUNDLE=$PWD/$C/tiny_full \
        make gpu-test PYTHON=python3 2>&1 | tee -a "$OUT/gpu-test.log" ;;
    check)
      python3 bench/gpu_check.py --bundle $C/unet --image $C/sample.png --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
      dt run $C/unet $C/sample.png -o /tmp/sample_mask_cli.png --device cuda 2>&1 | tee -a "$OUT/gpu_check.log"
      dt doctor --bundle $C/unet 2>&1 | tee -a "$OUT/gpu_check.log"
      dt verify $C/unet --device cuda --samples 2 2>&1 | tail -3 | tee -a "$OUT/gpu_check.log" ;;
    serve)
      dt serve $C/unet --device cuda --port 8087 > /tmp/serve.log 2>&1 &
      pid=$!
      get() { python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }
      for _ in $(seq 120); do get http://127.0.0.1:8087/readyz >/dev/null 2>&1 && break; sleep 1; done
      # Worst case: a 512 KB noisy PNG in, the mask PNG out. Then a JPEG photo in, JSON counts out.
      dt loadtest http://127.0.0.1:8087/v1/segment --image $C/sample.png --concurrency 16 --requests 3000 --duration-s 30 --json "$OUT/loadtest.json"
      dt loadtest "http://127.0.0.1:8087/v1/segment?format=json" --image $C/sample.jpg --concurrency 16 --requests 6000 --duration-s 30 --json "$OUT/loadtest_json.json"
      get http://127.0.0.1:8087/metrics > "$OUT/metrics.txt"
      grep -E "^dualtrack_(batch_size|padded|inference_seconds)_(sum|count|total)|^dualtrack_padded" "$OUT/metrics.txt"
      kill -TERM $pid; wait $pid ;;
    bench)
      python3 bench/bench.py --bundle $C/unet --seed-split-bundle $C/unet_seed_split --iree-only-bundle $C/iree_only \
        --batches 1 8 --iters 50 --skip-autotune --commit "${DUALTRACK_COMMIT:-unknown}" --out "$OUT" 2>&1 | tee /tmp/bench.log ;;
  esac
done
