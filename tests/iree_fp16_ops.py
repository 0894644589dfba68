"""Single fp16 ops as Track B compiles them, against onnxruntime fp32: the cases of
tests/test_iree_fp32_sums.py (CPU) and tests/gpu/test_iree_fp16_gpu.py (GPU), and the kit the GPU test loads.

Each case builds one small ONNX graph at a float type: the fp16 graph is what IREE compiles (through
``iree_build.run_job``, so stage 0's rewrites apply), the fp32 twin (the same fp16-rounded weights and
inputs) is what onnxruntime computes as the reference. The shapes are the sizes where fp16 sums go wrong
(InstanceNorm over 256x256, the pyramid pools of a PSPNet at 528x528, a GEMM with K = 4096) and the small
channel counts of the zoo models whose IREE-alone fp16 bundles failed on the GPU (MONAI UNet's 3 -> 16
stem and 16-channel units, LR-ASPP's 16 -> 16 projection).

The GPU machine has no IREE compiler, so the CUDA modules are built here into a kit the lead carries:

    PYTHONPATH=pipeline .venv/bin/python tests/iree_fp16_ops.py .carry/iree_fp16/fixed
    PYTHONPATH=pipeline .venv/bin/python tests/iree_fp16_ops.py .carry/iree_fp16/old --old

``--old`` compiles the graphs without stage 0's fp32 sums (iree_forms.fp32_sums), as before the fix: the
GPU test on that kit shows which ops IREE's fp16 code gets wrong without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ENTRY = "main"  # the graph's name: the function IREE exports (Track B's segments are "main" too)
TOLERANCE = 2e-3  # relative L2 against fp32: fp16 storage of the result is 2.4e-4; an fp16 sum over 1089 is 6e-3
IREE_ARCH = "sm_89"  # what IREE 3.13 compiles for an H100/H200 (contract/arch.py: sm_90a's iree_target)
KIT_ENV = "DUALTRACK_TEST_IREE_FP16_KIT"


@dataclass(frozen=True)
class Case:
    """One op. ``build(elem_type, weights)``: the graph's nodes at that float type and its output shape;
    ``weights(rng)``: its initializers, float64 arrays rounded to fp16 for both twins; ``offset``: added to
    the standard normal input (1.0 makes sums grow as a post-ReLU map's do, while negative values stay)."""

    name: str
    shape: tuple[int, ...]
    build: Callable[[int, dict[str, np.ndarray]], tuple[list[onnx.NodeProto], list[int]]]
    weights: Callable[[np.random.Generator], dict[str, np.ndarray]] = lambda rng: {}
    offset: float = 0.0
    opset: int = 17


def _model(case: Case, elem: int, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    nodes, out_shape = case.build(elem, weights)
    dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    # float64 arrays are weights, stored at the graph's type (rounded to fp16 first); others (axes, scales) as given
    inits = [
        numpy_helper.from_array(w.astype(np.float16).astype(dtype) if w.dtype == np.float64 else w, k)
        for k, w in weights.items()
    ]
    graph = helper.make_graph(
        nodes,
        ENTRY,
        [helper.make_tensor_value_info("x", elem, list(case.shape))],
        [helper.make_tensor_value_info("y", elem, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def models(case: Case, seed: int = 0) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The fp16 graph and its fp32 twin, with the same weights."""
    weights = case.weights(np.random.default_rng(seed))
    return _model(case, TensorProto.FLOAT16, weights), _model(case, TensorProto.FLOAT, weights)


def case_input(case: Case, rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(case.shape) + case.offset).astype(np.float16)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def reference(case: Case, x: np.ndarray) -> np.ndarray:
    """onnxruntime fp32 on the fp32 twin, the fp16 input widened exactly."""
    from dualtrack.compiler.verify import ort_session

    _, fp32 = models(case)
    return ort_session(fp32, case.name).run(None, {"x": x.astype(np.float32)})[0]


# -- the cases ------------------------------------------------------------------------------------


def _one(op: str, out: list[int], inputs: tuple[str, ...] = ("x",), **attrs) -> Callable:
    return lambda elem, w: ([helper.make_node(op, list(inputs), ["y"], **attrs)], out)


def _conv(cin: int, cout: int, k: int, group: int = 1) -> Callable:
    def weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
        fan_in = cin // group * k * k  # unit-variance outputs from unit-variance inputs
        return {"w": rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(fan_in), "b": rng.standard_normal(cout)}

    return weights


def _conv_node(k: int, stride: int = 1, group: int = 1, pads: tuple[int, ...] = ()) -> onnx.NodeProto:
    pads = pads or (k // 2,) * 4
    return helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=list(pads), strides=[stride] * 2, group=group)


def _conv_case(
    name: str, n_hw: tuple[int, int, int], cout: int, k: int, stride: int = 1, group: int = 1, pads: tuple = ()
) -> Case:
    cin, h, w = n_hw
    top, left, bottom, right = pads or (k // 2,) * 4
    out = [1, cout, (h + top + bottom - k) // stride + 1, (w + left + right - k) // stride + 1]

    def build(elem: int, wts: dict) -> tuple[list[onnx.NodeProto], list[int]]:
        node = _conv_node(k, stride, group, pads)
        node.output[0] = "y"
        return [node], out

    return Case(name, (1, cin, h, w), build, _conv(cin, cout, k, group))


def _projection_residual(elem: int, wts: dict) -> tuple[list[onnx.NodeProto], list[int]]:
    """LR-ASPP's first inverted residual ends so: a 1x1 16 -> 16 conv (BN folded) and the residual add."""
    return [_conv_node(1), helper.make_node("Add", ["c", "x"], ["y"])], [1, 16, 256, 256]


def _resize(elem: int, wts: dict) -> tuple[list[onnx.NodeProto], list[int]]:
    """A bilinear x4 Resize as the front end hands it to IREE: in fp32 between Casts (onnxconverter-common
    keeps Resize fp32; IREE 3.13 cannot compile an fp16 linear Resize with fp32 scales at all)."""
    return [
        helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
        helper.make_node("Resize", ["x32", "", "scales"], ["r"], mode="linear"),
        helper.make_node("Cast", ["r"], ["y"], to=elem),
    ], [1, 16, 128, 128]


def _instance_norm_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"s": 1 + 0.1 * rng.standard_normal(16), "b": 0.1 * rng.standard_normal(16)}


CASES: tuple[Case, ...] = (
    Case(
        "instance_norm_16x256x256",
        (1, 16, 256, 256),
        _one("InstanceNormalization", [1, 16, 256, 256], ("x", "s", "b"), epsilon=1e-5),
        _instance_norm_weights,
        offset=1.0,
    ),
    Case(
        "average_pool_k64",
        (1, 16, 256, 256),
        _one("AveragePool", [1, 16, 4, 4], kernel_shape=[64, 64], strides=[64, 64]),
        offset=1.0,
    ),
    Case(  # PSPNet-resnet34's pyramid pool of bin 2 at 528x528 (a 66x66 map)
        "average_pool_k33",
        (1, 128, 66, 66),
        _one("AveragePool", [1, 128, 2, 2], kernel_shape=[33, 33], strides=[33, 33]),
        offset=1.0,
    ),
    Case(
        "average_pool_3x3_pad",
        (1, 16, 64, 64),
        _one("AveragePool", [1, 16, 64, 64], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
        offset=1.0,
    ),
    Case("global_average_pool", (1, 128, 66, 66), _one("GlobalAveragePool", [1, 128, 1, 1]), offset=1.0),
    Case("reduce_mean_hw", (1, 16, 256, 256), _one("ReduceMean", [1, 16, 1, 1], axes=[2, 3], keepdims=1), offset=1.0),
    Case(  # sums of 1024 values near 1: within fp16's range at the output
        "reduce_sum_hw",
        (1, 16, 32, 32),
        _one("ReduceSum", [1, 16, 1, 1], ("x", "axes"), keepdims=1),
        lambda rng: {"axes": np.array([2, 3], np.int64)},
        offset=1.0,
    ),
    Case("reduce_l2_hw", (1, 16, 64, 64), _one("ReduceL2", [1, 16, 1, 1], axes=[2, 3], keepdims=1)),
    Case(
        "cumsum_w",
        (1, 8, 16, 512),
        _one("CumSum", [1, 8, 16, 512], ("x", "axis")),
        lambda rng: {"axis": np.array(3, np.int64)},
        offset=1.0,
    ),
    Case("softmax_c19", (1, 19, 128, 128), _one("Softmax", [1, 19, 128, 128], axis=1)),
    _conv_case("conv3x3_c256_k2304", (256, 32, 32), 64, 3),
    _conv_case("conv3x3_s2_c3_stem", (3, 256, 256), 16, 3, stride=2),
    _conv_case("conv3x3_c16", (16, 128, 128), 16, 3),
    _conv_case("conv3x3_s2_c16_c32", (16, 128, 128), 32, 3, stride=2),  # MONAI UNet's downsampling units
    # A sub-pixel ConvTranspose's phases as the front end writes them (MONAI UNet's 2x upsampling)
    _conv_case("conv2x2_subpixel_c64", (64, 64, 64), 128, 2, pads=(0, 0, 1, 1)),
    _conv_case("depthwise3x3_c16", (16, 128, 128), 16, 3, group=16),
    Case("conv1x1_c16_residual", (1, 16, 256, 256), _projection_residual, _conv(16, 16, 1)),
    Case(
        "matmul_k4096",
        (1, 64, 4096),
        _one("MatMul", [1, 64, 128], ("x", "w")),
        lambda rng: {"w": rng.standard_normal((4096, 128)) / 64},
    ),
    Case(
        "resize_bilinear_x4",
        (1, 16, 32, 32),
        _resize,
        lambda rng: {"scales": np.array([1, 1, 4, 4], np.float32)},
    ),
)
BY_NAME = {c.name: c for c in CASES}


# -- the kit: CUDA modules compiled here, run on the GPU machine -----------------------------------


def build_kit(dest: Path, *, old: bool = False, target_arch: str = IREE_ARCH, flags: tuple[str, ...] = ()) -> Path:
    """Each case's fp16 graph compiled for CUDA by Track B's own job (``iree_build.run_job``: stage 0,
    import, compile), written as ``<case>.vmfb`` beside ``<case>.onnx`` (its weights) and kit.json.
    ``old``: without stage 0's fp32 sums (the behaviour before it). ``flags``: Track B flags (a
    config's ``track_b.cuda_flags``), to find a set under which IREE's GPU code is right."""
    from dualtrack.compiler import iree_build

    dest.mkdir(parents=True, exist_ok=True)
    cache = iree_build.ModuleCache(dest / ".cache", enabled=False)
    compiler = iree_build.compiler_version()
    target = iree_build.cuda_target(target_arch)
    with mock.patch.object(iree_build, "fp32_sums", (lambda m: m) if old else iree_build.fp32_sums):
        for case in CASES:
            fp16, _ = models(case)
            job = iree_build.CompileJob(case.name, fp16, 1, target, flags)
            (dest / f"{case.name}.vmfb").write_bytes(iree_build.run_job(job, cache, compiler).vmfb)
            onnx.save(fp16, str(dest / f"{case.name}.onnx"))
    kit = {"stage0_fp32_sums": not old, "flags": list(flags), "target": target.name, "compiler": compiler}
    kit["cases"] = [c.name for c in CASES]
    (dest / "kit.json").write_text(json.dumps(kit, indent=1))
    return dest


def weights_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The initializers, by name: what ``runtime.iree.parameter_index`` supplies to the module."""
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="the kit's folder (DUALTRACK_TEST_IREE_FP16_KIT on the GPU machine)")
    ap.add_argument("--old", action="store_true", help="without stage 0's fp32 sums: the behaviour before the fix")
    ap.add_argument("--flag", action="append", default=[], help="a Track B flag for every case (repeatable)")
    args = ap.parse_args(argv)
    print(build_kit(args.dest, old=args.old, flags=tuple(args.flag)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
