"""bench/reweight.py: the drawn weights' calibration (seal) and their exact regrowth (regrow).

The net: an fp16 chain whose channels keep scales s (log-uniform over [0.1, 10]) layer after layer,
each layer diag(s) Q diag(1/s) with Q orthogonal: the export's weights are small where their input
channel is large. A redraw keeps each row's mean and std but not that column structure, so every layer
multiplies the activations by about rms(s) * rms(1/s) (~11): fp16 overflows. Calibrated, every layer's
output keeps the export's RMS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import reweight

C, DEPTH = 96, 6  # 96 x 96 weights: drawn (over EXACT_MAX elements)


def _net(seed: int) -> tuple[onnx.ModelProto, list[str]]:
    """fp32 input -> Cast fp16 -> 1x1 Conv diag(s) Q -> DEPTH 1x1 Convs -> MatMul (per-tensor factor)."""
    rng = np.random.default_rng(seed)
    s = 10.0 ** rng.uniform(-1, 1, C)

    def q() -> np.ndarray:
        return np.linalg.qr(rng.standard_normal((C, C)))[0]

    def init(name: str, a: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(a.astype(np.float16), name)

    inits = [init("w0", (s[:, None] * q()).reshape(C, C, 1, 1))]
    inits += [init(f"w{k}", (s[:, None] * q() / s[None, :]).reshape(C, C, 1, 1)) for k in range(1, DEPTH + 1)]
    inits += [init(f"b{k}", 0.01 * s * rng.standard_normal(C)) for k in range(DEPTH + 1)]
    inits.append(init("wm", q() * s[None, :] / s[:, None]))  # y = t @ B: B[j, i] = Q[j, i] s_i / s_j
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16)]
    prev, outs = "h", []
    for k in range(DEPTH + 1):
        nodes.append(helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"]))
        prev = f"c{k}"
        outs.append(prev)
    nodes.append(helper.make_node("Transpose", [prev], ["t"], perm=[0, 2, 3, 1]))
    nodes.append(helper.make_node("MatMul", ["t", "wm"], ["y"]))
    outs.append("y")
    graph = helper.make_graph(
        nodes,
        "lift",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), outs


def _run(model: onnx.ModelProto, values: dict[str, np.ndarray], outs: list[str], x: np.ndarray) -> list[np.ndarray]:
    """The net with ``values`` as its initializers, every layer's output."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for i in m.graph.initializer:
        i.CopyFrom(numpy_helper.from_array(values[i.name], i.name))
    del m.graph.output[:]
    m.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in outs)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(outs, {"x": x})


def _values(model: onnx.ModelProto, regrow: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for i in model.graph.initializer:
        shape, dtype = tuple(i.dims), helper.tensor_dtype_to_np_dtype(i.data_type)
        out[i.name] = (
            regrow[f"exact/{i.name}"] if f"exact/{i.name}" in regrow else reweight.drawn(i.name, shape, dtype, regrow)
        )
    return out


def _manifest(model: onnx.ModelProto) -> dict:
    """A manifest's weight index for the net (weights.bin's layout)."""
    index, offset = {}, 0
    for i in model.graph.initializer:
        length = 2 * int(np.prod(i.dims))
        index[i.name] = {"dtype": "float16", "shape": list(i.dims), "offset": offset, "length": length}
        offset += length
    return {"weights": index}


@pytest.fixture(scope="module")
def net() -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    model, outs = _net(1)
    export = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return model, outs, export


def test_naive_redraw_overflows_fp16(net) -> None:
    """The premise: drawn without calibration, the net's fp16 activations overflow on random inputs."""
    model, outs, export = net
    x = np.random.default_rng(7).standard_normal((2, C, 8, 8)).astype(np.float32)
    assert all(np.isfinite(y).all() and np.abs(y.astype(np.float32)).max() < 100 for y in _run(model, export, outs, x))
    ys = _run(model, _values(model, reweight.statistics(export)), outs, x)
    assert not np.isfinite(ys[-1]).all()


def test_calibrated_draw_keeps_the_exports_scale(net) -> None:
    """After calibration every layer's RMS on a fresh random input (not the calibration's) is within
    25% of the export's, and the fp16 net stays finite; the MatMul takes one factor, each Conv one per
    output channel."""
    model, outs, export = net
    regrow = reweight.statistics(export)
    line = reweight.calibrate(model, regrow)
    assert f"{DEPTH + 2} layers in {DEPTH + 2} waves" in line, line
    assert regrow["scale/w1"].shape == (C,) and np.ptp(regrow["scale/wm"]) == 0
    x = np.random.default_rng(11).standard_normal((2, C, 8, 8)).astype(np.float32)
    got = _run(model, _values(model, regrow), outs, x)
    want = _run(model, export, outs, x)
    for name, g, w in zip(outs, got, want, strict=True):
        assert np.isfinite(g).all(), name
        rms_g, rms_w = (float(np.sqrt(np.mean(np.square(v.astype(np.float64))))) for v in (g, w))
        assert abs(rms_g / rms_w - 1) < 0.25, (name, rms_g, rms_w)


def test_regrow_reproduces_the_calibrated_bytes(net, tmp_path: Path) -> None:
    """weights.bin from the saved regrow file equals the calibrated draw, byte for byte, and differs from
    the uncalibrated one."""
    model, _, export = net
    regrow = reweight.statistics(export)
    plain = reweight._grown(_manifest(model), regrow)
    reweight.calibrate(model, regrow)
    sealed = reweight._grown(_manifest(model), regrow)
    np.savez_compressed(tmp_path / reweight.REGROW, **regrow)
    with np.load(tmp_path / reweight.REGROW) as z:
        assert reweight._grown(_manifest(model), z) == sealed
    assert sealed != plain
    values = _values(model, regrow)
    assert sealed == b"".join(values[i.name].astype("<f2").tobytes() for i in model.graph.initializer)


def test_waves_follow_depth_and_leave_shared_weights() -> None:
    """A residual block: b reads a; c reads a + b, so wave 3; a weight two nodes read is left out."""
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"]),
        helper.make_node("Conv", ["a", "wb"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Conv", ["s", "wc"], ["c"]),
        helper.make_node("Conv", ["c", "ws"], ["d"]),
        helper.make_node("Conv", ["d", "ws"], ["e"]),
        helper.make_node("Cast", ["wf32"], ["wf"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["x", "wf"], ["f"]),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    plan = reweight.waves(graph, {"wa", "wb", "wc", "ws", "wf32"})
    assert [[(la.output, la.weight, la.per_row) for la in wave] for wave in plan] == [
        [("a", "wa", True), ("f", "wf32", False)],
        [("b", "wb", True)],
        [("c", "wc", True)],
    ]
