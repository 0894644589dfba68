#!/usr/bin/env bash
# Build here, where iree-compile is, everything bench/device_run.sh needs on the GPU machine, into
# .carry/, and pack it as .carry.tar.xz (the 64 MiB carry limit): the reference bundles (the extra
# ones without model.onnx: device_run.sh copies the reference's in), the tiny test bundles, the
# Track B tuning kit, the sample images and, with `zoo` as an argument, the zoo bundles (their
# exports: `make zoo`) and the IREE-only variants beside them (configs/zoo/iree_only/<zoo>/<v>.yaml
# -> .carry/zoo/<zoo>.iree_only/<v>: each first built --cpu-only, which must verify on the CPU; the
# ones whose model.onnx is the zoo bundle's travel without it). Then carry [".whl", ".carry.tar.xz"]
# (bench/README.md); the last line says what that weighs against the 64 MiB carry limit.
#
#   [ZOO="name ..."] bash bench/prepare_carry.sh [zoo|zoo-only|corpus]
#
# `corpus`: only the named corpus models (ZOO, required), each exported at 512x512 where models/zoo
# lacks it, built for sm_90a without llvm-cpu modules (bench/corpus_configs.py: checked on the GPU, not
# here) as .carry/zoo/<name>, and IREE alone beside it as .carry/zoo/<name>.iree_only/iree (its model.onnx
# is the zoo bundle's and travels once): the rows <name>/dualtrack_api and <name>/iree_alone of
# bench/zoo_bench.py (and IREE alone with the no_vd flags as .iree_only/no_vd: IREE's default fp16 CUDA
# code is refused on the GPU for some models, facts 26), torch's rows from the same seeded export on the GPU machine. No weights travel:
# bench/reweight.py seals each bundle with seeded weights that device_run.sh grows back there.
#
# ZOO names the zoo models to build (default: every configs/zoo/*.yaml; smp_unet_resnet34's fp16
# weights alone are ~47 MB, most of the limit). EXTRA names the extra reference-model bundles (default:
# unet_seed_split iree_only unet_head_b unet_batches, which bench.py's rows need; EXTRA= builds none).
# NO_UNET=1 leaves out the reference bundle too (a call that runs the GPU tests and the corpus only).
set -euo pipefail
cd "$(dirname "$0")/.."
C=${CARRY:-.carry}  # CARRY=.carry_corpus: build into another folder (git-ignored), packed as $C.tar.xz
PY=${PYTHON:-.venv/bin/python}
DT=${DUALTRACK:-.venv/bin/dualtrack}
what=${1:-}
rm -rf "$C" "$C.tar.xz"
mkdir -p "$C"

if [ "$what" = corpus ]; then
  [ -n "${ZOO:-}" ] || { echo "prepare_carry.sh corpus: name the models, e.g. ZOO=\"monai_unet\"" >&2; exit 2; }
  cfgs=$(mktemp -d)
  "$PY" bench/corpus_configs.py "$cfgs" $ZOO
  for name in $ZOO; do
    # A model that fails to export or build is reported and left out; the others still travel.
    if ! { { [ -f "models/zoo/$name.onnx" ] || "$PY" models/zoo/export.py "$name"; } \
      && "$DT" build "$cfgs/$name.yaml" -o "$C/zoo/$name" | tail -1 \
      && "$DT" build "$cfgs/$name.iree.yaml" -o "$C/zoo/$name.iree_only/iree" | tail -1 \
      && "$DT" build "$cfgs/$name.iree_no_vd.yaml" -o "$C/zoo/$name.iree_only/no_vd" | tail -1; }; then
      echo "prepare_carry.sh corpus: $name FAILED (above); left out" >&2
      rm -rf "$C/zoo/$name" "$C/zoo/$name.iree_only"
      continue
    fi
    # The weights stay here: drawn again from a seed on the GPU machine (bench/reweight.py), the
    # reference cases recomputed there; what travels is the graph, the code and the per-channel statistics.
    "$PY" bench/reweight.py seal "$C/zoo/$name" "$C/zoo/$name.iree_only/iree" "$C/zoo/$name.iree_only/no_vd"
    for v in iree no_vd; do
      cmp -s "$C/zoo/$name.iree_only/$v/model.onnx" "$C/zoo/$name/model.onnx" && rm "$C/zoo/$name.iree_only/$v/model.onnx"
      rm -f "$C/zoo/$name.iree_only/$v"/weights.bin "$C/zoo/$name.iree_only/$v"/verify/cases.npz
    done
    rm -f "$C/zoo/$name"/weights.bin "$C/zoo/$name"/verify/cases.npz
  done
  rm -rf "$cfgs"
  what=corpus-done
fi

if [ "$what" != zoo-only ] && [ "$what" != corpus-done ]; then
  make -s models
  # NO_UNET=1: the GPU tests' tiny bundles alone (the reference bundle weighs ~25 MB of the carry).
  [ -n "${NO_UNET:-}" ] || "$DT" build configs/unet.yaml -o "$C/unet"
  for c in ${EXTRA-unet_seed_split iree_only unet_head_b unet_batches}; do
    "$DT" build "configs/$c.yaml" -o "$C/$c"
    rm "$C/$c/model.onnx" "$C/$c/weights.bin"  # the reference's: same model, same bytes (hashes checked at load)
  done
  # SIZES=1: the U-Net built for 720x1280 and 1024x768 (issue 40; bench.py's <HxW>/dualtrack_api rows), carried
  # whole (its model.onnx is its own; ~15 MB of weights more against the 64 MiB limit).
  [ -z "${SIZES:-}" ] || "$DT" build configs/unet_sizes.yaml -o "$C/unet_sizes"
  cp models/sample.png "$C/"
  "$PY" -c "from PIL import Image; Image.open('models/sample.png').convert('RGB').save('$C/sample.jpg', quality=90)"
  # The GPU tests' bundles (tests/conftest.py) and the IREE flag kit (tests/gpu/test_tune_b_gpu.py).
  "$PY" - "$C" <<'EOF'
import sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import conftest
from dualtrack.compiler.build import build
from dualtrack.compiler.reference import UNetSpec
out = Path(sys.argv[1])
tmp = Path(tempfile.mkdtemp(prefix="carry-"))
build(conftest.write_tiny_project(tmp / "tiny"), out / "tiny")
fp16 = UNetSpec(**{**conftest.TINY.__dict__, "precision": "fp16"})
full = conftest.write_tiny_project(tmp / "tiny_full", fp16, config="tiny_full.yaml")
build(full, out / "tiny_full")
conftest.build_tiny_tuned(out / "tiny_tuned")
conftest.build_tiny_wgmma(out / "tiny_wgmma")
import mobile_net  # tests/gpu/test_mobile_gpu.py: the mobile kernels through the engine
build(mobile_net.write_mobile_project(tmp / "tiny_mobile", ("sm_90a", "sm_80")), out / "tiny_mobile")
conftest.build_tiny_head(out / "tiny_head", tmp / "tiny_head")  # tests/gpu/test_seghead_gpu.py: the head on Track A
sys.path.insert(0, "tests/gpu")
from test_fixed_shape_gpu import build_fixed_bundle  # tests/gpu/test_fixed_shape_gpu.py: `batch: fixed` on IREE's CUDA module
build_fixed_bundle(tmp / "fixed", out / "tiny_fixed")
from test_sizes_gpu import build_sized_bundle  # tests/gpu/test_sizes_gpu.py: a bundle of two input sizes
build_sized_bundle(tmp / "sizes", out / "tiny_sizes")
import window_net  # tests/gpu/test_tiling_gpu.py: a conv net with `window:` (sliding-window inference)
window_net.build_window_bundle(tmp / "window", out / "tiny_window", ("sm_90a", "sm_80"))
from test_token_ops_gpu import build_token_bundle  # tests/gpu/test_token_ops_gpu.py: token tensors on Track A
build_token_bundle(tmp / "tokens", out / "tiny_tokens")
(out / "tiny.yaml").write_text(str(tmp / "tiny" / "tiny.yaml"))
EOF
  "$DT" tune "$(cat "$C/tiny.yaml")" --track-b --prepare-kit "$C/kit_tiny"
  rm "$C/tiny.yaml"
fi
if [ "$what" = zoo ] || [ "$what" = zoo-only ]; then
  names=${ZOO:-$(for m in configs/zoo/*.yaml; do basename "$m" .yaml; done)}
  for name in $names; do
    "$DT" build "configs/zoo/$name.yaml" -o "$C/zoo/$name"
  done
  cpu=$(mktemp -d)
  for zoo in $names; do for v in configs/zoo/iree_only/"$zoo"/*.yaml; do
    [ -f "$v" ] || continue
    out="$C/zoo/$zoo.iree_only/$(basename "$v" .yaml)"
    # The CPU path of every variant must verify (the GPU's code is checked at its first load there).
    "$DT" build --cpu-only "$v" -o "$cpu/$zoo-$(basename "$v" .yaml)" | tail -1
    "$DT" build "$v" -o "$out" | tail -1
    if cmp -s "$out/model.onnx" "$C/zoo/$zoo/model.onnx" && cmp -s "$out/weights.bin" "$C/zoo/$zoo/weights.bin"; then
      rm "$out/model.onnx" "$out/weights.bin"
    fi
  done; done
  rm -rf "$cpu"
fi
tar -cf - "$C" | xz -T2 -6 > "$C.tar.xz"
du -sh "$C" "$C.tar.xz" .whl 2>/dev/null || true
[ -d .whl ] || echo "no .whl/ here: the wheels the GPU machine installs (bench/README.md) are not counted"
carried=$(du -cb "$C.tar.xz" $( [ -d .whl ] && echo .whl) | tail -1 | cut -f1)
echo "carried [.whl, $C.tar.xz]: $((carried / 1048576)) MiB of the 64 MiB limit"
