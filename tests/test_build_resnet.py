"""A small ResNet-like network built on the CPU with its convolutions on Track A as the general conv:
the 7x7 stride-2 stem, basic blocks (3x3 + residual Add + ReLU fused into one call), a stride-2
block with its 1x1 stride-2 downsample, and between them the 3x3 stride-2 max-pool on the general
max-pool (one Track A segment). Through the real pipeline: `dualtrack build --cpu-only` (front end, partition,
IREE llvm-cpu, and the verification: every segment against onnxruntime, every Track A call list
interpreted with the kernels' numpy semantics, the whole plan at both batch sizes against
onnxruntime on the whole model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dualtrack.cli import main
from dualtrack.contract.bundle import Bundle

SIZE = 32
CONFIG = """\
model: resnet.onnx
batch_sizes: [1, 2]
targets: []
preprocess: {layout: NCHW, color: RGB, scale: 255, mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}
partition:
  mode: rules
  track_a:
    name_prefixes: [stem/, pool, layer]
verify: {samples: 1, seed: 3}
"""


def resnet_like(seed: int = 0) -> onnx.ModelProto:
    """image (N, 3, 32, 32) -> stem 7x7/2 + ReLU -> MaxPool 3x3/2 pad 1 -> basic block (16) ->
    basic block /2 with a 1x1/2 downsample (32) -> 1x1 head (2 classes) -> logits (N, 2, 4, 4)."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def conv(name: str, x: str, c: int, k: int, r: int, stride: int = 1, pad: int | None = None) -> str:
        w = rng.normal(0, np.sqrt(2 / (c * r * r)), (k, c, r, r)).astype(np.float32)
        b = rng.normal(0, 0.1, k).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")])
        p = r // 2 if pad is None else pad
        nodes.append(
            helper.make_node(
                "Conv", [x, f"{name}.w", f"{name}.b"], [name], name=name,
                kernel_shape=[r, r], strides=[stride, stride], pads=[p] * 4,
            )
        )  # fmt: skip
        return name

    def op(kind: str, name: str, *inputs: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, list(inputs), [name], name=name, **attrs))
        return name

    def block(prefix: str, x: str, c: int, k: int, stride: int) -> str:
        h = op("Relu", f"{prefix}/relu1", conv(f"{prefix}/conv1", x, c, k, 3, stride))
        h = conv(f"{prefix}/conv2", h, k, k, 3)
        skip = conv(f"{prefix}/down", x, c, k, 1, stride) if stride != 1 or c != k else x
        return op("Relu", f"{prefix}/relu2", op("Add", f"{prefix}/add", h, skip))

    x = op("Relu", "stem/relu", conv("stem/conv", "image", 3, 16, 7, 2))
    x = op("MaxPool", "pool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = block("layer1", x, 16, 16, 1)
    x = block("layer2", x, 16, 32, 2)
    conv("head", x, 32, 2, 1)
    nodes[-1].output[0] = "logits"
    graph = helper.make_graph(
        nodes,
        "resnet_like",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, SIZE // 8, SIZE // 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def resnet_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resnet")
    onnx.save(resnet_like(), str(root / "resnet.onnx"))
    (root / "model.yaml").write_text(CONFIG)
    result = CliRunner().invoke(main, ["build", str(root / "model.yaml"), "-o", str(root / "bundle"), "--cpu-only"])
    assert result.exit_code == 0, result.output
    assert "verification passed" in result.stdout
    return root / "bundle"


def test_resnet_convolutions_lower_to_the_general_conv(resnet_bundle: Path) -> None:
    plan = Bundle.open(resnet_bundle).manifest.plan
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    calls = plan.segments[1].calls
    stem, pool, blocks = calls[:1], calls[1], calls[2:]
    assert [(c.op, c.nodes) for c in stem] == [("conv", ("stem/conv", "stem/relu"))]
    assert (stem[0].attr("R"), stem[0].attr("stride_h"), stem[0].attr("pad_top")) == (7, 2, 3)
    assert (pool.op, pool.nodes) == ("maxpool", ("pool",))
    assert (pool.attr("R"), pool.attr("stride_h"), pool.attr("pad_top"), pool.attr("ceil_mode")) == (3, 2, 1, 0)
    assert [(c.op, c.nodes) for c in blocks] == [
        ("conv3x3", ("layer1/conv1", "layer1/relu1")),
        ("conv", ("layer1/conv2", "layer1/add", "layer1/relu2")),
        ("conv", ("layer2/conv1", "layer2/relu1")),
        ("conv", ("layer2/down",)),
        ("conv", ("layer2/conv2", "layer2/add", "layer2/relu2")),
    ]
    assert blocks[1].inputs == ("layer1/relu1", "pool") and blocks[4].inputs == ("layer2/relu1", "layer2/down")
