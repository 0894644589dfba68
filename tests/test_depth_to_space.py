"""DepthToSpace on Track A (issue 38), on the CPU: the depth_to_space kernel's numpy reference against
onnxruntime's DepthToSpace (both modes, block sizes 1-4, odd and vector-sized channel counts,
non-square images, batch 1 and 3, fp32 and fp16: exact, the kernel copies values), its launch
geometry (the fp16 vector grid where the device takes the vector path), the partition taking a
DepthToSpace between two Track A convolutions, and a tiny `dualtrack build` of such a network
verifying against onnxruntime. The kernel on a GPU: tests/gpu/test_depth_to_space_gpu.py."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
from body_net import build_body_net
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import InputError
from dualtrack.kernels import DepthToSpace

D2S = kernels.KERNELS["depth_to_space"]


@functools.cache
def d2s_session(blocksize: int, mode: str):
    """onnxruntime's DepthToSpace (opset 13) of any (N, C, H, W) float32 tensor."""
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=blocksize, mode=mode)
    g = helper.make_graph(
        [node], "d2s", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return ort_session(model)


def onnx_d2s(x_nhwc: np.ndarray, how: DepthToSpace) -> np.ndarray:
    """onnxruntime's DepthToSpace of the NCHW tensor, back in NHWC, in float32 and back to the dtype
    (both conversions exact for a copy of fp16 values)."""
    y = run_ort(d2s_session(how.blocksize, how.mode), {"x": x_nhwc.transpose(0, 3, 1, 2).astype(np.float32)})["y"]
    return y.transpose(0, 2, 3, 1).astype(x_nhwc.dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("bs", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [3, 5, 8, 24])
@pytest.mark.parametrize(("n", "h", "w"), [(1, 5, 7), (3, 4, 3)])
def test_the_reference_computes_onnx_depth_to_space(
    dtype: str, mode: str, bs: int, k: int, n: int, h: int, w: int
) -> None:
    x = np.random.default_rng().standard_normal((n, h, w, k * bs * bs)).astype(dtype)
    how = DepthToSpace(bs, mode)
    got = D2S.reference(x, how)
    assert got.shape == (n, h * bs, w * bs, k) == D2S.output_shape(n, h, w, k * bs * bs, 0, bs)
    np.testing.assert_array_equal(got, onnx_d2s(x, how))  # a copy: exact


def test_the_reference_follows_the_index_formula_of_the_kernel() -> None:
    """y[n, h*s + a, w*s + b, k] = x[n, h, w, ch]: DCR ch = (a*s + b)*K + k, CRD ch = k*s*s + a*s + b."""
    s, K = 3, 2
    x = np.arange(2 * 2 * 3 * K * s * s, dtype=np.float32).reshape(2, 2, 3, K * s * s)
    for mode, ch in (("DCR", lambda a, b, k: (a * s + b) * K + k), ("CRD", lambda a, b, k: k * s * s + a * s + b)):
        y = D2S.reference(x, DepthToSpace(s, mode))
        for n, h, w, a, b, k in np.ndindex(2, 2, 3, s, s, K):
            assert y[n, h * s + a, w * s + b, k] == x[n, h, w, ch(a, b, k)]


def test_refusals_name_the_problem() -> None:
    x = np.zeros((1, 2, 2, 12), np.float32)
    with pytest.raises(InputError, match="blocksize 2 takes channels a multiple of 4; got 6"):
        D2S.reference(x[..., :6], DepthToSpace(2))
    with pytest.raises(InputError, match="blocksize=0 must be a positive integer"):
        DepthToSpace(0)
    with pytest.raises(InputError, match="mode 'RDC' is not one of DCR, CRD"):
        DepthToSpace(2, "RDC")
    with pytest.raises(InputError, match="writes 3, not 4"):
        D2S.args(x=1, y=2, N=1, H=2, W=2, C=12, K=4, how=DepthToSpace(2))


@pytest.mark.parametrize(
    ("mode", "k", "ldx", "ldy", "lanes"),
    [
        ("DCR", 8, 32, 8, 8),  # dense: 16-byte loads and stores
        ("DCR", 8, 36, 8, 1),  # x's stride breaks the 16-byte load
        ("CRD", 8, 36, 8, 8),  # CRD gathers: x's stride does not matter
        ("CRD", 8, 32, 12, 1),  # y's stride breaks the 16-byte store
        ("CRD", 5, 20, 5, 1),  # K not a multiple of 8
    ],
)
def test_the_fp16_grid_has_a_thread_per_vector_where_the_vector_path_runs(
    mode: str, k: int, ldx: int, ldy: int, lanes: int
) -> None:
    n, h, w = 2, 3, 5
    kw = {"N": n, "H": h, "W": w, "C": 4 * k, "K": k, "ldx": ldx, "ldy": ldy, "how": DepthToSpace(2, mode)}
    cfg = D2S.call_launch("float16", kw)
    assert cfg.grid[0] == -(-(n * 2 * h * 2 * w * k // lanes) // D2S.block_threads)
    assert D2S.call_launch("float32", kw).grid[0] == -(-(n * 4 * h * w * k) // D2S.block_threads)


# --- the partition and a build -------------------------------------------------------------------


def d2s_net() -> onnx.ModelProto:
    """``stem`` (Sin: Track B) -> body: conv 3x3 (4 -> 2*2*8) -> DepthToSpace DCR 2 (the front end's
    sub-pixel ConvTranspose) -> conv 1x1 (8 -> 3*3*3) -> DepthToSpace CRD 3 (PixelShuffle) -> conv 3x3
    -> ``head`` (Sin), on a 7x9 image."""
    rng = np.random.default_rng(5)
    nodes, inits = [helper.make_node("Sin", ["image"], ["stem"], name="stem")], []

    def conv(name: str, x: str, cin: int, cout: int, k: int) -> str:
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = rng.standard_normal(cout).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")])
        ins = [x, f"{name}.w", f"{name}.b"]
        nodes.append(helper.make_node("Conv", ins, [name], name=name, kernel_shape=[k, k], pads=[k // 2] * 4))
        return name

    conv("body/c1", "stem", 4, 32, 3)
    nodes.append(helper.make_node("DepthToSpace", ["body/c1"], ["body/dcr"], name="body/dcr", blocksize=2, mode="DCR"))
    conv("body/c2", "body/dcr", 8, 27, 1)
    nodes.append(helper.make_node("DepthToSpace", ["body/c2"], ["body/crd"], name="body/crd", blocksize=3, mode="CRD"))
    conv("body/c3", "body/crd", 3, 5, 3)
    nodes.append(helper.make_node("Sin", ["body/c3"], ["logits"], name="head"))
    graph = helper.make_graph(
        nodes, "d2s_net", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 4, 7, 9])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_the_partition_takes_depth_to_space_between_track_a_convolutions() -> None:
    part = PartitionConfig(mode="auto", switch_cost_us=0.0)
    p = partition.partition_model(BuildConfig(model=Path("g.onnx"), batch_sizes=(1,), partition=part), d2s_net())
    tracks = {d.node: d.track for d in p.assignment.decisions}
    assert all(t == "A" for n, t in tracks.items() if n.startswith("body/")), tracks
    body = [s for s in p.plan.segments if s.track == "A"]
    assert len(body) == 1  # no track switch around the DepthToSpaces
    calls = {c.nodes[0]: c for c in body[0].calls}
    assert (calls["body/dcr"].op, DepthToSpace.of(calls["body/dcr"])) == ("depth_to_space", DepthToSpace(2, "DCR"))
    assert (calls["body/crd"].op, DepthToSpace.of(calls["body/crd"])) == ("depth_to_space", DepthToSpace(3, "CRD"))


def test_a_depth_to_space_the_kernel_cannot_take_says_why() -> None:
    from dualtrack.compiler import lower_pad
    from dualtrack.compiler.lower_mobile import Facts

    model = d2s_net()
    specs = partition.infer_specs(model)
    node = helper.make_node("DepthToSpace", ["body/c2"], ["y"], name="bad", blocksize=2)
    assert lower_pad.supports(node, Facts(model, specs)) == "27 channels, not a multiple of blocksize^2 = 4"


def test_a_network_with_depth_to_space_builds_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    out, report = build_body_net(tmp_path, d2s_net(), "d2s", batch_sizes=(1, 2))
    assert report["passed"] is True
    ops = [c.op for s in Bundle.open(out).manifest.plan.segments for c in s.calls]
    assert ops.count("depth_to_space") == 2
