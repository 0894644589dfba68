#!/usr/bin/env bash
# Here, where pip reaches PyPI: the wheels the GPU machine's image lacks (KINDS.md's package list),
# at the versions this checkout's .venv runs, for Python 3.12 on manylinux x86_64 (device/README.md).
#   .whl/   dualtrack's run-time needs: the IREE runtime, pydantic, the service's HTTP stack
#   .whl2/  nvImageCodec + nvJPEG (the service's GPU JPEG decoder, issue 15) and py-spy (serve_bench.py
#           --profile): ~31 MB, too much beside
#           .whl and .carry.tar.xz in one call, so installed by a call of its own:
#           run(carry=[".whl2"], command="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl2/nvidia*.whl
#             && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools .whl2/py_spy*.whl")
#           (py-spy apart: device_run.sh's own install of .whl/ into /tmp/site replaces /tmp/site/bin)
#   zoo     into .whl/: segmentation-models-pytorch and monai (pure Python, ~3 MB), which bench/zoo_bench.py's
#           torch rows build the corpus models with (the device image has torch, torchvision and timm), and
#           onnxslim, colorama and onnxconverter-common (the front end: GPU tests that build a model on the device)
# Both are git-ignored (.git/info/exclude). Usage: bash bench/device_wheels.sh [whl|whl2|zoo|all]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for d in /.whl/ /.whl2/ /.carry/ /.carry.tar.xz /.parts*/ /.raycarry*/ /.prof*/ /.ab/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
get() {  # DIR NAME==VERSION ...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 -d "$dir" "$@"
}
what=${1:-all}
if [ "$what" = whl ] || [ "$what" = all ]; then
  names="iree-base-runtime archspec pydantic pydantic-core annotated-types typing-inspection starlette uvicorn python-multipart httptools"
  get .whl $(for n in $names; do echo "$n==$(version "$n")"; done)
fi
if [ "$what" = whl2 ] || [ "$what" = all ]; then
  get .whl2 nvidia-nvimgcodec-cu13==0.9.0.20 "nvidia-nvjpeg==13.*" py-spy==0.4.3
fi
if [ "$what" = zoo ]; then
  get .whl "segmentation-models-pytorch==$(version segmentation-models-pytorch)" "monai==$(version monai)" \
    "onnxslim==$(version onnxslim)" "colorama==$(version colorama)" "onnxconverter-common==$(version onnxconverter-common)"
fi
du -sh .whl .whl2 2>/dev/null || true
