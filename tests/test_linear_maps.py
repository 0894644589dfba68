"""Linear spatial maps (compiler/linear_maps.py): an exporter's index soup over an image's pixels becomes one
MatMul by a constant map, checked against the soup itself in onnxruntime (fp32: within 1e-5 of the output's
largest magnitude; fp16: 1e-3), on fresh N(0, 1) inputs. What is not such a map (nonlinear, affine, mixing
channels) and what has no index op (a Resize, a Slice and Pad) is left exactly as it was.

The soups are built here as torch's dynamo exporter writes ``nn.AdaptiveAvgPool2d`` whose bins do not divide
the map (Transpose -> GatherND -> Transpose -> Where -> Gather per bin offset -> Add chain -> Div), at shapes
no zoo model has; one test exports the torch module itself where torch is installed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import frontend, linear_maps, verify
from dualtrack.compiler.config import DEFAULT_TOLERANCES, BuildConfig
from dualtrack.compiler.linear_maps import linear_maps_as_matmuls

FP32_REL = 1e-5  # the rewrite against the soup, relative to the output's largest magnitude
FP16_REL = 1e-3


class Soup:
    """A graph under construction: nodes, constants, and fresh tensor names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, value: np.ndarray) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, *inputs: str, **attrs) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"{op.lower()}_{len(self.nodes)}", **attrs))
        return out

    def model(self, x_shape: list[int], y: str, elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "soup",
            [helper.make_tensor_value_info("x", elem, x_shape)],
            [helper.make_tensor_value_info(y, elem, None)],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        model.graph.output[0].CopyFrom(inferred.graph.output[0])
        return model


def _bins(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive pooling bins: [floor(i * size / out), ceil((i + 1) * size / out))."""
    i = np.arange(out)
    return (i * size) // out, -((-(i + 1) * size) // out)


def adaptive_pool(
    s: Soup, x: str, hw: tuple[int, int], out: tuple[int, int], dtype=np.float32, baked_batch: bool = False
) -> str:
    """x (N, C, H, W) average-pooled into ``out`` bins, as the dynamo exporter decomposes it. ``baked_batch``:
    an export at batch 1 whose GatherND indices hold the batch index (the output's batch is the indices')."""
    (h, w), (ho, wo) = hw, out
    (h0, h1), (w0, w1) = _bins(h, ho), _bins(w, wo)
    kh, kw = int(max(h1 - h0)), int(max(w1 - w0))
    rows = np.minimum(h0[:, None] + np.arange(kh), h - 1)  # (ho, kh), clipped where the bin is shorter
    cols = np.minimum(w0[:, None] + np.arange(kw), w - 1)  # (wo, kw)
    grid = np.stack(np.broadcast_arrays(rows[:, :, None, None], cols[None, None, :, :]), axis=-1)
    if baked_batch:
        grid = np.concatenate([np.zeros((*grid.shape[:-1], 1), np.int64), grid], axis=-1)
        t = s.op("GatherND", s.op("Transpose", x, perm=[0, 2, 3, 1]), s.const(grid.astype(np.int64)))
        t = s.op("Unsqueeze", s.op("Transpose", t, perm=[4, 0, 1, 2, 3]), s.const(np.array([0], np.int64)))
    else:
        t = s.op("GatherND", s.op("Transpose", x, perm=[2, 3, 0, 1]), s.const(grid.astype(np.int64)))
        t = s.op("Transpose", t, perm=[4, 5, 0, 1, 2, 3])  # (N, C, ho, kh, wo, kw)
    past_h = (h0[:, None] + np.arange(kh)) >= h1[:, None]
    past_w = (w0[:, None] + np.arange(kw)) >= w1[:, None]
    zero = s.const(np.array(0, dtype))
    t = s.op("Where", s.const(past_h.reshape(ho, kh, 1, 1)), zero, t)
    t = s.op("Where", s.const(past_w), zero, t)
    total = None
    for a in range(kh):
        row = s.op("Gather", t, s.const(np.array(a, np.int64)), axis=3)
        for b in range(kw):
            one = s.op("Gather", row, s.const(np.array(b, np.int64)), axis=4)
            total = one if total is None else s.op("Add", total, one)
    counts = ((h1 - h0)[:, None] * (w1 - w0)[None, :]).astype(dtype)
    return s.op("Div", total, s.const(counts))


def pooled(shape: tuple[int, int, int, int], out: tuple[int, int], dtype=np.float32, **kw) -> onnx.ModelProto:
    s = Soup()
    y = adaptive_pool(s, "x", shape[2:], out, dtype, **kw)
    return s.model(list(shape), y, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _numpy_pool(x: np.ndarray, out: tuple[int, int]) -> np.ndarray:
    (h0, h1), (w0, w1) = _bins(x.shape[2], out[0]), _bins(x.shape[3], out[1])
    y = np.zeros((*x.shape[:2], *out), np.float64)
    for i in range(out[0]):
        for j in range(out[1]):
            y[:, :, i, j] = x[:, :, h0[i] : h1[i], w0[j] : w1[j]].mean(axis=(2, 3))
    return y


def _close(got: np.ndarray, ref: np.ndarray, rel: float) -> None:
    assert got.shape == ref.shape
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=0, atol=rel * scale)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# -- (a) the soup becomes one MatMul ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "out"),
    [((2, 7, 13, 11), (5, 3)), ((1, 3, 9, 14), (4, 6)), ((3, 5, 7, 7), (3, 2)), ((2, 1, 12, 10), (5, 1))],
)
def test_an_adaptive_average_pool_soup_becomes_one_matmul_equal_to_it(
    shape: tuple[int, int, int, int], out: tuple[int, int]
) -> None:
    model = pooled(shape, out)
    rewritten, report = linear_maps_as_matmuls(model, shape[0])
    assert _ops(rewritten) == ["Reshape", "MatMul", "Reshape"]
    onnx.checker.check_model(rewritten, full_check=True)
    nodes = len(model.graph.node)
    assert report.lines() == [
        f"1 region(s) ({nodes} nodes) -> MatMul by a constant spatial map: "
        f"'x' ({shape[1]}, {shape[2]}x{shape[3]}) -> '{model.graph.output[0].name}' {out[0]}x{out[1]}"
    ]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ref = _run(model, x)
    _close(ref, _numpy_pool(x, out), FP32_REL)  # the soup built here is the pool it claims to be
    _close(_run(rewritten, x), ref, FP32_REL)


def test_an_fp16_soup_becomes_an_fp16_matmul() -> None:
    shape, out = (2, 6, 11, 9), (4, 5)
    model = pooled(shape, out, dtype=np.float16)
    rewritten, _ = linear_maps_as_matmuls(model, shape[0])
    assert _ops(rewritten) == ["Reshape", "MatMul", "Reshape"]
    matrix = next(i for i in rewritten.graph.initializer if i.dims == [11 * 9, 4 * 5])
    assert matrix.data_type == TensorProto.FLOAT16
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float16)
    _close(_run(rewritten, x), _numpy_pool(x.astype(np.float64), out), FP16_REL)


def test_torch_dynamo_export_of_adaptive_avg_pool_becomes_one_matmul() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    module, x = torch.nn.AdaptiveAvgPool2d((5, 3)), torch.randn(2, 7, 13, 11)
    model = torch.onnx.export(module, (x,), dynamo=True, verbose=False).model_proto
    assert "GatherND" in _ops(model)
    rewritten, report = linear_maps_as_matmuls(model, 2)
    assert _ops(rewritten) == ["Reshape", "MatMul", "Reshape"], report.lines()
    xs = np.random.default_rng(3).standard_normal((2, 7, 13, 11)).astype(np.float32)
    _close(_run(rewritten, xs), module(torch.from_numpy(xs)).numpy(), FP32_REL)
    _close(_run(rewritten, xs), _run(model, xs), FP32_REL)


def test_two_pools_of_one_map_become_two_matmuls_of_one_region() -> None:
    s = Soup()
    a = adaptive_pool(s, "x", (10, 13), (3, 3))
    b = adaptive_pool(s, "x", (10, 13), (6, 4))
    # Both pooled maps read by a Conv each, outside the region.
    w3, w6 = s.const(np.full((2, 4, 1, 1), 0.5, np.float32)), s.const(np.full((2, 4, 1, 1), -0.25, np.float32))
    sizes = s.const(np.array([1, 2, 6, 4], np.int64))
    y = s.op("Add", s.op("Resize", s.op("Conv", a, w3), "", "", sizes, mode="linear"), s.op("Conv", b, w6))
    model = s.model([1, 4, 10, 13], y)
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert _ops(rewritten).count("MatMul") == 2 and "GatherND" not in _ops(rewritten)
    assert _ops(rewritten).count("Reshape") == 3  # the source flattened once
    assert "1 region(s)" in report.lines()[0] and "3x3" in report.lines()[0] and "6x4" in report.lines()[0]
    x = np.random.default_rng(4).standard_normal((1, 4, 10, 13)).astype(np.float32)
    _close(_run(rewritten, x), _run(model, x), FP32_REL)


# -- (b) what is not a per-channel linear map is left as it was -----------------------------------------


def _soup_then(make) -> onnx.ModelProto:
    s = Soup()
    y = make(s, adaptive_pool(s, "x", (9, 7), (4, 3)))
    return s.model([1, 3, 9, 7], y)


@pytest.mark.parametrize(
    ("case", "make"),
    [
        ("affine", lambda s, t: s.op("Add", t, s.const(np.full((1, 1, 4, 3), 0.5, np.float32)))),
        ("quadratic", lambda s, t: s.op("Mul", t, t)),
        ("mixes channels", lambda s, t: s.op("Gather", t, s.const(np.array([2, 0, 1], np.int64)), axis=1)),
    ],
)
def test_a_region_that_is_not_one_map_per_channel_fails_the_check_and_stays(case: str, make) -> None:
    model = _soup_then(make)
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert rewritten is model
    assert len(report.lines()) == 1
    assert report.lines()[0].startswith("left as exported: the region from 'x'")
    assert "is not one linear map of each channel's pixels" in report.lines()[0]


def test_a_relu_inside_the_soup_stops_the_region_and_nothing_is_rewritten() -> None:
    s = Soup()
    t = s.op("GatherND", s.op("Transpose", "x", perm=[2, 3, 0, 1]), s.const(np.zeros((2, 2, 2), np.int64)))
    t = s.op("Transpose", s.op("Relu", t), perm=[2, 3, 0, 1])  # (N, C, 2, 2), nonlinear on the way
    model = s.model([1, 3, 5, 5], s.op("Div", t, s.const(np.array(2.0, np.float32))))
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert rewritten is model and report.lines() == []


@pytest.mark.parametrize("case", ["resize", "slice and pad"])
def test_a_region_without_an_index_op_is_left_to_the_other_passes(case: str) -> None:
    s = Soup()
    if case == "resize":
        y = s.op("Resize", "x", "", s.const(np.array([1, 1, 2, 0.5], np.float32)), mode="linear")
    else:
        t = s.op("Slice", "x", *(s.const(np.array(v, np.int64)) for v in ([1, 1], [7, 5], [2, 3])))
        y = s.op("Pad", t, s.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)))
    model = s.model([1, 3, 8, 6], y)
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert rewritten is model and report.lines() == []


def test_a_map_that_moves_no_pixel_is_left_as_the_element_wise_op_it_is() -> None:
    """x + x[0] at a batch of 1 is 2x: linear, but a diagonal map, which a dense MatMul would only slow down."""
    s = Soup()
    model = s.model([1, 3, 6, 5], s.op("Add", "x", s.op("Gather", "x", s.const(np.array(0, np.int64)), axis=0)))
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert rewritten is model and report.lines() == []


def test_a_map_over_the_size_bound_stays_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_maps, "MAX_ELEMENTS", 9 * 7 * 4 * 3 - 1)
    model = pooled((1, 3, 9, 7), (4, 3))
    rewritten, report = linear_maps_as_matmuls(model, 1)
    assert rewritten is model
    assert f"would have {9 * 7 * 4 * 3} elements, over {9 * 7 * 4 * 3 - 1}" in report.lines()[0]


# -- (c) the batch ----------------------------------------------------------------------------------------


def test_a_batch_one_export_with_the_batch_in_its_indices_runs_at_batch_three() -> None:
    """The GatherND indices hold batch index 0: the export computes image 0 whatever its batch; the MatMul
    computes every image, as the export does run one image at a time."""
    model = pooled((1, 4, 11, 8), (3, 5), baked_batch=True)
    rewritten, _ = linear_maps_as_matmuls(model, 1)
    assert _ops(rewritten) == ["Reshape", "MatMul", "Reshape"]
    rewritten.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    x = np.random.default_rng(5).standard_normal((3, 4, 11, 8)).astype(np.float32)
    ref = np.concatenate([_run(model, x[k : k + 1]) for k in range(3)])
    got = _run(rewritten, x)
    assert got.shape == (3, 4, 3, 5)
    _close(got, ref, FP32_REL)


# -- (d) through the front end ----------------------------------------------------------------------------


def _net_with_a_pool(batch: int) -> onnx.ModelProto:
    """Conv -> the soup (batch index in its indices) -> Conv, as a segmentation export at batch ``batch``."""
    rng = np.random.default_rng(6)
    s = Soup()
    t = s.op("Conv", "x", s.const(rng.normal(0, 0.5, (6, 3, 3, 3)).astype(np.float32)), pads=[1, 1, 1, 1])
    t = adaptive_pool(s, t, (14, 10), (5, 3), baked_batch=True)
    y = s.op("Conv", t, s.const(rng.normal(0, 0.5, (2, 6, 1, 1)).astype(np.float32)))
    return s.model([batch, 3, 14, 10], y)


def test_the_front_end_rewrites_the_soup_and_the_build_takes_any_batch() -> None:
    """Without the stage, batch freeing meets a GatherND that indexes the batch and refuses batch 3."""
    cfg = BuildConfig(model=Path("export.onnx"), batch_sizes=(1, 3))
    fe = frontend.prepare(cfg, _net_with_a_pool(1))
    assert "GatherND" not in _ops(fe.body) and "MatMul" in _ops(fe.body)
    assert any(n.startswith("front end: linear-maps: 1 region(s)") for n in fe.notes()), fe.notes()
    checks = verify.check_frontend(fe, (1, 3), DEFAULT_TOLERANCES["fp32"], seed=0)
    assert all(c.passed for c in checks), [verify.Report.line(c) for c in checks]


def test_the_map_is_the_size_of_the_pool_not_of_the_image() -> None:
    model = pooled((1, 2, 13, 11), (5, 3))
    rewritten, _ = linear_maps_as_matmuls(model, 1)
    matrix = next(i for i in rewritten.graph.initializer if len(i.dims) == 2)
    assert list(matrix.dims) == [13 * 11, 5 * 3]
    m = numpy_helper.to_array(matrix)
    # Each output pixel's weights: 1 / its bin's size over its bin, summing to 1 (the largest bin is 4 x 5).
    assert np.allclose(m.sum(axis=0), 1.0) and math.isclose(float(m[m > 0].min()), 1 / 20, rel_tol=1e-6)
