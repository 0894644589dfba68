#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, then run the steps named on the
# command line (default: all) — `test` (GPU tests on the carried tiny bundle), `check`
# (bench/gpu_check.py on the reference bundle), `serve` (bench/serve_bench.py: the service under
# the load test, against the engine alone), `bench` (bench/bench.py: dualtrack against PyTorch);
# `zoo` when named (bench/zoo_bench.py: the carried zoo bundles against PyTorch); `ray` when named
# (bench/ray_install.sh, then the Ray Serve application under the load test).
# Everything worth keeping lands in $OUT.
set -uo pipefail
# The lent machine's /tmp survives between calls while it stays warm (not the repository's copy):
# a call without wheels in .whl/ reuses what an earlier call installed into /tmp/site, and a call
# without .carry/ the one an earlier call kept in /tmp/keep (the `keep` step).
if compgen -G ".whl/*.whl" >/dev/null || [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -e .carry ] || [ -e .carry.tar.xz ] || [ ! -d /tmp/keep/.carry ] || ln -s /tmp/keep/.carry .carry
export PYTHONPATH=/tmp/site:$PWD/pipeline PYTHONUNBUFFERED=1 DUALTRACK_CACHE_DIR=/tmp/dtcache
# compute-sanitizer (tests/gpu/test_replay_gpu.py runs the replay under memcheck) is in the image's toolkit.
export PATH=$PATH:/usr/local/cuda/bin:/tmp/tools/bin  # and py-spy (.whl2, installed into /tmp/tools)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=.carry
# The bundles may travel as one archive (PTX compresses 10x; the carry limit is 64 MiB):
# `tar -cf - .carry | xz > .carry.tar.xz` here, carry [".whl", ".carry.tar.xz"].
[ -f .carry.tar.xz ] && { rm -rf "$C"; tar -xJf .carry.tar.xz || exit 1; }
# Bundles of the same model share model.onnx and weights.bin: they travel once (the 64 MiB carry limit).
for b in "$C"/unet_seed_split "$C"/iree_only "$C"/unet_*; do [ -d "$b" ] && [ ! -f "$b/weights.bin" ] && cp "$C/unet/model.onnx" "$C/unet/weights.bin" "$b/"; done
# An IREE-only zoo variant (.carry/zoo/<zoo>.iree_only/<v>) of the zoo bundle's precision: its model.onnx and weights.bin.
for v in "$C"/zoo/*.iree_only/*; do [ -d "$v" ] && [ ! -f "$v/model.onnx" ] && z=$(dirname "$v" | sed 's/\.iree_only$//') && cp "$z/model.onnx" "$v/"; done
for v in "$C"/zoo/*.iree_only/*; do [ -d "$v" ] && [ ! -f "$v/weights.bin" ] && [ -f "$(dirname "$v" | sed 's/\.iree_only$//')/weights.bin" ] && cp "$(dirname "$v" | sed 's/\.iree_only$//')/weights.bin" "$v/"; done
# A corpus bundle sealed by bench/reweight.py travels without weights.bin and reference cases: grow them here.
for z in "$C"/zoo/*/weights.regrow.npz; do
  [ -f "$z" ] || continue; z=$(dirname "$z"); [ -f "$z/weights.bin" ] && [ -f "$z/verify/cases.npz" ] && continue
  [ -z "${ZOO_ONLY:-}" ] || [[ " $ZOO_ONLY " == *" $(basename "$z") "* ]] || continue  # the models this call runs
  PYTHONPATH=/tmp/site:$PWD/pipeline python3 bench/reweight.py regrow "$z" $(ls -d "$z.iree_only"/*/ 2>/dev/null) || exit 1
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
echo "commit ${DUALTRACK_COMMIT:-unknown}"
dt() { python3 -c 'from dualtrack.cli import main; main()' "$@"; }
# bench/serve_bench.py on BUNDLE with the carried sample images, writing into $OUT: serve_bench BUNDLE [ARGS...]
serve_bench() { local b=$1; shift; python3 bench/serve_bench.py --bundle "$b" --png $C/sample.png --jpg $C/sample.jpg \
  --out "$OUT" --commit "${DUALTRACK_COMMIT:-unknown}" "$@"; }
steps=${*:-test check serve bench}
for step in $steps; do
  echo "=== $step"
  case $step in
    keep)
      # Not in the default steps. Keeps .carry/ in /tmp/keep for the next calls, and every carried
      # part .parts*/NAME.partN (a file too big for one call's carry, `split` here) in /tmp/keep/parts;
      # once all parts of NAME are there (NAME.count says how many), NAME (a tar) is unpacked into .carry/.
      mkdir -p /tmp/keep/parts
      [ -d .carry ] && [ ! -L .carry ] && { rm -rf /tmp/keep/.carry; cp -r .carry /tmp/keep/.carry; }
      for f in .parts*/*; do [ -f "$f" ] && cp "$f" /tmp/keep/parts/; done
      for count in /tmp/keep/parts/*.count; do
        [ -f "$count" ] || continue
        name=${count%.count}; n=$(cat "$count")
        have=$(ls "$name".part* 2>/dev/null | wc -l)
        echo "parts of $(basename "$name"): $have of $n"
        if [ "$have" = "$n" ]; then
          cat "$name".part* | tar -x -C /tmp/keep/.carry && rm -f "$name".part* "$count"
        fi
      done
      ls /tmp/keep/.carry /tmp/keep/.carry/zoo 2>/dev/null ;;
    test)
      # tiny_tuned (tests/conftest.py build_tiny_tuned): the tiny fp16 U-Net built with a tuning file;
      # tiny_wgmma (build_tiny_wgmma): a base-32 fp16 U-Net whose convs the sm_90a wgmma kernel takes.
      [ -d "$C/tiny_tuned" ] && export DUALTRACK_TEST_TUNED_BUNDLE=$PWD/$C/tiny_tuned
      [ -d "$C/tiny_wgmma" ] && export DUALTRACK_TEST_WGMMA_BUNDLE=$PWD/$C/tiny_wgmma
      # tiny_mobile (tests/mobile_net.py): a MobileNetV3-like fp16 net, its body on the mobile kernels.
      [ -d "$C/tiny_mobile" ] && export DUALTRACK_TEST_MOBILE_BUNDLE=$PWD/$C/tiny_mobile
      # tiny_head (tests/conftest.py build_tiny_head): the tiny fp16 U-Net whose plan ends in the seghead kernel.
      [ -d "$C/tiny_head" ] && export DUALTRACK_TEST_HEAD_BUNDLE=$PWD/$C/tiny_head
      # tiny_fixed (tests/gpu/test_fixed_shape_gpu.py build_fixed_bundle): a `batch: fixed` model, IREE alone.
      [ -d "$C/tiny_fixed" ] && export DUALTRACK_TEST_FIXED_BUNDLE=$PWD/$C/tiny_fixed
      # tiny_sizes (tests/gpu/test_sizes_gpu.py build_sized_bundle): a conv net built for 40x56 and 64x48.
      [ -d "$C/tiny_sizes" ] && export DUALTRACK_TEST_SIZES_BUNDLE=$PWD/$C/tiny_sizes
      # tiny_window (tests/window_net.py build_window_bundle): a conv net with `window:` (64x64 windows).
      [ -d "$C/tiny_window" ] && export DUALTRACK_TEST_WINDOW_BUNDLE=$PWD/$C/tiny_window
      # tiny_tokens (tests/gpu/test_token_ops_gpu.py build_token_bundle): a transformer block's token ops on Track A.
      [ -d "$C/tiny_tokens" ] && export DUALTRACK_TEST_TOKENS_BUNDLE=$PWD/$C/tiny_tokens
      # kit_tiny (`dualtrack tune tests/.../tiny.yaml --track-b --prepare-kit`): IREE flag candidates.
      [ -d "$C/kit_tiny" ] && export DUALTRACK_TEST_KIT=$PWD/$C/kit_tiny
      # iree_fp16/fixed (tests/iree_fp16_ops.py): single fp16 ops as Track B compiles them for CUDA.
      [ -d "$C/iree_fp16/fixed" ] && export DUALTRACK_TEST_IREE_FP16_KIT=$PWD/$C/iree_fp16/fixed
      DUALTRACK_TEST_BUNDLE=$PWD/$C/tiny DUALTRACK_TEST_FULL_BUNDLE=$PWD/$C/tiny_full \
        make gpu-test PYTHON=python3 2>&1 | tee -a "$OUT/gpu-test.log" ;;
    tune)
      # Not in the default steps: `bash bench/device_run.sh tune`. `dualtrack tune` on the reference
      # bundle's plan (there is no models/ here); NVRTC and nvJitLink come from the image's wheels.
      dt tune $C/unet -o "$OUT/tuning-h200.json" 2>&1 | tee "$OUT/tune.log" ;;
    tuneb)
      # IREE flag search on the kits prepared here (`dualtrack tune CONFIG --track-b --prepare-kit
      # .carry/kit_X`); they travel without model.onnx, which the reference bundle has (same hash).
      for k in "$C"/kit_unet* "$C"/kit_seed; do
        [ -d "$k" ] || continue
        [ -f "$k/model.onnx" ] || cp "$C/unet/model.onnx" "$k/"
        dt tune "$k" --track-b -o "$OUT/tuning-h200.json" 2>&1 | tee -a "$OUT/tuneb.log"
      done ;;
    iree)
      # IREE runtime settings (allocator, inline execution, graphs): which makes Track B cheapest.
      python3 bench/iree_runtime.py --bundle $C/unet --out "$OUT" 2>&1 | tee "$OUT/iree_runtime.log" ;;
    wgmma)
      # The standalone check of the sm_90a kernel (handwritten_ptx/conv3x3_wgmma.cu), then its layer
      # timings with the watchdog compiled out (wgmma_check_nowd.json): what the watchdog costs.
      python3 bench/wgmma/check.py 2>&1 | tee "$OUT/wgmma.log"
      python3 bench/wgmma/check.py --only N= --no-watchdog 2>&1 | tee "$OUT/wgmma_nowd.log" ;;
    check)
      python3 bench/gpu_check.py --bundle $C/unet --image $C/sample.png --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
      dt run $C/unet $C/sample.png -o /tmp/sample_mask_cli.png --device cuda 2>&1 | tee -a "$OUT/gpu_check.log"
      dt doctor --bundle $C/unet 2>&1 | tee -a "$OUT/gpu_check.log"
      dt verify $C/unet --device cuda --samples 2 2>&1 | tail -3 | tee -a "$OUT/gpu_check.log" ;;
    serve_gpu)
      # Not in the default steps (issue 15): JPEG -> JSON and PNG -> PNG at 16 and 32 clients on `serve
      # --workers 4 / 8` with the JPEGs decoded on the engine's GPU (nvImageCodec: its wheels, too big
      # to travel with the rest, installed into /tmp/site by an earlier call of this warm machine), the
      # same with --jpeg-decoder cpu, and one process with the GPU decoder.
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out jpeg_in_png_out png_in_png_out --tag gpu_decode --duration-s "${SERVE_S:-10}" \
        --variant "w4_gpu=--workers 4 --max-batch-delay-ms 8" --variant "w8_gpu=--workers 8 --max-batch-delay-ms 8" \
        --variant "w4_cpu=--workers 4 --max-batch-delay-ms 8 --jpeg-decoder cpu" \
        2>&1 | tee "$OUT/serve_gpu.log" ;;
    serve_lanes)
      # Not in the default steps (issue 15): the table of serve_gpu on `serve --workers 4` with 3 GPU JPEG
      # decode lanes (the default), then JPEG -> JSON with 2 and 5 (DUALTRACK_JPEG_LANES), side by side.
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out jpeg_in_png_out png_in_png_out --tag lanes --duration-s "${SERVE_S:-10}" \
        --variant "w4_gpu=--workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee "$OUT/serve_lanes.log"
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag lanes25 --duration-s "${SERVE_S:-10}" \
        --variant "w4_l2=DUALTRACK_JPEG_LANES=2 --workers 4 --max-batch-delay-ms 8" \
        --variant "w4_l5=DUALTRACK_JPEG_LANES=5 --workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee -a "$OUT/serve_lanes.log" ;;
    serve_rounds)
      # Not in the default steps (issue 15): the table of serve_gpu on `serve --workers 4` (3 decode lanes),
      # then JPEG -> JSON on the same server twice more (rounds b, c): the call's own spread beside the table.
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out jpeg_in_png_out png_in_png_out --tag rounds --duration-s "${SERVE_S:-10}" \
        --variant "w4_gpu=--workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee "$OUT/serve_rounds.log"
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag rounds_bc --duration-s "${SERVE_S:-10}" \
        --variant "w4_gpu_b=--workers 4 --max-batch-delay-ms 8" --variant "w4_gpu_c=--workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee -a "$OUT/serve_rounds.log" ;;
    serve_pin)
      # Not in the default steps (issue 15): JPEG -> JSON at 16 and 32 clients on `serve --workers 4`, the
      # defaults against DUALTRACK_PIN_SLOTS=0 (masks through host copies) and DUALTRACK_JPEG_AHEAD_MB=12
      # (about the former bound of 16 decoded 512x512 pictures), in two alternating rounds.
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag pin --duration-s "${SERVE_S:-10}" \
        --variant "w4_a=--workers 4 --max-batch-delay-ms 8" \
        --variant "w4_nopin_a=DUALTRACK_PIN_SLOTS=0 --workers 4 --max-batch-delay-ms 8" \
        --variant "w4_ahead12_a=DUALTRACK_JPEG_AHEAD_MB=12 --workers 4 --max-batch-delay-ms 8" \
        --variant "w4_b=--workers 4 --max-batch-delay-ms 8" \
        --variant "w4_nopin_b=DUALTRACK_PIN_SLOTS=0 --workers 4 --max-batch-delay-ms 8" \
        --variant "w4_ahead12_b=DUALTRACK_JPEG_AHEAD_MB=12 --workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee "$OUT/serve_pin.log" ;;
    serve_light)
      # Not in the default steps: light load (1 and 4 clients, JPEG -> JSON) on `serve --workers 4
      # --max-batch-delay-ms 8`, full batches only (the default) against --batches-in-flight 1 (a batch starts
      # with the rows it has while the engine has none): the latency a lone request pays for the batch delay.
      V="--workers 4 --max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 1 4 --only-variants --cases jpeg_in_json_out --tag light --duration-s "${SERVE_S:-5}" --iters 30 \
        --variant "k0=$V" --variant "k1=$V --batches-in-flight 1" \
        2>&1 | tee "$OUT/serve_light.log" ;;
    serve_gil)
      # Not in the default steps (issue 15): the driver's enqueue calls keeping the GIL (runtime/driver.py
      # HeldCalls, the default) against cuda-python's release (DUALTRACK_HOLD_GIL=0), JPEG -> JSON at 16 and
      # 32 clients on `serve --workers 4`, in three alternating rounds.
      V="--workers 4 --max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag gil --duration-s "${SERVE_S:-10}" \
        --variant "hold_a=$V" --variant "release_a=DUALTRACK_HOLD_GIL=0 $V" \
        --variant "release_b=DUALTRACK_HOLD_GIL=0 $V" --variant "hold_b=$V" \
        --variant "hold_c=$V" --variant "release_c=DUALTRACK_HOLD_GIL=0 $V" \
        2>&1 | tee "$OUT/serve_gil.log" ;;
    serve_inflight)
      # Not in the default steps (issue 15): the batching policy `--batches-in-flight K` (a batch starts with
      # the rows it has while fewer than K batches are in the engine) on `serve --workers 4`, JPEG -> JSON at
      # 16 and 32 clients, in two alternating rounds: the reference bundle (batch sizes 1, 8) with K = 0 (the
      # default: full batches) and K = 2, and unet_batches (1, 2, 4, 8; its engine alone at each size) with K = 1, 2.
      V="--workers 4 --max-batch-delay-ms 8"
      serve_bench $C/unet_batches \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag inflight --duration-s "${SERVE_S:-10}" \
        --variant "k0_a=--bundle $C/unet $V" --variant "k2_18_a=--bundle $C/unet $V --batches-in-flight 2" \
        --variant "k1_a=$V --batches-in-flight 1" --variant "k2_a=$V --batches-in-flight 2" \
        --variant "k0_b=--bundle $C/unet $V" --variant "k2_18_b=--bundle $C/unet $V --batches-in-flight 2" \
        --variant "k1_b=$V --batches-in-flight 1" --variant "k2_b=$V --batches-in-flight 2" \
        2>&1 | tee "$OUT/serve_inflight.log" ;;
    serve_balance)
      # Not in the default steps (issue 15): the engine process handing each HTTP connection to the worker
      # holding the fewest (serve/workers.py, the default) against uvicorn's workers racing for them on one
      # socket (DUALTRACK_BALANCE_WORKERS=0), JPEG -> JSON at 16 and 32 clients on `serve --workers 4`, in
      # three alternating rounds; each run records how its connections were spread (connections_per_process).
      # BALANCE_CASE=png_in_png_out: the same for 512 KB PNGs -> mask PNG (decoded on the workers' CPUs).
      V="--workers 4 --max-batch-delay-ms 8"
      case=${BALANCE_CASE:-jpeg_in_json_out}
      serve_bench $C/unet --clients 16 32 --only-variants --cases "$case" --tag "balance${case%%_*}" \
        --duration-s "${SERVE_S:-10}" \
        --variant "balanced_a=$V" --variant "race_a=DUALTRACK_BALANCE_WORKERS=0 $V" \
        --variant "race_b=DUALTRACK_BALANCE_WORKERS=0 $V" --variant "balanced_b=$V" \
        --variant "balanced_c=$V" --variant "race_c=DUALTRACK_BALANCE_WORKERS=0 $V" \
        2>&1 | tee "$OUT/serve_balance_$case.log" ;;
    serve_nworkers)
      # Not in the default steps (issue 15): how many HTTP processes in front of the engine (`serve --workers
      # 2 / 3 / 4`, each connection handed to the one holding the fewest): JPEG -> JSON at 16 and 32 clients,
      # two rounds in mirrored order. Fewer workers: fewer connection threads in the engine process.
      V="--max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag nworkers --duration-s "${SERVE_S:-10}" \
        --variant "w2_a=--workers 2 $V" --variant "w3_a=--workers 3 $V" --variant "w4_a=--workers 4 $V" \
        --variant "w4_b=--workers 4 $V" --variant "w3_b=--workers 3 $V" --variant "w2_b=--workers 2 $V" \
        2>&1 | tee "$OUT/serve_nworkers.log" ;;
    serve_answers)
      # Not in the default steps (issue 15): answers written into the slots, each worker woken by a shared
      # semaphore (the default), against answers as messages (DUALTRACK_SLOT_ANSWERS=0), on `--workers 2` and
      # 3: JPEG -> JSON at 16 and 32 clients, two rounds in mirrored order.
      V="--max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag answers --duration-s "${SERVE_S:-10}" \
        --variant "slot2_a=--workers 2 $V" --variant "msg2_a=DUALTRACK_SLOT_ANSWERS=0 --workers 2 $V" \
        --variant "slot3_a=--workers 3 $V" --variant "msg3_a=DUALTRACK_SLOT_ANSWERS=0 --workers 3 $V" \
        --variant "msg3_b=DUALTRACK_SLOT_ANSWERS=0 --workers 3 $V" --variant "slot3_b=--workers 3 $V" \
        --variant "msg2_b=DUALTRACK_SLOT_ANSWERS=0 --workers 2 $V" --variant "slot2_b=--workers 2 $V" \
        2>&1 | tee "$OUT/serve_answers.log" ;;
    serve_answers2)
      # Not in the default steps (issue 15): serve_answers' `--workers 2` pair again, two more rounds in mirrored order.
      V="--workers 2 --max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag answers2 --duration-s "${SERVE_S:-10}" \
        --variant "slot2_c=$V" --variant "msg2_c=DUALTRACK_SLOT_ANSWERS=0 $V" \
        --variant "msg2_d=DUALTRACK_SLOT_ANSWERS=0 $V" --variant "slot2_d=$V" \
        2>&1 | tee "$OUT/serve_answers2.log" ;;
    wake)
      # Not in the default steps (issue 15): what one hand-over between threads and between processes costs.
      python3 bench/wake_probe.py --out "$OUT" --commit "${DUALTRACK_COMMIT:-unknown}" 2>&1 | tee "$OUT/wake.log" ;;
    serve_signals)
      # Not in the default steps (issue 15): the GPU marking each answer in its slot and waking its worker
      # (Engine.signal, the default) against the collector thread doing it (DUALTRACK_GPU_SIGNALS=0), on
      # `--workers 2`: JPEG -> JSON at 16 and 32 clients, three rounds in mirrored order.
      V="--workers 2 --max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag signals --duration-s "${SERVE_S:-10}" \
        --variant "gpu_a=$V" --variant "cpu_a=DUALTRACK_GPU_SIGNALS=0 $V" \
        --variant "cpu_b=DUALTRACK_GPU_SIGNALS=0 $V" --variant "gpu_b=$V" \
        --variant "gpu_c=$V" --variant "cpu_c=DUALTRACK_GPU_SIGNALS=0 $V" \
        2>&1 | tee "$OUT/serve_signals.log" ;;
    serve_nworkers2)
      # Not in the default steps (issue 15): with the GPU marking the answers, how many workers: JPEG -> JSON
      # at 16 and 32 clients on `--workers 2`, 3 and 4, two rounds in mirrored order.
      V="--max-batch-delay-ms 8"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag nworkers2 --duration-s "${SERVE_S:-10}" \
        --variant "w2_a=--workers 2 $V" --variant "w3_a=--workers 3 $V" --variant "w4_a=--workers 4 $V" \
        --variant "w4_b=--workers 4 $V" --variant "w3_b=--workers 3 $V" --variant "w2_b=--workers 2 $V" \
        2>&1 | tee "$OUT/serve_nworkers2.log" ;;
    serve_vs)
      # Not in the default steps: JPEG -> JSON at 16 and 32 clients on `--workers ${WORKERS:-4}`, this tree against
      # the pipeline/ of another commit carried in .ab/ (`git archive REV pipeline handwritten_ptx | tar -x -C .ab`,
      # carry [".ab"]; the package finds its kernel sources beside itself, so .ab/handwritten_ptx must be there too),
      # two rounds in mirrored order: a change with no setting of its own, measured side by side in one call.
      [ -d .ab/pipeline ] && [ -d .ab/handwritten_ptx ] || { echo "serve_vs: carry .ab/pipeline and .ab/handwritten_ptx"; continue; }
      V="--workers ${WORKERS:-4} --max-batch-delay-ms 8"
      B="PYTHONPATH=/tmp/site:$PWD/.ab/pipeline"
      serve_bench $C/unet \
        --clients 16 32 --only-variants --cases jpeg_in_json_out --tag vs --duration-s "${SERVE_S:-10}" \
        --variant "new_a=$V" --variant "base_a=$B $V" --variant "base_b=$B $V" --variant "new_b=$V" \
        2>&1 | tee "$OUT/serve_vs.log" ;;
    serve_table)
      # Not in the default steps (issue 15): the issue's table on `serve --workers ${WORKERS:-4}` (defaults): JPEG -> JSON,
      # JPEG -> mask PNG and PNG -> mask PNG at 16 and 32 clients, against the engine alone.
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out jpeg_in_png_out png_in_png_out --tag table --duration-s "${SERVE_S:-10}" \
        --variant "w${WORKERS:-4}_gpu=--workers ${WORKERS:-4} --max-batch-delay-ms 8" \
        2>&1 | tee "$OUT/serve_table.log" ;;
    serve_prof)
      # Not in the default steps (issue 15): JPEG -> JSON at 16 and 32 clients on `serve --workers 4` with
      # the GPU decoder, py-spy sampling the server's processes (serve_bench.py --profile; py-spy from .whl2):
      # where the GIL of the engine process and of the workers goes, pyspy-*.txt (SERVE_PROFILE= : no py-spy).
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag prof --duration-s "${SERVE_S:-10}" ${SERVE_PROFILE---profile} \
        --variant "w4_gpu=--workers 4 --max-batch-delay-ms 8" \
        --variant "w4_gil05=--workers 4 --max-batch-delay-ms 8 --gil-switch-ms 0.5" \
        2>&1 | tee "$OUT/serve_prof.log" ;;
    serve_prof1)
      # Not in the default steps (issue 15): serve_prof on the defaults alone (py-spy over `serve --workers 4`,
      # JPEG -> JSON at 16 and 32 clients; profiled runs are not rates).
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag prof1 --duration-s "${SERVE_S:-10}" --profile \
        --variant "w4_gpu=--workers 4 --max-batch-delay-ms 8" \
        2>&1 | tee "$OUT/serve_prof1.log" ;;
    serve_ab)
      # Not in the default steps (issue 15): the engine process's GIL switch interval (5 ms, Python's
      # default; 0.5; 0.2), JPEG -> JSON at 16 and 32 clients on `serve --workers 4`, in two alternating
      # rounds (the call-to-call spread is ~10%: each setting twice, in one call, side by side).
      serve_bench $C/unet --clients 16 32 \
        --only-variants --cases jpeg_in_json_out --tag ab --duration-s "${SERVE_S:-10}" \
        --variant "w4_sw5a=--workers 4 --max-batch-delay-ms 8" \
        --variant "w4_sw05a=--workers 4 --max-batch-delay-ms 8 --gil-switch-ms 0.5" \
        --variant "w4_sw02a=--workers 4 --max-batch-delay-ms 8 --gil-switch-ms 0.2" \
        --variant "w4_sw5b=--workers 4 --max-batch-delay-ms 8" \
        --variant "w4_sw05b=--workers 4 --max-batch-delay-ms 8 --gil-switch-ms 0.5" \
        --variant "w4_sw02b=--workers 4 --max-batch-delay-ms 8 --gil-switch-ms 0.2" \
        2>&1 | tee "$OUT/serve_ab.log" ;;
    decode)
      # Not in the default steps (issue 15): the engine process's batch cycle with the GPU JPEG decoder,
      # without HTTP (bench/decode_probe.py): the decode alone per nvImageCodec backend set, the batcher
      # under in-process clients (JPEGs and pixels), and a CUPTI kernel table. Needs nvImageCodec in /tmp/site.
      python3 bench/decode_probe.py --bundle $C/unet --jpg $C/sample.jpg --out "$OUT" ${DECODE_ARGS:---kernels} 2>&1 | tee "$OUT/decode_probe.log" ;;
    decode_test)
      # The GPU JPEG path's GPU tests alone (tests/gpu/test_gpu_decode_gpu.py; needs nvImageCodec in /tmp/site).
      DUALTRACK_TEST_BUNDLE=$PWD/$C/tiny python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_decode_gpu.py 2>&1 | tee "$OUT/gpu-test-decode.log" | tail -15 ;;
    serve)
      # The service (uvloop, httptools from .whl/, one image thread per core) under 16 clients for 15 s
      # each: PNG in -> mask PNG out, JPEG in -> JSON out, a 64x64 JPEG in -> JSON out, then PNG -> PNG,
      # JPEG -> JSON and JPEG -> PNG on `serve --workers 4` and `--workers 8` (HTTP processes in front of one
      # engine); against the engine's own batch-8 throughput measured in the
      # same run (ratios: serve_bench-*.json and the last lines printed). About 5 minutes.
      serve_bench $C/unet --clients 16 32 \
        --variant "workers_4=--workers 4 --max-batch-delay-ms 8" --variant "workers_8=--workers 8 --max-batch-delay-ms 8" 2>&1 | tee "$OUT/serve.log" ;;
    rates)
      # Not in the default steps (issue 37): this GPU's Track A rates (bench/measure_rates.py) as its row
      # of a copy of compiler/rates.json in $OUT; commit the row here if it should replace the table's.
      cp pipeline/dualtrack/compiler/rates.json "$OUT/rates.json"
      python3 bench/measure_rates.py --out "$OUT/rates.json" 2>&1 | tee "$OUT/rates.log" ;;
    versus)
      # Not in the default steps (issue 37): this tree against a baseline commit whose pipeline/ and
      # handwritten_ptx/ travel in .ab/ (`git archive REV pipeline handwritten_ptx | tar -x -C .ab`) with
      # the bundles that commit built in .ab/carry/<name> (or kept from an earlier call in /tmp/keep/ab);
      # this tree's bundles of the same names are .carry/<name> or .carry/zoo/<name>. Engine.run in four
      # processes, mirrored order (new, base, base, new), then the table (bench/versus.py).
      ab=.ab; [ -d "$ab/pipeline" ] || ab=/tmp/keep/ab
      [ -d "$ab/pipeline" ] || { echo "versus: carry .ab (pipeline, handwritten_ptx, carry/)"; continue; }
      abs=$(cd "$ab" && pwd); base=(); new=()
      for b in "$abs"/carry/*; do
        n=$(basename "$b")
        for c in "$C/$n" "$C/zoo/$n"; do
          [ -f "$c/manifest.json" ] && { base+=(--bundle "$n=$b"); new+=(--bundle "$n=$c"); break; }
        done
      done
      [ ${#new[@]} -gt 0 ] || { echo "versus: no bundle in both trees"; continue; }
      tag=${VS_TAG:-vs}
      for r in new_a base_a base_b new_b; do
        if [ "${r%_*}" = base ]; then
          PYTHONPATH=/tmp/site:$abs/pipeline python3 bench/versus.py round "${base[@]}" --tag base --out "$OUT/$tag-$r.json"
        else
          python3 bench/versus.py round "${new[@]}" --tag new --out "$OUT/$tag-$r.json"
        fi
      done 2>&1 | tee "$OUT/$tag.log"
      python3 bench/versus.py table "$OUT/$tag"-*_?.json --commit "${DUALTRACK_COMMIT:-unknown}" --out "$OUT/$tag.json" \
        2>&1 | tee -a "$OUT/$tag.log" ;;
    ab)
      # Not in the default steps: `bash bench/device_run.sh ab`. The carried bundles of the reference
      # model (.carry/unet, .carry/unet_*) in one process, in alternating rounds (bench/ab.py).
      bs=$(for b in "$C"/unet "$C"/unet_*; do [ -f "$b/manifest.json" ] && [ "$b" != "$C/unet_seed_split" ] && echo "$(basename "$b")=$b"; done)
      python3 bench/ab.py $bs --batches 1 8 --rounds 7 --out "$OUT" --tag "${DUALTRACK_COMMIT:-unknown}" 2>&1 | tee "$OUT/ab.log" ;;
    zoo)
      # The zoo bundles carried as .carry/zoo/<zoo name> (dualtrack build configs/zoo/<name>.yaml -o ...), through
      # Engine.run against PyTorch with the same weights (bench/zoo_bench.py; smp travels as a wheel in .whl/),
      # and the IREE-only variants beside them (.carry/zoo/<zoo name>.iree_only/<variant>: rows iree_only*).
      # ZOO_ONLY="name ..." limits it to those (a corpus split over calls); ZOO_QUICK=1 times only the rows
      # the corpus is judged by (zoo_bench.py --quick).
      zb=$(for b in "$C"/zoo/*; do [ -f "$b/manifest.json" ] || continue
        { [ -z "${ZOO_ONLY:-}" ] || [[ " $ZOO_ONLY " == *" $(basename "$b") "* ]]; } && echo "--bundle $b"; done)
      [ -n "$zb" ] && python3 bench/zoo_bench.py $zb --batches 1 8 --iters "${BENCH_ITERS:-50}" ${ZOO_QUICK:+--quick} \
        --commit "${DUALTRACK_COMMIT:-unknown}" --out "$OUT" 2>&1 | tee "$OUT/zoo_bench.log" ;;
    tiles)
      # Not in the default steps: bench/tiles_bench.py, a zoo bundle's sliding window (runtime/tiling.py) against
      # MONAI's sliding_window_inference at 2048^2 and 4096^2 (TILES_BUNDLE, default the carried smp Unet;
      # MONAI travels in .whl/: bench/device_wheels.sh zoo): tiles_bench-<commit>.json.
      python3 bench/tiles_bench.py --bundle "${TILES_BUNDLE:-$C/zoo/smp_unet_resnet34}" \
        --commit "${DUALTRACK_COMMIT:-unknown}" --out "$OUT" 2>&1 | tee "$OUT/tiles_bench.log" ;;
    profile)
      # Not in the default steps: every kernel of Engine.run by name, from CUPTI (bench/kernel_profile.py),
      # for the reference bundle and each carried zoo bundle: kernel_profile-<commit>.json.
      kp=$(for b in "$C"/unet "$C"/zoo/*; do [ -f "$b/manifest.json" ] && echo "--bundle $b"; done)
      python3 bench/kernel_profile.py $kp --batches 1 8 --out "$OUT" 2>&1 | tee "$OUT/kernel_profile.log" ;;
    layers)
      # Not in the default steps: smp Unet-resnet34's conv layers, each on the kernel the engine launches
      # for it (and the general conv's mma.sync entry) against cuDNN (bench/conv_layers.py; no bundle needed).
      python3 bench/conv_layers.py "$OUT/conv_layers-${DUALTRACK_COMMIT:-unknown}.json" 2>&1 | tee "$OUT/conv_layers.log" ;;
    api)
      # Where Engine.run's host time goes on a GPU tensor, against run_batch (bench/api_profile.py).
      python3 bench/api_profile.py --bundle $C/unet --batches 1 8 --iters 200 --out "$OUT" 2>&1 | tee "$OUT/api_profile.log" ;;
    ray)
      # Not in the default steps: `bash bench/device_run.sh ray` (issues 16, 17 and 41). Ray and what Ray
      # Serve needs (HAProxy included) travel in parts over earlier calls of this warm machine
      # (bench/ray_wheels.sh prints the plan); reassembled and installed here, then JPEG -> JSON at 16
      # and 32 clients, ${SERVE_S:-15} s each, on the Ray application (one GPU replica answering HTTP
      # itself behind HAProxy: ray_config.THROUGHPUT_ENV; then 2 and 3 model replicas sharing the GPU
      # (--replicas-per-gpu: one replica's process answered ~900 req/s with its H100 60% busy; 4 CPU ingress
      # replicas in front were slower, 306-452 req/s) and on `dualtrack serve --workers 4` beside it, and the
      # replica's device check: serve_bench-<commit>-ray.json, serve_ray-<commit>.json (docs/ray.md).
      # The JPEGs decode on the GPU where an earlier call installed nvImageCodec into /tmp/site
      # (serve_gpu's), else with Pillow: the log's "JPEG decoder" line says which.
      bash bench/ray_install.sh /tmp/site || exit 1
      export RAY_USAGE_STATS_ENABLED=0  # no network here: Ray need not try to report usage
      serve_bench $C/unet --clients 16 32 --duration-s "${SERVE_S:-15}" \
        --only-variants --cases jpeg_in_json_out --tag ray \
        --variant "ray_1gpu=--backend ray --replicas 1 --max-batch-delay-ms 8" \
        --variant "ray_1gpu_x2=--backend ray --replicas 2 --replicas-per-gpu 2 --max-batch-delay-ms 8" \
        --variant "ray_1gpu_x3=--backend ray --replicas 3 --replicas-per-gpu 3 --max-batch-delay-ms 8" \
        --variant "workers_4=--workers 4 --max-batch-delay-ms 8" 2>&1 | tee "$OUT/serve_ray.log" ;;
    bench)
      # --sizes-bundle: configs/unet_sizes.yaml's bundle (issue 40), carried whole (its model.onnx is its own); skipped if absent.
      python3 bench/bench.py --bundle $C/unet --seed-split-bundle $C/unet_seed_split --iree-only-bundle $C/iree_only --head-b-bundle $C/unet_head_b \
        --sizes-bundle $C/unet_sizes \
        --batches 1 8 --iters "${BENCH_ITERS:-50}" --skip-autotune --commit "${DUALTRACK_COMMIT:-unknown}" --out "$OUT" 2>&1 | tee /tmp/bench.log ;;
  esac
done
