"""The general max-pool (op ``maxpool``, maxpool_nhwc.cu) without a GPU: which windows its spec takes
and why not, its output sizes (ceil_mode included) and numpy reference against onnxruntime on random
inputs, its launch and argument list, and the partition's routing of MaxPool nodes on small ONNX
graphs built here (the general kernel, maxpool2x2 for 2x2 / stride 2, Track B and why)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from test_partition_conv import Graph, a_calls, plan_of, track_a_matches_onnxruntime

from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError, PartitionError
from dualtrack.kernels import KERNELS, MaxPoolSpec, PoolGeometry
from dualtrack.runtime.tensors import GpuTensor

POOL = KERNELS["maxpool"]
assert isinstance(POOL, MaxPoolSpec)
RNG = np.random.default_rng()
STEM = PoolGeometry(3, 3, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)  # ResNet's 3x3/2 pad 1


def ort_maxpool(x_nhwc: np.ndarray, g: PoolGeometry) -> np.ndarray:
    """onnxruntime's MaxPool of an NHWC array (run in NCHW, its layout), back as NHWC."""
    elem = helper.np_dtype_to_tensor_dtype(x_nhwc.dtype)
    x = np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))
    node = helper.make_node(
        "MaxPool", ["x"], ["y"], kernel_shape=[g.R, g.S], strides=[g.stride_h, g.stride_w],
        dilations=[g.dil_h, g.dil_w], pads=[g.pad_top, g.pad_left, g.pad_bottom, g.pad_right], ceil_mode=g.ceil_mode,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("x", elem, x.shape)],
        [helper.make_tensor_value_info("y", elem, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0].transpose(0, 2, 3, 1)


def pool_loops(x: np.ndarray, g: PoolGeometry) -> np.ndarray:
    """ONNX MaxPool by its definition, one output element at a time in float64 (padded taps skipped)."""
    N, H, W, C = x.shape
    Ho, Wo = g.output_hw(H, W)
    out = np.empty((N, Ho, Wo, C), np.float64)
    for n, ho, wo, c in np.ndindex(N, Ho, Wo, C):
        taps = [
            float(x[n, h, w, c])
            for r in range(g.R)
            for s in range(g.S)
            if 0 <= (h := ho * g.stride_h - g.pad_top + r * g.dil_h) < H
            and 0 <= (w := wo * g.stride_w - g.pad_left + s * g.dil_w) < W
        ]
        out[n, ho, wo, c] = math.nan if any(map(math.isnan, taps)) else max(taps)
    return out


# -- what the spec takes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("g", "hwc", "dtype", "why"),
    [
        (STEM, (256, 256, 64), "float16", None),
        (PoolGeometry(15, 1, 1, 1, pad_top=7, pad_bottom=7), (9, 4, 3), "float32", None),  # the largest window
        (PoolGeometry(257, 3), (300, 80, 8), "float16", "kernel 257x3: the max-pool takes 1..256 a side"),
        (PoolGeometry(3, 3, 0, 1), (8, 8, 8), "float16", "strides 0,1 dilations 1,1: each must be >= 1"),
        (PoolGeometry(3, 3, pad_top=-1), (8, 8, 8), "float16", "negative padding"),
        (PoolGeometry(2, 2, ceil_mode=2), (8, 8, 8), "float16", "ceil_mode 2"),
        (PoolGeometry(5, 5), (4, 9, 8), "float16", "has an empty output \\(0x5\\)"),
        (STEM, (8, 8, 8), "int8", "dtype int8 has no Track A kernel"),
        # taps 3 apart on a 2-pixel image: the window of output row 0 is rows -1 and 2, both padding
        (PoolGeometry(2, 2, dil_h=3, pad_top=1, pad_bottom=1), (2, 4, 8), "float16", "output row 0's window lies"),
        (PoolGeometry(3, 3, 1, 1, pad_left=2, pad_right=2), (5, 5, 1), "float32", None),  # pads < kernel: fine
        (PoolGeometry(2, 2, 1, 1, pad_left=2, pad_right=2), (5, 5, 1), "float32", "output column 0's window lies"),
    ],
)
def test_supports_says_which_windows_the_kernel_takes(g, hwc, dtype, why) -> None:
    got = POOL.supports(dtype, *hwc, g)
    if why is None:
        assert got is None
    else:
        assert got is not None and re.search(why, got), got


@pytest.mark.parametrize(
    ("g", "hw", "out"),
    [
        (STEM, (256, 256), (128, 128)),  # the smp / ResNet stem
        (STEM, (255, 7), (128, 4)),
        (PoolGeometry(2, 2, 2, 2), (7, 6), (3, 3)),  # floor: the odd last row is dropped
        (PoolGeometry(2, 2, 2, 2, ceil_mode=1), (7, 6), (4, 3)),  # ceil: a partial last window
        # ceil_mode, whose last window would start in the bottom/right padding: dropped (onnxruntime, PyTorch)
        (PoolGeometry(2, 2, 2, 2, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, ceil_mode=1), (5, 5), (3, 3)),
        (PoolGeometry(3, 3, 2, 2, ceil_mode=1), (8, 9), (4, 4)),
        (PoolGeometry(3, 2, 3, 1, dil_h=2, dil_w=3, pad_bottom=2, ceil_mode=1), (10, 6), (4, 3)),
    ],
)
def test_output_size_follows_onnxruntime(g: PoolGeometry, hw: tuple[int, int], out: tuple[int, int]) -> None:
    assert g.output_hw(*hw) == out
    x = RNG.standard_normal((1, *hw, 2)).astype(np.float32)
    assert ort_maxpool(x, g).shape[1:3] == out
    assert POOL.output_shape(3, *hw, 2, 0, g) == (3, *out, 2)


def random_geometry(rng: np.random.Generator) -> PoolGeometry:
    R, S = (int(v) for v in rng.integers(1, 6, 2))
    pads = [int(rng.integers(0, k)) for k in (R, S, R, S)]  # onnxruntime takes pads < kernel
    strides, dils = rng.integers(1, 4, 2), rng.integers(1, 3, 2)
    return PoolGeometry(R, S, *map(int, strides), *map(int, dils), *pads, ceil_mode=int(rng.integers(0, 2)))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_reference_matches_onnxruntime_on_random_windows(dtype: str) -> None:
    """Random windows (strides, dilations, pads, ceil_mode) on random odd images; inputs all below
    zero in half the cases, so a padded tap read as 0 instead of -inf would win and show."""
    checked = 0
    while checked < 60:
        g = random_geometry(RNG)
        N, H, W, C = 2, *(int(v) for v in RNG.integers(1, 12, 3))
        if POOL.supports(dtype, H, W, C, g):
            continue
        x = RNG.standard_normal((N, H, W, C))
        if checked % 2:
            x = -np.abs(x) - 1
        x = x.astype(dtype)
        ref = POOL.reference(x, g)
        assert ref.dtype == np.dtype(dtype) and ref.shape == POOL.output_shape(N, H, W, C, 0, g)
        np.testing.assert_array_equal(ref, ort_maxpool(x, g), err_msg=str(g))  # max is exact
        checked += 1


def test_reference_propagates_nan_and_matches_the_definition() -> None:
    g = PoolGeometry(3, 2, 2, 1, dil_w=2, pad_top=1, pad_left=1, pad_bottom=2, pad_right=0, ceil_mode=1)
    x = RNG.standard_normal((2, 9, 8, 5)).astype(np.float16)
    x[0, 4, 3, 1] = x[1, 0, 0, 4] = np.nan
    ref = POOL.reference(x, g)
    np.testing.assert_array_equal(ref.astype(np.float64), pool_loops(x, g))
    assert np.isnan(ref[0, ..., 1]).sum() >= 2 and not np.isnan(ref[0, ..., 0]).any()


def test_reference_refuses_what_the_kernel_refuses() -> None:
    with pytest.raises(InputError, match="lies wholly in the padding"):
        POOL.reference(np.ones((1, 2, 4, 8), np.float32), PoolGeometry(2, 2, dil_h=3, pad_top=1, pad_bottom=1))
    with pytest.raises(InputError, match=r"takes x \(N,H,W,C\)"):
        POOL.reference(np.ones((2, 4, 8), np.float32), STEM)
    with pytest.raises(InputError, match="keeps the channels"):
        POOL.output_shape(1, 8, 8, 4, 5, STEM)


# -- launch and arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("N", "H", "W", "C"), [(8, 256, 256, 64), (1, 7, 5, 3), (3, 33, 17, 12), (2, 1, 1, 1)])
def test_launch_covers_every_output_chunk(dtype: str, N: int, H: int, W: int, C: int) -> None:
    g = STEM if H > 1 else PoolGeometry(1, 1)
    cfg = POOL.launch(dtype, N, H, W, C, 0, g)
    Ho, Wo = g.output_hw(H, W)
    work = N * Ho * Wo * math.ceil(C / POOL.vector(dtype))  # one thread per 16-byte chunk
    threads = cfg.grid[0] * cfg.block[0]
    assert threads >= work and threads - work < cfg.block[0] and cfg.shared_bytes == 0
    assert POOL.vector("float16") == 8 and POOL.vector("float32") == 4
    assert POOL.defines() == {"MAXPOOL_THREADS": 256, "MAXPOOL_VEC_F16": 8, "MAXPOOL_VEC_F32": 4}


def test_a_call_prepares_its_window_and_channel_slices() -> None:
    """A plan call's attrs are the window; x and y may be channel slices (ldx, ldy > C)."""
    call = KernelCall("maxpool", ("x",), ("y",), (), STEM.attrs(), ("/encoder/maxpool/MaxPool",))
    assert PoolGeometry.from_call(call) == STEM
    x = GpuTensor(0x1000, (2, 9, 10, 24), np.dtype("float16"), ld=40)
    y = GpuTensor(0x2000, (2, 5, 5, 24), np.dtype("float16"), ld=64)
    p = POOL.prepare(call, x, y, [], None)  # type: ignore[arg-type]  # no context needed
    assert p.entry == "maxpool_nhwc_f16" and p.config == POOL.launch("float16", 2, 9, 10, 24, 0, STEM)
    # ... pt, pl, then pb, pr and the mode (max: 0), which only an average pool reads
    assert [v for v, _ in p.args] == [0x1000, 0x2000, 2, 9, 10, 24, 5, 5, 40, 64, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 0, 1]
    with pytest.raises(InputError, match="output \\(2, 4, 5, 24\\) is not \\(2, 5, 5, 24\\)"):
        POOL.prepare(call, x, GpuTensor(0x2000, (2, 4, 5, 24), np.dtype("float16")), [], None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="no R/S attribute"):
        PoolGeometry.from_call(KernelCall("maxpool", ("x",), ("y",)))


# -- the partition: which MaxPool goes where -------------------------------------------------------


def pool_graph(c: int, h: int, w: int, **attrs) -> onnx.ModelProto:
    g = Graph(c, h, w)
    conv = g.conv("a/conv", "x0", c, c, 3, 3, pads=[1, 1, 1, 1])
    relu = g.op("Relu", "a/relu", [conv])
    pool = g.op("MaxPool", "a/pool", [relu], **attrs)
    return g.model(g.conv("a/conv2", pool, c, c, 1, 1))


def test_resnet_stem_pool_lowers_to_the_general_kernel(tmp_path: Path) -> None:
    model = pool_graph(16, 17, 14, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    plan = plan_of(model, tmp_path)
    (call,) = [c for c in a_calls(plan) if c.nodes == ("a/pool",)]
    assert call.op == "maxpool" and PoolGeometry.from_call(call) == STEM
    track_a_matches_onnxruntime(model, plan)


def test_ceil_mode_same_padding_and_dilation_lower_and_match_onnxruntime(tmp_path: Path) -> None:
    for attrs in (
        {"kernel_shape": [3, 2], "strides": [2, 3], "ceil_mode": 1},
        {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
        {"kernel_shape": [2, 3], "dilations": [2, 2], "pads": [1, 0, 1, 2]},
    ):
        model = pool_graph(12, 11, 13, **attrs)
        plan = plan_of(model, tmp_path)
        (call,) = [c for c in a_calls(plan) if c.nodes == ("a/pool",)]
        assert call.op == "maxpool", attrs
        track_a_matches_onnxruntime(model, plan)


def test_a_plain_2x2_pool_keeps_its_specialised_kernel(tmp_path: Path) -> None:
    plan = plan_of(pool_graph(8, 10, 9, kernel_shape=[2, 2], strides=[2, 2]), tmp_path)
    (call,) = [c for c in a_calls(plan) if c.nodes == ("a/pool",)]
    assert (call.op, call.attrs) == ("maxpool2x2", ())
    # SAME_UPPER pads an odd image: no longer the plain window, so the general kernel takes it
    plan = plan_of(pool_graph(8, 9, 9, kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER"), tmp_path)
    (call,) = [c for c in a_calls(plan) if c.nodes == ("a/pool",)]
    assert call.op == "maxpool" and PoolGeometry.from_call(call).pad_bottom == 1


def support(model: onnx.ModelProto, node: str) -> str | None:
    named = partition.name_nodes(model)
    ctx = partition.SupportContext.of(named, partition.infer_specs(named))
    return partition.track_a_support(next(n for n in named.graph.node if n.name == node), ctx)


def test_what_stays_on_track_b_says_why(tmp_path: Path) -> None:
    g = Graph(8, 10, 10)
    g.nodes.append(helper.make_node("MaxPool", ["x0"], ["p", "idx"], name="a/pool", kernel_shape=[3, 3]))
    indices = g.model("p")
    assert "an Indices output" in (support(indices, "a/pool") or "")
    # onnx 1.23's shape inference keeps ceil_mode's last window, onnxruntime drops it: 4 against 3 rows
    disagree = pool_graph(4, 5, 5, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    why = support(disagree, "a/pool") or ""
    assert "the graph says (4, 4), onnxruntime computes (3, 3)" in why
    fix = r"move it to Track B with partition\.track_b\.name_prefixes: \['a/pool'\]"
    with pytest.raises(PartitionError, match=fix):
        plan_of(disagree, tmp_path)
    assert "kernel 257x3" in (support(pool_graph(4, 300, 80, kernel_shape=[257, 3]), "a/pool") or "")


def test_auto_puts_the_pool_on_track_a_with_its_cost(tmp_path: Path) -> None:
    model = pool_graph(16, 33, 31, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"  # as the front end leaves it for (1, 8)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    cfg = BuildConfig(model=path, targets=(), batch_sizes=(1, 8), partition=PartitionConfig(mode="auto"))
    p = partition.partition_model(cfg, partition.name_nodes(model))
    (d,) = [d for d in p.assignment.decisions if d.node == "a/pool"]
    assert d.track == "A" and d.why == "a Track A kernel takes it"
    assert d.a_us is not None and 0 < d.a_us < d.b_us  # the SIMT roofline, bytes-bound, under IREE's
    assert [s.track for s in p.plan.segments] == ["B", "A", "B"]
    assert "maxpool" in {c.op for s in p.plan.segments for c in s.calls}
