"""Narrow groups merged on the general conv (ConvGeneralSpec.merged): a grouped conv of a few channels
a group runs as fewer groups of block-diagonal weights. Which merges are taken; the merged weights
and geometry against onnxruntime's grouped Conv on shapes no zoo model has (odd per-group widths,
K/g != C/g, strides, dilations, uneven padding); the partition lowering a network of them with the
merge in its calls, and that network built in fp16 and verified on the CPU. The GPU side:
tests/gpu/test_conv_family_gpu.py (test_merged_groups_on_the_gpu)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from body_net import build_body_net
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from test_conv_family import assert_close, nhwc, operands, run_onnx, scale_of

from dualtrack.cli import main
from dualtrack.compiler import cost, frontend, partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig, Rules
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels import KERNELS, ConvGeometry, pack_conv_weights
from dualtrack.kernels.conv import block_diagonal

CONV = KERNELS["conv"]


@pytest.mark.parametrize(
    ("C", "K", "groups", "dtype", "merge"),
    [
        (128, 128, 32, "float16", 8),  # 4 a group -> 32
        (256, 256, 32, "float16", 4),  # 8 -> 32
        (512, 512, 32, "float16", 2),  # 16 -> 32
        (1024, 1024, 32, "float16", 1),  # 32 a group already
        (72, 72, 24, "float16", 8),  # 3 -> 24: a multiple of 8 (the vector path) before 6 -> 18
        (64, 128, 16, "float16", 4),  # 4 -> 8 a group: 16 -> 32
        (36, 36, 12, "float16", 6),  # 3 -> 18: no merge of 12 groups makes a multiple of 8, the largest fits
        (96, 96, 96, "float16", 1),  # depthwise: 8 groups of 1 are 8 channels, under half a k-tile
        (128, 128, 32, "float32", 1),  # the fp32 SIMT entry has no multiply-adds to spare
        (256, 512, 32, "float16", 2),  # 8 -> 16 a group: K/g caps it at 2 (16 -> 32)
        (36, 36, 9, "float16", 1),  # 4 a group, 9 groups: 3 groups are 12 channels, under 16
        (64, 64, 1, "float16", 1),  # one group
    ],
)
def test_which_groups_merge(C, K, groups, dtype, merge) -> None:
    geom = ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1, groups=groups)
    got = CONV.merged(dtype, C, K, geom)
    assert got.merge == merge and got.groups * got.merge == groups
    assert CONV.merged(dtype, C, K, got) == got  # merging a merged geometry changes nothing


MERGED = [  # (N, C, H, W, K, kernel, stride, dilation, pads, group)
    (1, 32, 9, 8, 32, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 8),  # 4 a group, stride 2: one launched group
    (2, 64, 7, 9, 64, (3, 3), (1, 1), (2, 2), (2, 2, 2, 2), 8),  # 8 a group, dilation 2
    (1, 48, 6, 7, 48, (3, 1), (1, 2), (1, 1), (1, 0, 0, 1), 16),  # 3 a group -> 24, 3x1, stride (1, 2)
    (1, 32, 8, 8, 64, (5, 5), (1, 1), (1, 1), (2, 1, 2, 3), 8),  # 4 -> 8 a group, uneven padding
    (1, 64, 5, 6, 64, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 4),  # 16 a group, 1x1
]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("N", "C", "H", "W", "K", "kernel", "stride", "dil", "pads", "group"), MERGED)
def test_merged_groups_compute_onnxs_grouped_conv(dtype, N, C, H, W, K, kernel, stride, dil, pads, group) -> None:
    x, w, b = operands(dtype, (N, C, H, W), (K, C // group, *kernel), K)
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=group, kernel_shape=list(kernel), strides=list(stride),
        dilations=list(dil), pads=list(pads),
    )  # fmt: skip
    want = nhwc(run_onnx(node, x, {"w": w.astype(np.float32), "b": b.astype(np.float32)}))
    geom = CONV.merged("float16", C, K, ConvGeometry(*kernel, *stride, *dil, *pads, groups=group))
    assert geom.merge > 1 and geom.groups * geom.merge == group
    wp, bp = pack_conv_weights(block_diagonal(w, group, geom.merge), b, any_size=True)
    assert wp.shape == (K, *kernel, C // geom.groups)
    got = CONV.reference(nhwc(x), wp, bp, geom=geom)
    assert_close(got, want, dtype, scale_of(x, w, b, C // group * kernel[0] * kernel[1]))


def test_block_diagonal_keeps_each_filter_on_its_own_groups_channels() -> None:
    w = np.arange(1, 4 * 2 * 1 * 1 + 1, dtype=np.float32).reshape(4, 2, 1, 1)  # 4 groups of 1 filter, 2 channels
    got = block_diagonal(w, 4, 2)[..., 0, 0]
    np.testing.assert_array_equal(got, [[1, 2, 0, 0], [0, 0, 3, 4], [5, 6, 0, 0], [0, 0, 7, 8]])
    with pytest.raises(InputError, match="must divide"):
        block_diagonal(w, 4, 3)


def test_a_merged_call_packs_block_diagonal_weights_and_fp8_refuses_it() -> None:
    geom = ConvGeometry(3, 3, groups=2, merge=4)
    call = KernelCall("conv", ("x",), ("y",), ("w",), (*geom.attrs(), ("act", 0), ("residual", 0)), ("n",))
    assert dict(call.attrs)["merge"] == 4 and ConvGeometry.from_call(call) == geom
    w = np.random.default_rng(0).standard_normal((16, 4, 3, 3)).astype(np.float16)  # 8 groups of 2 -> 4 channels
    packed = CONV.pack_weights(call, {"w": w})["w"]
    assert packed.shape == (16, 3, 3, 16)
    np.testing.assert_array_equal(packed, pack_conv_weights(block_diagonal(w, 8, 4), any_size=True)[0])
    assert "group=8" in (KERNELS["conv_fp8"].supports(call) or "")
    assert "group 8 as 2 merged" in geom.label()


def resnext_net(height: int = 16) -> onnx.ModelProto:
    """``stem`` (Sin: Track B) -> a 1x1 (group 1) -> grouped 3x3s as ResNeXt has them (32 groups of 4,
    stride 2; 16 groups of 8) and ones no zoo model has (24 groups of 3 with a residual and SiLU;
    16 groups of 4 -> 8, 5x5 dilated) -> ``head`` (Sin)."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Sin", ["image"], ["stem"], name="stem")]
    inits = []

    def conv(name: str, x: str, w_shape: tuple[int, ...], **attrs: object) -> str:
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        b = rng.standard_normal(w_shape[0]).astype(np.float32) * 0.1
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")])
        ins = [x, f"{name}.w", f"{name}.b"]
        nodes.append(helper.make_node("Conv", ins, [name], name=name, kernel_shape=list(w_shape[2:]), **attrs))
        return name

    a = conv("body/in", "stem", (128, 8, 1, 1))
    g4 = conv("body/g32x4", a, (128, 4, 3, 3), group=32, strides=[2, 2], pads=[1] * 4)
    nodes.append(helper.make_node("Relu", [g4], ["body/r1"], name="body/r1"))
    g8 = conv("body/g16x8", "body/r1", (128, 8, 3, 3), group=16, pads=[1] * 4)
    b = conv("body/to72", g8, (72, 128, 1, 1))
    g3 = conv("body/g24x3", b, (72, 3, 3, 3), group=24, pads=[1] * 4)
    nodes.append(helper.make_node("Add", [g3, b], ["body/add"], name="body/add"))
    nodes.append(helper.make_node("Sigmoid", ["body/add"], ["body/sg"], name="body/sg"))
    nodes.append(helper.make_node("Mul", ["body/add", "body/sg"], ["body/silu"], name="body/silu"))
    c = conv("body/to64", "body/silu", (64, 72, 1, 1))
    g48 = conv("body/g16x4to8", c, (128, 4, 5, 5), group=16, dilations=[2, 2], pads=[4] * 4)
    nodes.append(helper.make_node("Sin", [g48], ["logits"], name="head"))
    graph = helper.make_graph(
        nodes, "resnext_like", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 8, height, height])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


MERGES = {"body/g32x4": (4, 8), "body/g16x8": (4, 4), "body/g24x3": (3, 8), "body/g16x4to8": (4, 4)}


def test_the_partition_lowers_narrow_groups_merged_in_fp16_only() -> None:
    part = PartitionConfig(mode="rules", track_a=Rules(name_prefixes=("body/",)))
    for precision, merges in (("fp16", MERGES), ("fp32", {n: (g * m, 1) for n, (g, m) in MERGES.items()})):
        cfg = BuildConfig(model=Path("g.onnx"), batch_sizes=(1,), partition=part, precision=precision)
        model, _ = frontend.convert_precision(resnext_net(), precision, [])
        p = partition.partition_model(cfg, model)
        calls = {c.nodes[0]: c for s in p.plan.segments if s.track == "A" for c in s.calls}
        got = {n: (ConvGeometry.from_call(calls[n]).groups, ConvGeometry.from_call(calls[n]).merge) for n in merges}
        assert got == merges, precision


def test_the_cost_model_counts_a_merged_convs_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = frontend.convert_precision(resnext_net(height=128), "fp16", [])  # past the launch time
    specs = partition.infer_specs(model)
    node = next(n for n in model.graph.node if n.name == "body/g16x4to8")  # 5x5: compute-bound once merged
    inits = {i.name for i in model.graph.initializer}
    assert cost.conv_merge(node, specs) == 4
    merged = cost.node_cost(node, specs, inits, (8,), on_a=None, kernel="conv")
    monkeypatch.setitem(KERNELS, "conv", replace(CONV, merge_max=1))
    assert cost.conv_merge(node, specs) == 1
    plain = cost.node_cost(node, specs, inits, (8,), on_a=None, kernel="conv")
    assert merged.a_us is not None and plain.a_us is not None and merged.a_us > 1.5 * plain.a_us


def test_a_network_of_merged_groups_builds_in_fp16_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    out, report = build_body_net(
        tmp_path, resnext_net(), "resnext", precision="fp16", batch_sizes=(1, 2), targets=("sm_90a",)
    )
    assert report["passed"] is True
    assert any(c["name"].startswith("seg1_A[numpy kernels]") for c in report["checks"])
    calls = [c for s in Bundle.open(out).manifest.plan.segments for c in s.calls if c.op == "conv"]
    assert sorted(c.attr("merge") or 1 for c in calls) == [1, 1, 1, 4, 4, 8, 8]
    info = CliRunner().invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "4 grouped conv(s) run as fewer groups" in info.output
    assert "body/g32x4: 32 groups as 4 of 8" in info.output and "body/g24x3: 24 groups as 3 of 8" in info.output
