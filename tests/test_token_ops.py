"""Token tensors on Track A (compiler/token_layout.py, issue 39): a transformer's (N, L, C) token tensors written
over the NCHW images they are, so that LayerNorm over the last axis, the Linears (MatMul by a constant + bias Add),
Gelu (erf and tanh) and the residual Adds are image ops of Track A's families, with no copies between them.

The block is built here with onnx.helper, at shapes no zoo model uses (L = 37 tokens of C = 48 channels, a hidden
width of K = 136), its batch symbolic and run at 3: the pass against onnxruntime on the graph as exported (fp32,
rel L2 <= 1e-5: the same products in another order), the partition's tracks, and a CPU build whose own checks
(IREE llvm-cpu and the numpy mirrors of the Track A kernels against onnxruntime, fp16) must pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import partition
from dualtrack.compiler.config import BuildConfig, PartitionConfig
from dualtrack.compiler.frontend import prepare
from dualtrack.compiler.onnx_graph import constants
from dualtrack.compiler.token_layout import tokens_as_images

H, W, C, K = 1, 37, 48, 136  # L = 37 tokens: a prime, so no other (H, W) could be read into it
L = H * W
OPSET = 20  # Gelu's first opset (the dynamo exporter's default writes it)


def _const(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 1.0) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def token_block(approximate: str = "none", exits: bool = False, seed: int = 0) -> onnx.ModelProto:
    """image (N, 3, H, W) -> 1x1 Conv -> flatten(2).transpose(1, 2) -> + position embedding (1, L, C) -> residual
    block [LayerNorm, Linear C->K, Gelu, Linear K->C] -> transpose(1, 2).reshape(N, C, H, W) -> 1x1 Conv -> logits.
    ``exits``: a Sin between the embedding and the block (an op the pass does not write: the block's first token
    tensor enters from it) and the tokens' mean over L as a second graph output (read as tokens: an exit)."""
    rng = np.random.default_rng(seed)
    inits = [
        _const(rng, "/stem/w", (C, 3, 1, 1), 0.5),
        numpy_helper.from_array(np.array([-1, C, L], np.int64), "/embed/flat"),
        _const(rng, "/embed/pos", (1, L, C), 0.5),
        numpy_helper.from_array(1 + 0.1 * rng.standard_normal(C).astype(np.float32), "/blk/ln/scale"),
        _const(rng, "/blk/ln/bias", (C,), 0.1),
        _const(rng, "/blk/fc1/w", (C, K), C**-0.5),
        _const(rng, "/blk/fc1/b", (K,), 0.1),
        _const(rng, "/blk/fc2/w", (K, C), K**-0.5),
        _const(rng, "/blk/fc2/b", (C,), 0.1),
        numpy_helper.from_array(np.array([-1, C, H, W], np.int64), "/out/image"),
        _const(rng, "/head/w", (2, C, 1, 1), C**-0.5),
    ]
    block_in = "/embed/tokens_sin" if exits else "/embed/tokens"
    nodes = [
        helper.make_node("Conv", ["image", "/stem/w"], ["/stem/y"], name="/stem/conv"),
        helper.make_node("Reshape", ["/stem/y", "/embed/flat"], ["/embed/cf"], name="/embed/flatten"),
        helper.make_node("Transpose", ["/embed/cf"], ["/embed/t"], name="/embed/transpose", perm=[0, 2, 1]),
        helper.make_node("Add", ["/embed/t", "/embed/pos"], ["/embed/tokens"], name="/embed/add_pos"),
        *([helper.make_node("Sin", ["/embed/tokens"], [block_in], name="/embed/sin")] if exits else []),
        helper.make_node("LayerNormalization", [block_in, "/blk/ln/scale", "/blk/ln/bias"], ["/blk/n"],
                         name="/blk/ln", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["/blk/n", "/blk/fc1/w"], ["/blk/h0"], name="/blk/fc1/matmul"),
        helper.make_node("Add", ["/blk/h0", "/blk/fc1/b"], ["/blk/h1"], name="/blk/fc1/add"),
        helper.make_node("Gelu", ["/blk/h1"], ["/blk/g"], name="/blk/gelu", approximate=approximate),
        helper.make_node("MatMul", ["/blk/g", "/blk/fc2/w"], ["/blk/m0"], name="/blk/fc2/matmul"),
        helper.make_node("Add", ["/blk/m0", "/blk/fc2/b"], ["/blk/m1"], name="/blk/fc2/add"),
        helper.make_node("Add", [block_in, "/blk/m1"], ["/blk/out"], name="/blk/residual"),
        helper.make_node("Transpose", ["/blk/out"], ["/out/cf"], name="/out/transpose", perm=[0, 2, 1]),
        helper.make_node("Reshape", ["/out/cf", "/out/image"], ["/out/y"], name="/out/unflatten"),
        helper.make_node("Conv", ["/out/y", "/head/w"], ["logits"], name="/head/conv"),
    ]  # fmt: skip
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2, H, W])]
    if exits:
        nodes.append(helper.make_node("ReduceMean", ["/blk/out", "/pool/axes"], ["pooled"], name="/pool/mean"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "/pool/axes"))
        outputs.append(helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["N", 1, C]))
    graph = helper.make_graph(
        nodes, "token_block", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, H, W])], outputs,
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def run_ort(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"image": x})


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("exits", [False, True])
def test_the_token_ops_become_image_ops_that_match_onnxruntime(approximate: str, exits: bool) -> None:
    model = token_block(approximate, exits)
    written, detail = tokens_as_images(model, constants(model.graph))
    assert detail is not None
    onnx.checker.check_model(written, full_check=True)
    ops = [n.op_type for n in written.graph.node]
    assert "MatMul" not in ops and ops.count("Conv") == 4  # both Linears are 1x1 Convs, their bias Adds folded in
    g = onnx.shape_inference.infer_shapes(written).graph
    shapes = {v.name: v for v in [*g.value_info, *g.output]}
    for n in written.graph.node:
        if n.op_type in ("Gelu", "Add", "Conv"):  # every compute op on a 4-D image
            assert len(shapes[n.output[0]].type.tensor_type.shape.dim) == 4, n.name
    x = np.random.default_rng().standard_normal((3, 3, H, W)).astype(np.float32)
    for got, want in zip(run_ort(written, x), run_ort(model, x), strict=True):
        assert got.shape == want.shape and rel_l2(got, want) <= 1e-5
    if exits:  # the pooled output still reads tokens: written back from the block's image by one Reshape/Transpose
        reader = next(n for n in written.graph.node if n.op_type == "ReduceMean")
        producer = next(n for n in written.graph.node if reader.input[0] in n.output)
        assert producer.op_type == "Transpose" and [int(p) for p in producer.attribute[0].ints] == [0, 2, 1]


def open_channels_last_block(seed: int = 0) -> onnx.ModelProto:
    """Swin's shape of block on a channels-last image (N, H, W, C) = (N, 3, 5, 40): x = Transpose(Conv(image)) to NHWC,
    a = LN(x) read by a Reshape into row windows (an op the pass does not write, a Sin after it, back by the inverse
    Reshape: an exit and an entry), y = x + a', then y + fc2(Gelu(fc1(LN(y)))) (hidden 88) back to NCHW for a Conv."""
    rng = np.random.default_rng(seed)
    hh, ww, c, k = 3, 5, 40, 88
    inits = [
        _const(rng, "w_stem", (c, 3, 1, 1), 0.5),
        numpy_helper.from_array(1 + 0.1 * rng.standard_normal(c).astype(np.float32), "ln_s"),
        _const(rng, "ln_b", (c,), 0.1),
        numpy_helper.from_array(np.array([-1, ww, c], np.int64), "rows"),
        numpy_helper.from_array(np.array([-1, hh, ww, c], np.int64), "unrows"),
        _const(rng, "fc1_w", (c, k), c**-0.5),
        _const(rng, "fc1_b", (k,), 0.1),
        _const(rng, "fc2_w", (k, c), k**-0.5),
        _const(rng, "fc2_b", (1, 1, c), 0.1),
        _const(rng, "w_head", (2, c, 1, 1), c**-0.5),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "w_stem"], ["stem"], name="/stem"),
        helper.make_node("Transpose", ["stem"], ["x"], name="/to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["x", "ln_s", "ln_b"], ["a"], name="/blk/ln1", axis=-1),
        helper.make_node("Reshape", ["a", "rows"], ["win"], name="/win/split"),
        helper.make_node("Sin", ["win"], ["win_sin"], name="/win/sin"),
        helper.make_node("Reshape", ["win_sin", "unrows"], ["a2"], name="/win/merge"),
        helper.make_node("Add", ["x", "a2"], ["y"], name="/blk/residual1"),
        helper.make_node("LayerNormalization", ["y", "ln_s", "ln_b"], ["n"], name="/blk/ln2", axis=-1),
        helper.make_node("MatMul", ["n", "fc1_w"], ["h0"], name="/blk/fc1/matmul"),
        helper.make_node("Add", ["h0", "fc1_b"], ["h1"], name="/blk/fc1/add"),
        helper.make_node("Gelu", ["h1"], ["g"], name="/blk/gelu"),
        helper.make_node("MatMul", ["g", "fc2_w"], ["m0"], name="/blk/fc2/matmul"),
        helper.make_node("Add", ["m0", "fc2_b"], ["m1"], name="/blk/fc2/add"),
        helper.make_node("Add", ["y", "m1"], ["z"], name="/blk/residual2"),
        helper.make_node("Transpose", ["z"], ["z_img"], name="/to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["z_img", "w_head"], ["logits"], name="/head"),
    ]
    graph = helper.make_graph(
        nodes, "open_channels_last", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, hh, ww])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2, hh, ww])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_open_channels_last_region_becomes_image_ops_that_match_onnxruntime() -> None:
    """What ``channels_last`` leaves (a region a Reshape into windows reads): its LayerNorms, Linears, Gelu and
    residual Adds over the NCHW image, the windows read through a Transpose back to NHWC (an exit) and their result
    entering by the inverse at the residual Add."""
    model = open_channels_last_block()
    written, detail = tokens_as_images(model, constants(model.graph))
    assert detail is not None
    onnx.checker.check_model(written, full_check=True)
    ops = [n.op_type for n in written.graph.node]
    assert "MatMul" not in ops and ops.count("Conv") == 4
    g = onnx.shape_inference.infer_shapes(written).graph
    shapes = {v.name: v for v in [*g.value_info, *g.output]}
    for n in written.graph.node:
        if n.op_type in ("Gelu", "Add", "Conv"):
            dims = [d.dim_value for d in shapes[n.output[0]].type.tensor_type.shape.dim]
            assert dims[1:] in ([40, 3, 5], [88, 3, 5], [2, 3, 5]), (n.name, dims)  # NCHW images
    x = np.random.default_rng().standard_normal((3, 3, 3, 5)).astype(np.float32)
    assert rel_l2(run_ort(written, x)[0], run_ort(model, x)[0]) <= 1e-5


def test_a_group_whose_layout_nodes_disagree_is_left_as_exported() -> None:
    """Tokens reshaped back into an image of another (H, W) than they came from (37 x 1 instead of 1 x 37): no
    twin of one shape serves both, so the pass leaves the graph alone."""
    model = token_block()
    image = next(i for i in model.graph.initializer if i.name == "/out/image")
    image.CopyFrom(numpy_helper.from_array(np.array([-1, C, W, H], np.int64), "/out/image"))
    next(o for o in model.graph.output if o.name == "logits").CopyFrom(
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2, W, H])
    )
    written, detail = tokens_as_images(model, constants(model.graph))
    assert detail is None and written is model


def test_the_block_is_one_track_a_segment() -> None:
    """The front end and the partition (auto) of the block: every node of the block (LayerNorm, both Linears, Gelu,
    the residual Add) on Track A, in one segment (no track switch inside the block)."""
    cfg = BuildConfig(model=Path("block.onnx"), precision="fp16", batch_sizes=(1, 2), targets=["sm_90a"])
    cfg = cfg.model_copy(update={"partition": PartitionConfig(mode="auto")})
    model = partition.name_nodes(prepare(cfg, token_block("tanh")).model)
    parted = partition.partition_model(cfg, model)
    tracks = {d.node: d.track for d in parted.assignment.decisions}
    body = [n.name for n in model.graph.node if n.name.startswith("/blk/")]
    assert {"/blk/ln", "/blk/fc1/matmul", "/blk/gelu", "/blk/fc2/matmul", "/blk/residual"} <= set(body)
    assert all(tracks[n] == "A" for n in body), {n: tracks[n] for n in body if tracks[n] != "A"}
    segments = [s for s in parted.plan.segments if any(n in s.nodes for n in body)]
    assert len(segments) == 1 and segments[0].track == "A"


def test_with_sizes_the_tokens_stay_as_exported() -> None:
    """``sizes`` re-shapes the model to other input sizes, which the (H, W) the pass writes into its Reshapes would
    refuse: the front end says so and leaves the token tensors to Track B."""
    cfg = BuildConfig(model=Path("block.onnx"), batch_sizes=(1,), targets=["sm_90a"], sizes=[[1, 37], [2, 74]])
    fe = prepare(cfg, token_block())
    assert any(r.stage == "tokens" and "`sizes`" in r.detail for r in fe.rewrites)
    assert "MatMul" in {n.op_type for n in fe.body.graph.node}


CONFIG = """\
model: block.onnx
precision: fp16
batch_sizes: [1, 3]
targets: []
verify:
  samples: 1
"""


def test_a_token_block_builds_and_verifies_on_the_cpu(tmp_path: Path) -> None:
    from dualtrack.compiler.build import build

    onnx.save(token_block("none", exits=False, seed=7), tmp_path / "block.onnx")
    (tmp_path / "block.yaml").write_text(CONFIG)
    result = build(tmp_path / "block.yaml", tmp_path / "out")  # raises when verification fails
    assert result.verification is not None and result.verification["passed"] is True
    plan = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]
    # The block (LayerNorm to residual, and the head's Conv) is one Track A segment; the position embedding's
    # Add before it is not a Track A node (a constant of the image's own shape, not one value per channel).
    body = [s for s in plan["segments"] if any(n.startswith("/blk/") for n in s["nodes"])]
    assert len(body) == 1 and body[0]["track"] == "A"
    ops = [c["op"] for c in body[0]["calls"]]
    assert "norm" in ops and sum("conv" in op for op in ops) >= 2, ops  # the LayerNorm, both Linears
    checks = result.verification["checks"]
    assert any(c["name"].startswith(f"seg{body[0]['index']}_A[numpy kernels]") for c in checks), checks


# -- a pre-norm transformer block as torch exports it -----------------------------------------------------------


def torch_block_export(tmp_path: Path, dynamo: bool) -> Path:
    """A pre-norm block on an image's tokens, exported as users do (dynamo: its defaults at batch 1; TorchScript:
    opset 17, dynamic batch): flatten(2).transpose(1, 2), x + proj(SDPA(qkv(LN(x)))), x + fc2(GELU(fc1(LN(x)))),
    transpose(1, 2).reshape back, a 1x1 head. 5 x 7 = 35 tokens of C = 64 in 2 heads of 32, a hidden width of 136."""
    torch = pytest.importorskip("torch")
    from attention_cases import torch_modules

    sdpa = torch_modules()[1]["sdpa"][0]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.head = torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.Conv2d(64, 2, 1)
            self.ln1, self.ln2 = torch.nn.LayerNorm(64), torch.nn.LayerNorm(64)
            self.attn = sdpa(64, 2)
            self.fc1, self.fc2 = torch.nn.Linear(64, 136), torch.nn.Linear(136, 64)

        def forward(self, x):
            y = self.stem(x)
            n, c, h, w = y.shape
            t = y.flatten(2).transpose(1, 2)
            t = t + self.attn(self.ln1(t))
            t = t + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(t)), approximate="tanh"))
            return self.head(t.transpose(1, 2).reshape(n, c, h, w))

    torch.manual_seed(2)
    path = tmp_path / f"block_{int(dynamo)}.onnx"
    kw = {"dynamo": True} if dynamo else {"dynamo": False, "opset_version": 17, "dynamic_axes": {"x": {0: "N"}}}
    torch.onnx.export(Block().eval(), (torch.randn(1, 3, 5, 7),), str(path), input_names=["x"], **kw)
    return path


@pytest.mark.parametrize("dynamo", [False, True])
def test_a_torch_exported_block_is_one_track_a_segment_that_matches_onnxruntime(tmp_path: Path, dynamo: bool) -> None:
    path = torch_block_export(tmp_path, dynamo)
    original = onnx.load(str(path))
    fp32 = prepare(BuildConfig(model=path, precision="fp32", batch_sizes=(1, 2), targets=["sm_90a"]))
    assert any(r.stage == "tokens" for r in fp32.rewrites)
    x = np.random.default_rng().standard_normal((2, 3, 5, 7)).astype(np.float32)
    body = ort.InferenceSession(fp32.body.SerializeToString(), providers=["CPUExecutionProvider"])
    got = body.run(None, {"x": x})[0]
    want = np.concatenate([run_ort_x(original, x[i : i + 1]) for i in range(2)])  # the export, an image at a time
    assert rel_l2(got, want) <= 1e-5
    cfg = BuildConfig(model=path, precision="fp16", batch_sizes=(1, 2), targets=["sm_90a"])
    cfg = cfg.model_copy(update={"partition": PartitionConfig(mode="auto")})
    model = partition.name_nodes(prepare(cfg).model)
    parted = partition.partition_model(cfg, model)
    tracks = {d.node: d.track for d in parted.assignment.decisions}
    kinds = ("LayerNormalization", "Softmax", "Gelu", "Conv", "MatMul")
    block = [n.name for n in model.graph.node if n.op_type in kinds and not n.name.startswith(("pre/", "post/"))]
    first_conv = next(n.name for n in model.graph.node if n.op_type == "Conv")  # the stem reads the model's input
    block = [n for n in block if n != first_conv]
    assert all(tracks[n] == "A" for n in block), {n: tracks[n] for n in block if tracks[n] != "A"}
    assert len({s.index for s in parted.plan.segments for n in block if n in s.nodes}) == 1


def run_ort_x(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]
