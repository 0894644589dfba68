"""Split attention written on images (compiler/radix_views.py, the front end's `radix` stage): ResNeSt's
5-D radix views, their branch sums, products and softmax of two, as 4-D Split / Add / Mul / Conv / Sigmoid.

- the rewrite computes what the export computes (onnxruntime on both, fp32, within 1e-5 relative): the
  block as timm writes it, radix 2 with cardinality 1 and 2, from both exporters; radix 3, whose softmax
  stays (its sums and products are still written on images); the mean and max over the branches;
- no 5-D tensor is left where every use was rewritten, and a 5-D Reshape that is not a channel split
  (H split in two) is left alone;
- SKNet's selective kernel (its paths stacked on dim 1, a softmax over the (N, 2, C, 1, 1) view), both exporters;
- a ResNeSt-style and an SKNet-style network built fp16 for the CPU with an image in and a softmax out are
  each one Track A segment after the input wrap, and verify (a Track B segment each side of every block's
  softmax and sums before).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.frontend import _prune
from dualtrack.compiler.radix_views import radix_views_as_images
from dualtrack.compiler.verify import ort_session


def _split_attention_net(radix: int, card: int, reduce: str = "sum"):
    """timm's SplitAttn (radix softmax included) between a stem and a head; ``reduce`` the branch
    reduction of the pooled path (sum as timm writes it; mean and max exercise the other chains)."""
    torch = pytest.importorskip("torch")
    nn, f = torch.nn, torch.nn.functional

    class RadixSoftmax(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x.size(0)
            return f.softmax(x.view(b, card, radix, -1).transpose(1, 2), dim=1).reshape(b, -1)

    class SplitAttn(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            mid, attn = c * radix, max(c * radix // 4, 8 * card)
            self.conv, self.bn0 = nn.Conv2d(c, mid, 3, padding=1, groups=card * radix), nn.BatchNorm2d(mid)
            self.fc1, self.bn1 = nn.Conv2d(c, attn, 1, groups=card), nn.BatchNorm2d(attn)
            self.fc2, self.rsoftmax = nn.Conv2d(attn, mid, 1, groups=card), RadixSoftmax()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.bn0(self.conv(x)))
            b, rc, h, w = x.shape
            x = x.reshape((b, radix, rc // radix, h, w))
            pooled = {"sum": x.sum(dim=1), "mean": x.mean(dim=1), "max": x.amax(dim=1)}[reduce]
            gap = torch.relu(self.bn1(self.fc1(pooled.mean((2, 3), keepdim=True))))
            attn = self.rsoftmax(self.fc2(gap)).view(b, -1, 1, 1)
            return (x * attn.reshape((b, radix, rc // radix, 1, 1))).sum(dim=1).contiguous()

    class Net(nn.Module):
        def __init__(self, c: int = 12) -> None:
            super().__init__()
            self.stem, self.block, self.head = nn.Conv2d(3, c, 3, padding=1), SplitAttn(c), nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.stem(x))
            return self.head(y + self.block(y))

    torch.manual_seed(radix * 10 + card)
    net = Net().train()
    with torch.no_grad():
        for _ in range(3):  # batch-norm statistics from a few train-mode passes
            net(torch.randn(4, 3, 18, 14))
    return net.eval(), torch


def _selective_kernel_net():
    """timm's SelectiveKernel (SKNet): two conv paths (3x3, and 3x3 dilated 2) stacked on dim 1, the
    attention's sum over paths, pool, reduce and select 1x1s, a softmax over the two paths of the
    (N, 2, C, 1, 1) view, the weighted sum; between a stem and a head."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class SelectiveKernel(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.paths = nn.ModuleList(
                nn.Sequential(nn.Conv2d(c, c, 3, padding=d, dilation=d, groups=2), nn.BatchNorm2d(c), nn.ReLU())
                for d in (1, 2)
            )
            self.reduce = nn.Sequential(nn.Conv2d(c, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
            self.select = nn.Conv2d(8, 2 * c, 1, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.stack([p(x) for p in self.paths], dim=1)
            a = self.select(self.reduce(x.sum(1).mean((2, 3), keepdim=True)))
            b, c2 = a.shape[:2]
            a = torch.softmax(a.view(b, 2, c2 // 2, 1, 1), dim=1)
            return torch.sum(x * a, dim=1)

    class Net(nn.Module):
        def __init__(self, c: int = 12) -> None:
            super().__init__()
            self.stem, self.block, self.head = nn.Conv2d(3, c, 3, padding=1), SelectiveKernel(c), nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(torch.relu(self.stem(x))))

    torch.manual_seed(4)
    net = Net().train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(4, 3, 18, 14))
    return net.eval(), torch


def _export(net, torch, path: Path, dynamo: bool) -> onnx.ModelProto:
    torch.onnx.export(net, (torch.randn(1, 3, 18, 14),), str(path), opset_version=17, dynamo=dynamo)
    return onnx.load(str(path))


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort_session(model).run(None, {model.graph.input[0].name: x})[0]


def _rank5(model: onnx.ModelProto) -> list[str]:
    """The node outputs of rank 5 (the value_info an exporter wrote of removed tensors aside)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    outputs = {o for n in model.graph.node for o in n.output}
    return [v.name for v in inferred.graph.value_info if v.name in outputs and len(v.type.tensor_type.shape.dim) == 5]


@pytest.mark.parametrize(
    ("radix", "card", "reduce", "dynamo"),
    [(2, 1, "sum", False), (2, 2, "sum", False), (2, 1, "sum", True), (2, 2, "sum", True),
     (3, 1, "sum", False), (2, 1, "mean", False), (2, 2, "max", True)],
)  # fmt: skip
def test_the_rewrite_computes_what_the_export_computes(radix, card, reduce, dynamo, tmp_path: Path) -> None:
    net, torch = _split_attention_net(radix, card, reduce)
    model = _export(net, torch, tmp_path / "net.onnx", dynamo)
    out, line = radix_views_as_images(model)
    assert line is not None and "over" in line, line
    out = _prune(out)
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 18, 14)).astype(np.float32)
    want, got = _run(model, x), _run(out, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    softmaxes = [n for n in out.graph.node if n.op_type == "Softmax"]
    if radix == 2:
        assert not softmaxes and "softmax of two" in line
        assert _rank5(out) == [], "every 5-D view was written on images"
    else:  # a softmax over three branches stays as exported
        assert len(softmaxes) == 1 and "softmax of two" not in line


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_selective_kernel_s_stack_is_written_on_images(dynamo: bool, tmp_path: Path) -> None:
    net, torch = _selective_kernel_net()
    model = _export(net, torch, tmp_path / "sk.onnx", dynamo)
    out, line = radix_views_as_images(model)
    assert line is not None and "softmax of two" in line, line
    out = _prune(out)
    x = np.random.default_rng(2).standard_normal((1, 3, 18, 14)).astype(np.float32)
    want, got = _run(model, x), _run(out, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert _rank5(out) == [] and not [n for n in out.graph.node if n.op_type == "Softmax"]


def test_a_5d_reshape_that_is_not_a_channel_split_is_left_alone() -> None:
    """(N, C, H, W) -> (N, C, 2, H/2, W), summed over axis 1: a sum over channels, not over branches."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["x5"]),
        helper.make_node("ReduceSum", ["x5", "axes"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 5])],
        [numpy_helper.from_array(np.array([1, 4, 2, 3, 5], np.int64), "shape"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, line = radix_views_as_images(model)
    assert out is model and line is None


@pytest.mark.parametrize("block", ["split_attention", "selective_kernel"])
def test_a_resnest_or_sknet_style_network_is_one_track_a_segment_and_verifies(block: str, tmp_path: Path) -> None:
    from dualtrack.compiler.build import build
    from dualtrack.contract.bundle import Bundle

    net, torch = _split_attention_net(2, 2) if block == "split_attention" else _selective_kernel_net()
    _export(net, torch, tmp_path / "rs.onnx", dynamo=False)
    cfg = tmp_path / "rs.yaml"
    cfg.write_text(
        "model: rs.onnx\nprecision: fp16\nbatch_sizes: [1, 2]\ntargets: [sm_90a]\nverify:\n  samples: 1\n"
        "preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.5], std: [0.25]}\n"
        "postprocess: {activation: softmax}\n"
    )
    build(cfg, tmp_path / "out")  # raises when verification fails
    plan = Bundle.open(tmp_path / "out").manifest.plan
    assert [s.track for s in plan.segments] == ["B", "A"], [(s.name, s.track, s.nodes) for s in plan.segments]
    ops = {c.op for s in plan.segments for c in s.calls}
    assert {"fc", "eltwise", "gap"} <= ops, ops  # the softmax of two (a 1x1 conv of the pooled logits), the gate
