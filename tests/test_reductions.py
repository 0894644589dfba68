"""The reductions as one family (kernels.reduce_ops; handwritten_ptx/dualtrack_reduce.cuh; the gap and
creduce kernels): every Reduce op of REDUCE_OPS over an image's H, W or over its channels is a Track A
call, whatever the exporter wrote around it.

- the header's op codes are the table's (the kernels switch on the codes the plan stores);
- the numpy semantics against onnxruntime over both axes sets, pictures no zoo model has (tests/
  test_mobile_kernels.py and tests/test_creduce.py hold each kernel's reference to onnxruntime; here the
  shared function over rank-4 shapes with odd sizes, fp32 within 1e-5 relative, max / min exact);
- ConvNeXt-V2's global response norm as users write it (``torch.norm(x, p=2, dim=(2, 3))`` over the
  mean over channels, a gamma / beta affine and the residual), exported by both exporters, built fp16
  for the CPU: before, its ReduceL2 had no kernel and the block took a Track B segment with a track
  switch each side; now the whole network but the input wrap is one Track A segment, and the build
  verifies (the kernel calls through the kernels' numpy semantics and the plan against onnxruntime).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.verify import ort_session
from dualtrack.contract.plan import REDUCE_OPS
from dualtrack.kernels import reduce_ops

HEADER = Path(__file__).resolve().parents[1] / "handwritten_ptx" / "dualtrack_reduce.cuh"
DEVICE_NAMES = {
    "ReduceSum": "SUM", "ReduceMean": "MEAN", "ReduceMax": "MAX", "ReduceMin": "MIN",
    "ReduceL1": "L1", "ReduceL2": "L2", "ReduceSumSquare": "SUMSQUARE",
}  # fmt: skip


def test_the_header_s_op_codes_are_the_table_s() -> None:
    codes = {m[1]: int(m[2]) for m in re.finditer(r"DT_RED_(\w+) = (\d+),", HEADER.read_text())}
    assert codes == {DEVICE_NAMES[name]: code for name, code in REDUCE_OPS.items()}


@pytest.mark.parametrize("op", list(REDUCE_OPS))
@pytest.mark.parametrize("axes", [(1,), (2, 3)])
def test_the_shared_reference_is_onnx_s_reduce(op: str, axes: tuple[int, ...]) -> None:
    """NCHW (2, 5, 13, 7) through onnxruntime (opset 18, axes as an input) against reduce_ops.reduce on
    the NHWC layout (channels axis 3, H, W axes 1, 2)."""
    x = (np.random.default_rng(3).standard_normal((2, 5, 13, 7)) + 0.25).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)], "r",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(axes, np.int64), "axes")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    want = ort_session(model).run(["y"], {"x": x})[0].transpose(0, 2, 3, 1)
    nhwc_axes = {(1,): (3,), (2, 3): (1, 2)}[axes]
    got = reduce_ops.reduce(x.transpose(0, 2, 3, 1), nhwc_axes, REDUCE_OPS[op], "test")
    if op in ("ReduceMax", "ReduceMin"):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def write_grn_project(root: Path, dynamo: bool) -> Path:
    """A ConvNeXt-V2-style block (a 7x7 depthwise conv, a 1x1 expansion, GELU, the global response
    norm, a 1x1 projection, the residual) between a stem and a head, 40x28 pictures (no zoo size),
    exported by the TorchScript or the dynamo exporter at batch 1, built fp16 for batches 1 and 2 with an
    image in and a softmax and mask out."""
    torch = pytest.importorskip("torch")

    class GRN(torch.nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.gamma = torch.nn.Parameter(0.3 * torch.randn(1, c, 1, 1))
            self.beta = torch.nn.Parameter(0.1 * torch.randn(1, c, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gx = torch.norm(x, p=2, dim=(2, 3), keepdim=True)
            nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
            return self.gamma * (x * nx) + self.beta + x

    class Net(torch.nn.Module):
        def __init__(self, c: int = 24) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
            self.dw = torch.nn.Conv2d(c, c, 7, padding=3, groups=c)
            self.pw1, self.act, self.grn = torch.nn.Conv2d(c, 4 * c, 1), torch.nn.GELU(), GRN(4 * c)
            self.pw2 = torch.nn.Conv2d(4 * c, c, 1)
            self.head = torch.nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            x = x + self.pw2(self.grn(self.act(self.pw1(self.dw(x)))))
            return self.head(x)

    torch.manual_seed(5)
    root.mkdir(parents=True, exist_ok=True)
    x = torch.randn(1, 3, 40, 28)
    torch.onnx.export(Net().eval(), (x,), str(root / "grn.onnx"), opset_version=17, dynamo=dynamo)
    cfg = root / "grn.yaml"
    cfg.write_text(  # as the README's example: an image in, softmax and a mask out
        "model: grn.onnx\nprecision: fp16\nbatch_sizes: [1, 2]\ntargets: [sm_90a]\nverify:\n  samples: 1\n"
        "preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.5], std: [0.25]}\n"
        "postprocess: {activation: softmax}\n"
    )
    return cfg


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_global_response_norm_runs_on_track_a_in_one_segment(tmp_path: Path, dynamo: bool) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    cfg = write_grn_project(tmp_path, dynamo)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "grn.onnx")).graph.node]
    l2 = ops.count("ReduceL2") + ops.count("ReduceSumSquare") + ops.count("ReduceSum")
    assert l2 >= 1, ops  # the norm, as the exporter wrote it
    build(cfg, tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    tracks = [s.track for s in plan.segments]
    assert tracks.count("A") == 1 and tracks[-1] == "A", [(s.name, s.track, len(s.nodes)) for s in plan.segments]
    reduced = [c for s in plan.segments for c in s.calls if c.op == "gap"]
    assert reduced, "the norm over H, W is a gap call"
    assert {c.attr("op") for c in reduced} <= {REDUCE_OPS[op] for op in ("ReduceL2", "ReduceSumSquare", "ReduceSum")}
