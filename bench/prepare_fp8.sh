#!/usr/bin/env bash
# Build here, where iree-compile is, the fp16 + fp8 bundle pairs bench/fp8_bench.py times on the GPU
# (issue 42), into $CARRY (default .carry_fp8/, git-ignored), and pack it as $CARRY.tar.xz:
#   unet, unet_fp8            configs/unet.yaml for sm_90a only (bench/corpus_configs.py), configs/unet_fp8.yaml
#   zoo/<name>, zoo/<name>.fp8  each ZOO model (default smp_unet_resnet34) for sm_90a, fp16 and fp8
#                             (bench/corpus_configs.py --fp8), sealed by bench/fp8_seal.py: both carry the
#                             seeded weights of bench/reweight.py, the fp8 one calibrated again on them
# No weights.bin or reference cases travel for the corpus (fp8_bench.py grows them back on the GPU
# machine), nor the fp8 bundles' model.onnx / weights.bin where they are the fp16 bundle's (copied back
# there). Each build prints its time; the fp8 builds print their agreement with fp32.
#
#   [ZOO="name ..."] [CARRY=.carry_fp8] bash bench/prepare_fp8.sh
#
# Then carry [".whl", "$CARRY.tar.xz"] and on the GPU machine:
#   tar -xJf .carry_fp8.tar.xz && PYTHONPATH=/tmp/site:$PWD/pipeline python3 bench/fp8_bench.py --dir .carry_fp8 --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
C=${CARRY:-.carry_fp8}
PY=${PYTHON:-.venv/bin/python}
DT=${DUALTRACK:-.venv/bin/dualtrack}
ZOO=${ZOO-smp_unet_resnet34}
rm -rf "$C" "$C.tar.xz"
mkdir -p "$C/zoo"
cfgs=$(mktemp -d)
trap 'rm -rf "$cfgs"' EXIT

# build CONFIG OUT: `dualtrack build`, its fp8 lines, its last line and how long it took.
build() {
  local start=$SECONDS
  "$DT" build "$1" -o "$2" | grep -E "fp8: (agreement|[0-9]+ of)|^[^-]" || true
  [ -f "$2/manifest.json" ] || { echo "prepare_fp8.sh: $1 did not build (above)" >&2; return 1; }
  echo "built $2 in $((SECONDS - start)) s"
}
# shared FP16 FP8 FILE...: drop from FP8 each FILE that is byte for byte FP16's (fp8_bench.py copies it back).
shared() {
  local a=$1 b=$2; shift 2
  for f in "$@"; do cmp -s "$a/$f" "$b/$f" && rm "$b/$f"; done
  return 0
}

make -s models
"$PY" bench/corpus_configs.py "$cfgs" configs/unet.yaml
build "$cfgs/unet.yaml" "$C/unet"
build configs/unet_fp8.yaml "$C/unet_fp8"
shared "$C/unet" "$C/unet_fp8" model.onnx weights.bin

for name in $ZOO; do
  [ -f "models/zoo/$name.onnx" ] || "$PY" models/zoo/export.py "$name"
  "$PY" bench/corpus_configs.py "$cfgs" "$name" --fp8
  build "$cfgs/$name.yaml" "$C/zoo/$name"
  build "$cfgs/$name.fp8.yaml" "$C/zoo/$name.fp8"
  start=$SECONDS
  "$PY" bench/fp8_seal.py "$C/zoo/$name" "$C/zoo/$name.fp8" | grep -vE "^fp8: /"  # fails where the seal fails
  echo "sealed $name in $((SECONDS - start)) s"
  rm -f "$C/zoo/$name"/weights.bin "$C/zoo/$name"/verify/cases.npz "$C/zoo/$name.fp8"/weights.bin \
    "$C/zoo/$name.fp8"/verify/cases.npz
  shared "$C/zoo/$name" "$C/zoo/$name.fp8" model.onnx
done

tar -cf - "$C" | xz -T2 -6 > "$C.tar.xz"
du -sh "$C"/* "$C"/zoo/* "$C.tar.xz" .whl 2>/dev/null || true
carried=$(du -cb "$C.tar.xz" $( [ -d .whl ] && echo .whl) | tail -1 | cut -f1)
echo "carried [.whl, $C.tar.xz]: $((carried / 1048576)) MiB of the 64 MiB limit"
