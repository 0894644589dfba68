"""ONNX graphs of the normalisation chains as exporters write them (torch's GroupNorm, InstanceNorm,
LayerNorm over channels between Transposes, an unfolded BatchNormalization), and their lowering:
what tests/test_norm_lowering.py (CPU) and tests/gpu/test_norm_gpu.py build their cases from."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import lower_mobile, lower_norm, partition


class Graph:
    """An opset-17 ONNX graph under construction: input ``x`` (N, C, H, W) float32."""

    def __init__(self, c: int, h: int, w: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.c, self.h, self.w = c, h, w
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, h, w])]

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def second_input(self, name: str) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", self.c, self.h, self.w]))
        return name

    def model(self, out: str) -> onnx.ModelProto:
        y = helper.make_tensor_value_info(out, TensorProto.FLOAT, None)
        graph = helper.make_graph(self.nodes, "norm", self.inputs, [y], self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    def vec(self, name: str, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0) -> str:
        return self.const(name, (offset + scale * self.rng.standard_normal(shape)).astype(np.float32))

    # -- the chains ----------------------------------------------------------------------------------

    def group_norm(self, x: str, g: int, eps: float = 1e-5, affine: bool = True, shape_of_x: bool = False) -> str:
        """torch's opset-17 export of nn.GroupNorm(g, C); ``shape_of_x``: reshaped back by Shape(x), as
        the export writes it where the batch is symbolic and the front end cannot fold the shape."""
        shape = self.const("gn.shape", np.array([0, g, -1], np.int64))
        if shape_of_x:
            back = self.node("Shape", "gn/shape_of_x", [x])
        else:
            back = self.const("gn.back", np.array([-1, self.c, self.h, self.w], np.int64))
        t = self.node("Reshape", "gn/reshape", [x, shape])
        ones, zeros = self.const("gn.ones", np.ones(g, np.float32)), self.const("gn.zeros", np.zeros(g, np.float32))
        t = self.node("InstanceNormalization", "gn/in", [t, ones, zeros], epsilon=eps)
        t = self.node("Reshape", "gn/back", [t, back])
        if affine:
            t = self.node("Mul", "gn/mul", [t, self.vec("gn.gamma", (self.c, 1, 1), 0.5, 1.0)])
            t = self.node("Add", "gn/add", [t, self.vec("gn.beta", (self.c, 1, 1), 0.5)])
        return t

    def instance_norm(self, x: str, eps: float = 1e-5) -> str:
        scale, b = self.vec("in.scale", (self.c,), 0.5, 1.0), self.vec("in.b", (self.c,), 0.5)
        return self.node("InstanceNormalization", "in", [x, scale, b], epsilon=eps)

    def layer_norm(self, x: str, eps: float = 1e-6) -> str:
        t = self.node("Transpose", "ln/to_nhwc", [x], perm=[0, 2, 3, 1])
        scale, b = self.vec("ln.scale", (self.c,), 0.5, 1.0), self.vec("ln.b", (self.c,), 0.5)
        t = self.node("LayerNormalization", "ln", [t, scale, b], axis=-1, epsilon=eps)
        return self.node("Transpose", "ln/to_nchw", [t], perm=[0, 3, 1, 2])

    def layer_norm_decomposed(self, x: str, eps: float = 1e-6, square: str = "Pow", fp32_island: bool = False) -> str:
        """ConvNeXt's channels-first LayerNorm written out (u = mean_c(x), d = x - u, v = mean_c(d^2),
        d / sqrt(v + eps), then w[:, None, None] * . + b[:, None, None]); ``square``: Pow(d, 2) or Mul(d, d);
        ``fp32_island``: each mean between Casts to float and back, as an fp16 model's front end keeps them."""

        def mean(name: str, t: str) -> str:
            if not fp32_island:
                return self.node("ReduceMean", name, [t], axes=[1], keepdims=1)
            t = self.node("Cast", f"{name}/up", [t], to=TensorProto.FLOAT)
            t = self.node("ReduceMean", name, [t], axes=[1], keepdims=1)
            return self.node("Cast", f"{name}/down", [t], to=TensorProto.FLOAT)

        u = mean("lnd/mean", x)
        d = self.node("Sub", "lnd/sub", [x, u])
        sq = (
            self.node("Pow", "lnd/sq", [d, self.const("lnd.two", np.array(2.0, np.float32))])
            if square == "Pow"
            else (self.node("Mul", "lnd/sq", [d, d]))
        )
        v = mean("lnd/var", sq)
        a = self.node("Add", "lnd/eps", [v, self.const("lnd.eps", np.array(eps, np.float32))])
        y = self.node("Div", "lnd/div", [d, self.node("Sqrt", "lnd/sqrt", [a])])
        y = self.node("Mul", "lnd/mul", [self.vec("lnd.gamma", (self.c, 1, 1), 0.5, 1.0), y])
        return self.node("Add", "lnd/add", [y, self.vec("lnd.beta", (self.c, 1, 1), 0.5)])

    def batch_norm(self, x: str, eps: float = 1e-3) -> str:
        c = (self.c,)
        ins = [self.vec("bn.s", c, 0.5, 1.0), self.vec("bn.b", c, 0.5), self.vec("bn.m", c, 0.5)]
        var = self.const("bn.v", (0.2 + self.rng.random(self.c)).astype(np.float32))
        return self.node("BatchNormalization", "bn", [x, *ins, var], epsilon=eps)

    def silu(self, t: str) -> str:
        return self.node("Mul", "act/mul", [t, self.node("Sigmoid", "act/sigmoid", [t])])


def lowered(model: onnx.ModelProto) -> tuple[lower_norm.Norms, lower_mobile.Facts]:
    specs = partition.infer_specs(model)
    facts = lower_mobile.Facts(model, specs)
    return lower_norm.find_norms(facts, set()), facts
