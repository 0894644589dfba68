"""The norm kernels (handwritten_ptx/norm_nhwc.cu: group statistics split over chunks, finalize, apply;
the per-pixel LayerNorm; the BatchNorm affine) on a real GPU against onnxruntime in fp32, in fp16
and fp32: odd and large pictures (17x33, 256x256), C = 5, 32, 96, G = 1, 4, C, eps 1e-5 and 1e-3,
with and without an activation and a residual, read from and written into channel slices (ld > C,
offsets that keep or break the fp16 vector path's 16-byte alignment). The outputs are poisoned (NaN)
first, so an element the kernel does not write fails. The cases' ONNX models and lowering are
tests/norm_cases.py's; the launches are kernels.norm's (NormSpec.prepare_norm), so the split the
runtime plans is what runs.

Tolerance: fp32 max |diff| 1e-4 and rel-L2 1e-5 (summation order only); fp16 (onnxruntime fed the
same fp16-rounded inputs, the kernel rounds once) max |diff| 1e-2 and rel-L2 2e-3: one fp16 ulp of
values up to ~8."""

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
    for launch in (*p.before, p):
        mods[launch.entry].launch(
            launch.config.grid, launch.config.block, launch.config.shared_bytes, s.be.stream, launch.args
        )
    result = compare(f"norm {kind} {act} {res}", want.transpose(0, 2, 3, 1), s.result().astype(np.float32), TOL[dtype])
    assert result.passed, result


def test_group_statistics_of_one_large_image_are_split_over_many_blocks(engine) -> None:
    """N=1, 32 groups of 512x512 (FACTS 29's shape): the stats launch has at least 4 blocks per SM."""
    device = engine.backend.track_a.device
    ch = NORM.chunking(1, 512, 512, 32, 32, device.sm_count)
    assert NORM.stats_launch(1, 32, ch).grid[1] >= 4 * device.sm_count
