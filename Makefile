# dualtrack — the two setup commands are `make run` and `make test` (see README.md).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# A GPU machine with the packages installed system-wide runs `make gpu-test PYTHON=python3`.
PYTHON  ?= $(BIN)/python
CONFIG  ?= configs/unet.yaml
BUNDLE  ?= build/unet
# The CPU torch wheel (pip's find-links); a bare `torch` from PyPI is a multi-GB CUDA build. ZOO_TORCH= to skip.
ZOO_TORCH ?= 'torch==2.13.0'
# `make test` runs the suite on this many pytest-xdist workers (CI: two cores): a test file's cases on one worker, but
# for the cases marked `spread` and the files sharing the fp16 bundles (tests/conftest.py's scheduler says how).
# TEST_WORKERS=0 runs it in the one pytest process.
TEST_WORKERS ?= 2
DEVICE  ?= $(shell (nvidia-smi -L >/dev/null 2>&1 && echo cuda) || echo cpu)

.PHONY: install models ptx ptx-check build run test gpu-test bench lint clean zoo zoo-deps ray-deps conformance

$(BIN)/dualtrack: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[serve,dev]'
	@touch $@

install: $(BIN)/dualtrack  ## create .venv and install dualtrack with the service and dev extras

models/unet_fp16.onnx: | $(BIN)/dualtrack
	$(BIN)/dualtrack make-reference -o models

models: models/unet_fp16.onnx  ## generate the reference U-Net (fp16, fp32) and the sample image

ptx: $(BIN)/dualtrack  ## regenerate handwritten_ptx/ptx/* (and its stamps, ptx/inputs.json) with NVRTC 13.0
	$(BIN)/python -m dualtrack.compiler.kernel_build

ptx-check: $(BIN)/dualtrack  ## compile every kernel again and compare with the checked-in PTX (minutes; the tests check the stamps)
	$(BIN)/python -m dualtrack.compiler.kernel_build --check

build: models  ## build, verify and write the reference bundle
	$(BIN)/dualtrack build $(CONFIG) -o $(BUNDLE)

run: build  ## build the reference bundle and segment the sample image (GPU if there is one)
	@mkdir -p out
	$(BIN)/dualtrack run $(BUNDLE) models/sample.png -o out/sample_mask.png --device $(DEVICE)

test: $(BIN)/dualtrack  ## the test suite (GPU tests skip without a GPU)
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/python -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile

conformance: $(BIN)/dualtrack  ## ONNX's own test models built for the CPU against their shipped outputs: docs/conformance.md
	$(BIN)/python -m dualtrack.compiler.conformance --out docs/conformance.md

gpu-test:  ## GPU tests only (on a GPU machine; skipped with their reason elsewhere)
	$(PYTHON) -m pytest -q -m gpu tests/gpu

ZOO_BUNDLES = $(wildcard build/zoo/*/manifest.json)

bench:  ## benchmarks on a GPU (bundles built beforehand: make build, and the zoo's: dualtrack build configs/zoo/*.yaml configs/zoo/iree_only/*/*.yaml): tables, bench/results/
	$(PYTHON) bench/gpu_check.py --bundle $(BUNDLE) --image models/sample.png --out bench/results
	$(PYTHON) bench/bench.py --bundle $(BUNDLE) --out bench/results
	$(if $(ZOO_BUNDLES),$(PYTHON) bench/zoo_bench.py $(foreach m,$(ZOO_BUNDLES),--bundle $(dir $(m))) --out bench/results)

zoo-deps: $(BIN)/dualtrack  ## install the zoo extra (CPU torch, torchvision, smp, monai): the zoo's tests run with it
	$(BIN)/pip install -q $(ZOO_TORCH) -e '.[zoo]'

ray-deps: $(BIN)/dualtrack  ## install the ray extra (Ray Serve): tests/test_serve_ray.py runs with it
	$(BIN)/pip install -q -e '.[ray]'

zoo: zoo-deps  ## export the model zoo (26 networks) into models/zoo/ (512x512, PSPNet 528x528; configs/zoo/*.yaml build them)
	$(BIN)/python models/zoo/export.py

lint: $(BIN)/dualtrack
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/ruff format --check pipeline tests bench

clean:
	rm -rf build out .pytest_cache
