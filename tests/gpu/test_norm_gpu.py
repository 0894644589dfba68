"""The norm kernels (handwritten_ptx/norm_nhwc.cu: group statistics split over chunks and finalized
by the last block of each image, apply; the per-pixel LayerNorm; the BatchNorm affine) on a real GPU,
in fp16 and fp32, read from and written into channel slices (ld > C, offsets that keep or break the
16-byte vector paths' alignment). The outputs are poisoned (NaN) first, so an element the kernel
does not write fails. The launches are kernels.norm's (NormSpec.prepare_norm), so the split the
runtime plans is what runs.

- against onnxruntime (the ONNX models and lowering of tests/norm_cases.py): odd and large pictures
  (one pixel, 3x5, 17x33, 256x256), C = 5, 20, 32, 36, 96, 264, G = 1, 2, 4, C, eps 1e-5 and 1e-3,
  with and without an activation and a residual;
- against the float64 reference (NormSpec.reference): C 1, 2, 3, 4, 8, 20, 36, 264 with G 1, 2, 4,
  C, pictures from 1x1 to 300x200, batches 1 and 5, activations with parameters, both residual
  modes, the flat view of thin dense tensors, and the cancellation case (mean 100, std 0.01); and
  three launches on one workspace (the arrival counters reset).

Tolerance: fp32 max |diff| 1e-4 and rel-L2 1e-5 (summation order only); fp16 (the reference fed the
same fp16-rounded inputs, the kernel rounds once) max |diff| 1e-2 and rel-L2 2e-3: one fp16 ulp of
values up to ~8 (max |diff| scales with max |ref| above 1: contract.checks.Tolerance). The
cancellation case: LARGE_MEAN_TOL below."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pytest
from gpu_ptx import Slices, checked_in_entries
from norm_cases import Graph, lowered
from onnx import numpy_helper

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.contract.activations import ACTIVATIONS, Activation
from dualtrack.runtime.engine import Engine

NORM = kernels.KERNELS["norm"]
TOL = {
    "float16": Tolerance(rel_l2=2e-3, max_abs=1e-2, mismatch=0),
    "float32": Tolerance(rel_l2=1e-5, max_abs=1e-4, mismatch=0),
}


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, ("norm_nhwc",)) as found:
        yield found


@dataclass
class Ctx:
    """The LaunchContext a norm asks: the device and zeroed scratch (from the test's Slices)."""

    s: Slices
    device: kernels.DeviceInfo

    def workspace(self, nbytes: int) -> int:
        return self.s.weights(np.zeros(nbytes, np.uint8))


def build_case(kind: str, c: int, h: int, w: int, groups: int, eps: float, act: str, res: str) -> Graph:
    gr = Graph(c, h, w, seed=int(np.random.default_rng().integers(1 << 30)))
    t = {
        "group": lambda: gr.group_norm("x", groups, eps),
        "instance": lambda: gr.instance_norm("x", eps),
        "layer": lambda: gr.layer_norm("x", eps),
        "affine": lambda: gr.batch_norm("x", eps),
    }[kind]()
    if res == "before_act":
        t = gr.node("Add", "res", [t, gr.second_input("skip")])
    if act == "leakyrelu":
        t = gr.node("LeakyRelu", "act", [t], alpha=0.1)
    elif act == "silu":
        t = gr.silu(t)
    elif act == "gelu_tanh_free":  # a row past the inlined ones (dt_activate_rest)
        t = gr.node("Elu", "act", [t], alpha=0.5)
    if res == "after_act":
        t = gr.node("Add", "res", [gr.second_input("skip"), t])
    gr.out = t  # type: ignore[attr-defined]
    return gr


CASES = [  # kind, N, C, H, W, groups, eps, activation, residual
    ("group", 1, 32, 256, 256, 4, 1e-5, "silu", "none"),
    ("group", 3, 96, 17, 33, 1, 1e-3, "none", "none"),
    ("group", 1, 96, 17, 33, 4, 1e-5, "leakyrelu", "before_act"),
    ("group", 3, 5, 17, 33, 5, 1e-5, "gelu_tanh_free", "none"),
    ("instance", 1, 32, 256, 256, 32, 1e-5, "leakyrelu", "none"),
    ("instance", 3, 5, 17, 33, 5, 1e-3, "none", "after_act"),
    ("instance", 1, 96, 17, 33, 96, 1e-5, "silu", "before_act"),
    ("layer", 3, 96, 17, 33, 1, 1e-6, "none", "none"),
    ("layer", 1, 5, 17, 33, 1, 1e-5, "leakyrelu", "after_act"),
    ("layer", 1, 32, 256, 256, 1, 1e-6, "gelu_tanh_free", "none"),
    ("affine", 3, 5, 17, 33, 1, 1e-3, "silu", "none"),
    ("affine", 1, 96, 17, 33, 1, 1e-5, "leakyrelu", "before_act"),
    ("group", 5, 20, 3, 5, 2, 1e-5, "silu", "after_act"),
    ("instance", 5, 36, 1, 1, 36, 1e-3, "leakyrelu", "none"),  # one pixel: variance 0, y = beta
    ("group", 1, 264, 9, 7, 4, 1e-5, "none", "before_act"),
    ("layer", 5, 264, 3, 5, 1, 1e-6, "silu", "before_act"),  # two vectors a lane (fp16)
    ("layer", 1, 768, 9, 7, 1, 1e-6, "none", "after_act"),  # three (fp16); fp32: the warp-a-pixel path
    ("layer", 2, 1032, 3, 3, 1, 1e-6, "leakyrelu", "none"),  # past the register path
    ("layer", 1, 20, 30, 20, 1, 1e-5, "none", "none"),
]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3, 8])
@pytest.mark.parametrize(("kind", "n", "c", "h", "w", "groups", "eps", "act", "res"), CASES)
def test_norm_kernel_matches_onnxruntime(engine, mods, dtype, off, kind, n, c, h, w, groups, eps, act, res) -> None:
    gr = build_case(kind, c, h, w, groups, eps, act, res)
    model = gr.model(gr.out)  # type: ignore[attr-defined]
    norms, _ = lowered(model)
    norm = next(iter(norms.found.values()))
    call = norm.call
    s = Slices(engine, dtype, off)
    feeds = {
        name: (2 * s.rng.standard_normal((n, c, h, w)) + 0.5).astype(dtype).astype(np.float32) for name in call.inputs
    }
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, feeds)
    packed = NORM.pack_weights(call, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
    px, ldx = s.input(feeds[call.inputs[0]].transpose(0, 2, 3, 1).astype(dtype))
    pr, ldr = s.input(feeds[call.inputs[1]].transpose(0, 2, 3, 1).astype(dtype)) if len(call.inputs) > 1 else (None, 0)
    py, ldy = s.output((n, h, w, c))
    ctx = Ctx(s, engine.backend.track_a.device)
    p = NORM.prepare_norm(
        dtype, n, h, w, c, x=px, y=py, ldx=ldx, ldy=ldy, r=pr, ldr=ldr,
        weights=[s.weights(packed[name]) for name in call.weights], ctx=ctx, **NORM.attrs_of(call),
    )  # fmt: skip
    launch_all(mods, s, p)
    result = compare(f"norm {kind} {act} {res}", want.transpose(0, 2, 3, 1), s.result().astype(np.float32), TOL[dtype])
    assert result.passed, result


def test_group_statistics_of_one_large_image_are_split_over_many_blocks(engine) -> None:
    """N=1, 32 groups of 512x512 (FACTS 29's shape): the stats launch gives every SM a block."""
    device = engine.backend.track_a.device
    ch = NORM.chunking(1, 512, 512, 32, 32, device.sm_count, lanes=8)
    grid = NORM.stats_launch(1, ch).grid
    assert grid[0] * grid[1] >= device.sm_count


def launch_all(mods, s: Slices, p) -> None:
    for launch in (*p.before, p):
        mods[launch.entry].launch(
            launch.config.grid, launch.config.block, launch.config.shared_bytes, s.be.stream, launch.args
        )


ACTS = {
    "none": Activation(),
    "leakyrelu": Activation(ACTIVATIONS["leakyrelu"], 0.2),
    "clip": Activation(ACTIVATIONS["clip"], -0.5, 0.7),
    "hardsigmoid": Activation(ACTIVATIONS["hardsigmoid"], 0.3, 0.4),
    "elu": Activation(ACTIVATIONS["elu"], 0.7),
}
REF_CASES = [  # N, C, H, W, G, activation, residual, input mean, input std
    (1, 1, 1, 1, 1, "none", "none", 0.5, 2.0),
    (5, 3, 3, 5, 3, "leakyrelu", "after_act", 0.5, 2.0),
    (5, 3, 300, 200, 1, "clip", "none", 0.5, 2.0),
    (1, 8, 300, 200, 2, "elu", "before_act", 0.5, 2.0),
    (5, 8, 1, 1, 4, "hardsigmoid", "none", 0.5, 2.0),
    (1, 20, 3, 5, 20, "leakyrelu", "before_act", 0.5, 2.0),
    (5, 20, 17, 9, 4, "none", "none", 0.5, 2.0),
    (1, 36, 30, 20, 2, "clip", "after_act", 0.5, 2.0),
    (5, 36, 3, 5, 36, "elu", "none", 0.5, 2.0),
    (1, 264, 17, 9, 264, "hardsigmoid", "after_act", 0.5, 2.0),
    (5, 264, 3, 5, 4, "none", "none", 0.5, 2.0),
    (1, 264, 64, 48, 1, "leakyrelu", "none", 0.5, 2.0),
    (1, 8, 300, 200, 8, "none", "none", 100.0, 0.01),  # the cancellation case
    (5, 36, 17, 9, 4, "leakyrelu", "none", 100.0, 0.01),
    (1, 3, 64, 64, 1, "none", "after_act", 100.0, 0.01),
    # C dividing a 16-byte vector (dense at off 0: the flat view, 8/C or 4/C copies of C a vector)
    (5, 2, 30, 20, 1, "leakyrelu", "after_act", 0.5, 2.0),
    (1, 4, 17, 8, 2, "none", "before_act", 0.5, 2.0),
    (1, 1, 64, 64, 1, "clip", "none", 0.5, 2.0),
    (5, 2, 3, 5, 2, "none", "none", 0.5, 2.0),  # 15 pixels: not whole vectors, the scalar path
    (1, 2, 300, 200, 2, "none", "none", 100.0, 0.01),
    # Apply threads streaming several steps, the last one partial (a one-wave grid), and the
    # activations called a value (ELU: dt_activate_rest) over whole vectors with a residual after them
    (2, 8, 512, 512, 8, "leakyrelu", "none", 0.5, 2.0),
    (1, 16, 256, 256, 16, "elu", "after_act", 0.5, 2.0),
    (2, 32, 96, 80, 4, "elu", "before_act", 0.5, 2.0),
]
# Against the float64 reference on the same (dtype-rounded) inputs: as TOL. The cancellation case
# (mean 100, std 0.01) is held to what fp32 statistics can be: a mean within 2 float32 ulps of 100
# (1.5e-5) moves every output by 1.5e-3 std in fp32; fp16 rounds the inputs to 100 and neighbours
# 0.0625 apart (an effective std near 0.003), where the same 2 ulps are 5e-3.
LARGE_MEAN_TOL = {
    "float16": Tolerance(rel_l2=1e-2, max_abs=1e-2, mismatch=0),
    "float32": Tolerance(rel_l2=5e-3, max_abs=2e-3, mismatch=0),
}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize(("n", "c", "h", "w", "groups", "act", "res", "mu", "sd"), REF_CASES)
def test_group_norm_matches_the_float64_reference(
    engine, mods, dtype, off, n, c, h, w, groups, act, res, mu, sd
) -> None:
    """Channel counts, groups and pictures no zoo model has (C 1 to 264, G 1, 2, 4, C, one pixel to
    300x200), residuals, activations with parameters, channel slices (off 3: the scalar path)."""
    s = Slices(engine, dtype, off)
    x = (mu + sd * s.rng.standard_normal((n, h, w, c))).astype(dtype)
    skip = (2 * s.rng.standard_normal((n, h, w, c))).astype(dtype)
    gamma = (1 + 0.5 * s.rng.standard_normal(c)).astype(np.float32)
    beta = (0.5 * s.rng.standard_normal(c)).astype(np.float32)
    want = NORM.reference(x, gamma, beta, groups=groups, res=res, act=ACTS[act], r=skip)
    px, ldx = s.input(x)
    pr, ldr = s.input(skip) if res != "none" else (None, 0)
    py, ldy = s.output((n, h, w, c))
    p = NORM.prepare_norm(
        dtype, n, h, w, c, x=px, y=py, ldx=ldx, ldy=ldy, r=pr, ldr=ldr, groups=groups, res=res, act=ACTS[act],
        weights=[s.weights(gamma), s.weights(beta)], ctx=Ctx(s, engine.backend.track_a.device),
    )  # fmt: skip
    launch_all(mods, s, p)
    tol = LARGE_MEAN_TOL[dtype] if mu > 10 else TOL[dtype]
    got = s.result().astype(np.float32)
    result = compare(f"group norm G={groups} {act} {res}", want.astype(np.float32), got, tol)
    assert result.passed, result


@dataclass
class SharedCtx(Ctx):
    """One zeroed workspace for every launch prepared on it, as the runtime keeps one a call."""

    buffer: int = 0

    def workspace(self, nbytes: int) -> int:
        self.buffer = self.buffer or super().workspace(max(nbytes, 1 << 20))
        return self.buffer


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_statistics_launch_leaves_its_counters_ready_for_the_next(engine, mods, dtype) -> None:
    """Three launches on one workspace (a CUDA graph's replays), each on new data: each one's own
    statistics (the last block of each image resets its arrival counter)."""
    n, h, w, c, groups = 5, 40, 30, 24, 3
    s = Slices(engine, dtype, 0)
    ctx = SharedCtx(s, engine.backend.track_a.device)
    for i in range(3):
        x = (i + (1 + i) * s.rng.standard_normal((n, h, w, c))).astype(dtype)
        px, ldx = s.input(x)
        py, ldy = s.output((n, h, w, c))
        p = NORM.prepare_norm(dtype, n, h, w, c, x=px, y=py, ldx=ldx, ldy=ldy, groups=groups, weights=[], ctx=ctx)
        launch_all(mods, s, p)
        result = compare(f"launch {i}", NORM.reference(x, groups=groups).astype(np.float32), s.result(), TOL[dtype])
        assert result.passed, result


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("c", [96, 264, 768])
def test_layer_norm_of_a_large_mean_matches_the_float64_reference(engine, mods, dtype, c) -> None:
    """The cancellation case (mean 100, std 0.01) over the channels of each pixel: LARGE_MEAN_TOL."""
    n, h, w = 2, 9, 7
    s = Slices(engine, dtype, 0)
    x = (100 + 0.01 * s.rng.standard_normal((n, h, w, c))).astype(dtype)
    gamma = (1 + 0.5 * s.rng.standard_normal(c)).astype(np.float32)
    beta = (0.5 * s.rng.standard_normal(c)).astype(np.float32)
    px, ldx = s.input(x)
    py, ldy = s.output((n, h, w, c))
    p = NORM.prepare_norm(
        dtype, n, h, w, c, x=px, y=py, ldx=ldx, ldy=ldy, kind="layer", eps=1e-6,
        weights=[s.weights(gamma), s.weights(beta)], ctx=Ctx(s, engine.backend.track_a.device),
    )  # fmt: skip
    launch_all(mods, s, p)
    want = NORM.reference(x, gamma, beta, kind="layer", eps=1e-6).astype(np.float32)
    result = compare(f"layer norm C={c}", want, s.result().astype(np.float32), LARGE_MEAN_TOL[dtype])
    assert result.passed, result
