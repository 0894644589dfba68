"""Attention graphs no zoo model has, for tests/test_attention.py (CPU) and tests/gpu/test_attention_gpu.py.

:func:`attention_graph` writes scaled dot-product attention the way the exporters decompose it: token
tensors (N, L, heads*d) in, Reshape + Transpose to heads, Kᵀ by a Transpose (or K handed over already
transposed, (N, heads*d, Lk)), the scale after the product, as a Div, or on Q (and K) before it, an
optional constant bias or causal mask Add, Softmax, the product with V, and back to tokens.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import attention_patterns, frontend, lower_mobile, partition
from dualtrack.compiler.config import BuildConfig


@dataclass(frozen=True)
class Case:
    """One attention: ``heads`` of ``d`` dims, ``lq`` queries, ``lk`` keys; ``scale_on``: ``scores``
    (Mul after Q·Kᵀ), ``div`` (Div by sqrt d after it), ``q`` (Mul on Q), ``qk`` (sqrt of it on Q and
    on Kᵀ); ``bias``: ``none``, ``head`` ((1, heads, Lq, Lk) constant) or ``causal`` ((Lq, Lk) mask of
    -inf above the diagonal); ``kt``: K arrives as (N, heads*d, Lk); ``flat``: one head, no head split
    (3-D products)."""

    heads: int
    d: int
    lq: int
    lk: int
    scale_on: str = "scores"
    bias: str = "none"
    kt: bool = False
    flat: bool = False

    @property
    def c(self) -> int:
        return self.heads * self.d

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    def id(self) -> str:
        extra = ("_kt" if self.kt else "") + ("_flat" if self.flat else "")
        return f"h{self.heads}_d{self.d}_q{self.lq}_k{self.lk}_{self.scale_on}_{self.bias}{extra}"


class _Builder:
    def __init__(self, dtype: int, seed: int) -> None:
        self.dtype, self.rng = dtype, np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def scalar(self, name: str, value: float) -> str:
        """A float constant rounded through fp16 first: the fp32 and fp16 graphs of a case hold the same value."""
        return self.const(name, np.array(value, np.float16).astype(helper.tensor_dtype_to_np_dtype(self.dtype)))

    def node(self, op: str, name: str, inputs: list[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def heads(self, x: str, name: str, case: Case, length: int, perm: list[int]) -> str:
        """(N, L, C) -> (N, heads, L, d) (perm 0,2,1,3) or (N, heads, d, L) (perm 0,2,3,1)."""
        if case.flat:
            return x if perm == [0, 2, 1, 3] else self.node("Transpose", f"{name}/t", [x], perm=[0, 2, 1])
        shape = self.const(f"{name}/shape", np.array([0, length, case.heads, case.d], np.int64))
        return self.node("Transpose", f"{name}/t", [self.node("Reshape", f"{name}/r", [x, shape])], perm=perm)


def attention_graph(
    case: Case,
    dtype: int = TensorProto.FLOAT16,
    *,
    softmax_axis: int = -1,
    runtime_scale: bool = False,
    runtime_bias: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """The attention of ``case`` as an ONNX graph of ``dtype`` (inputs q, k, v; output o). Negative
    cases: ``softmax_axis`` other than the keys', a scale read from an input (``runtime_scale``), a
    bias read from an input (``runtime_bias``)."""
    b = _Builder(dtype, seed)
    q = b.heads("q", "q", case, case.lq, [0, 2, 1, 3])
    if case.kt:  # (N, C, Lk) -> (N, heads, d, Lk): no Transpose needed
        shape = b.const("k/shape", np.array([0, case.heads, case.d, case.lk], np.int64))
        kt = "k" if case.flat else b.node("Reshape", "k/r", ["k", shape])
    else:
        kt = b.heads("k", "k", case, case.lk, [0, 2, 3, 1])
    v = b.heads("v", "v", case, case.lk, [0, 2, 1, 3])
    if case.scale_on == "q":
        q = b.node("Mul", "q/scale", [q, b.scalar("c/scale_q", case.scale)])
    if case.scale_on == "qk":
        root = math.sqrt(case.scale)
        q = b.node("Mul", "q/scale", [q, b.scalar("c/scale_q", root)])
        kt = b.node("Mul", "k/scale", [b.scalar("c/scale_k", root), kt])
    s = b.node("MatMul", "scores", [q, kt])
    if runtime_scale:
        s = b.node("Mul", "scale", [s, "scale_in"])
    elif case.scale_on == "scores":
        s = b.node("Mul", "scale", [s, b.scalar("c/scale", case.scale)])
    elif case.scale_on == "div":
        s = b.node("Div", "scale", [s, b.scalar("c/sqrt_d", math.sqrt(case.d))])
    if runtime_bias:
        s = b.node("Add", "bias", [s, "bias_in"])
    elif case.bias != "none":
        s = b.node("Add", "bias", [s, b.const("bias_c", _bias(case, dtype, b.rng))])
    p = b.node("Softmax", "softmax", [s], axis=softmax_axis)
    o = b.node("MatMul", "pv", [p, v])
    if not case.flat:
        shape = b.const("o/shape", np.array([0, case.lq, case.c], np.int64))
        o = b.node("Reshape", "o", [b.node("Transpose", "o/t", [o], perm=[0, 2, 1, 3]), shape])
    b.nodes[-1].output[0] = "o"  # the last node writes the graph's output (pv's own name where flat)
    return _model(b, case, dtype, runtime_scale, runtime_bias)


def _bias(case: Case, dtype: int, rng: np.random.Generator) -> np.ndarray:
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    if case.bias == "head":
        return rng.standard_normal((1, case.heads, case.lq, case.lk)).astype(np.float16).astype(np_dtype)
    i, j = np.arange(case.lq)[:, None], np.arange(case.lk)[None, :]
    return np.where(j > i, -np.inf, 0.0).astype(np_dtype)  # causal: key j sees queries i >= j; column 0 always


def _model(b: _Builder, case: Case, dtype: int, runtime_scale: bool, runtime_bias: bool) -> onnx.ModelProto:
    kshape = ["N", case.c, case.lk] if case.kt else ["N", case.lk, case.c]
    inputs = [
        helper.make_tensor_value_info("q", dtype, ["N", case.lq, case.c]),
        helper.make_tensor_value_info("k", dtype, kshape),
        helper.make_tensor_value_info("v", dtype, ["N", case.lk, case.c]),
    ]
    if runtime_scale:
        inputs.append(helper.make_tensor_value_info("scale_in", dtype, []))
    if runtime_bias:
        inputs.append(helper.make_tensor_value_info("bias_in", dtype, [1, case.heads, case.lq, case.lk]))
    out = helper.make_tensor_value_info("o", dtype, ["N", case.lq, case.c])
    graph = helper.make_graph(b.nodes, "attention", inputs, [out], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="dualtrack-tests")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def feeds(case: Case, n: int, seed: int = 1) -> dict[str, np.ndarray]:
    """Fresh random fp32 q, k, v of ``case`` at batch ``n``, scaled like a trained network's (unit
    variance): fp16-representable values (rounded once), so fp16 and fp32 graphs see the same numbers."""
    rng = np.random.default_rng(seed)
    kshape = (n, case.c, case.lk) if case.kt else (n, case.lk, case.c)
    shapes = {"q": (n, case.lq, case.c), "k": kshape, "v": (n, case.lk, case.c)}
    return {k: rng.standard_normal(s).astype(np.float16).astype(np.float32) for k, s in shapes.items()}


def attentions(model: onnx.ModelProto) -> attention_patterns.Attentions:
    """The model's matches, as the partition finds them."""
    facts = lower_mobile.Facts(model, partition.infer_specs(model))
    return attention_patterns.find_attention(facts, set())


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


# -- torch's exports -------------------------------------------------------------------------------


def torch_modules() -> tuple[Any, dict[str, tuple[Any, tuple[int, ...]]]]:
    """torch and the tiny attention modules (class, input shape) by name; skips without torch."""
    torch = pytest.importorskip("torch")

    class SpatialReduction(torch.nn.Module):
        """SegFormer's attention on an image: Q from a 1x1 conv, K and V from one strided conv."""

        def __init__(self, c: int = 64, heads: int = 4, sr: int = 2) -> None:
            super().__init__()
            self.h, self.d = heads, c // heads
            self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
            self.q = torch.nn.Conv2d(c, c, 1)
            self.kv = torch.nn.Conv2d(c, 2 * c, sr, stride=sr)
            self.post = torch.nn.Conv2d(c, c, 1)

        def forward(self, x):
            x = self.conv(x)
            n, c, hh, ww = x.shape
            q = self.q(x).flatten(2).transpose(1, 2).reshape(n, hh * ww, self.h, self.d).permute(0, 2, 1, 3)
            kv = self.kv(x).flatten(2).transpose(1, 2).reshape(n, -1, 2, self.h, self.d).permute(2, 0, 3, 1, 4)
            a = ((q @ kv[0].transpose(-2, -1)) * self.d**-0.5).softmax(-1)
            o = (a @ kv[1]).transpose(1, 2).reshape(n, hh * ww, c).transpose(1, 2).reshape(n, c, hh, ww)
            return self.post(o)

    class Tokens(torch.nn.Module):
        """timm's attention on tokens: a fused qkv Linear, unbind, scale on Q, a relative-position bias."""

        def __init__(self, c: int = 96, heads: int = 3, length: int = 49) -> None:
            super().__init__()
            self.h, self.d = heads, c // heads
            self.qkv = torch.nn.Linear(c, 3 * c)
            self.bias = torch.nn.Parameter(torch.randn(1, heads, length, length))
            self.proj = torch.nn.Linear(c, c)

        def forward(self, x):
            n, length, c = x.shape
            q, k, v = self.qkv(x).reshape(n, length, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
            a = ((q * self.d**-0.5) @ k.transpose(-2, -1) + self.bias).softmax(-1)
            return self.proj((a @ v).transpose(1, 2).reshape(n, length, c))

    class Einsum(torch.nn.Module):
        """MONAI's SABlock (UNETR): a fused qkv Linear, both products as torch.einsum, K not transposed."""

        def __init__(self, c: int = 128, heads: int = 4) -> None:
            super().__init__()
            self.h, self.d = heads, c // heads
            self.qkv = torch.nn.Linear(c, 3 * c, bias=False)
            self.proj = torch.nn.Linear(c, c)

        def forward(self, x):
            n, length, c = x.shape
            qkv = self.qkv(x).reshape(n, length, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
            a = (torch.einsum("blxd,blyd->blxy", qkv[0], qkv[1]) * self.d**-0.5).softmax(dim=-1)
            o = torch.einsum("bhxy,bhyd->bhxd", a, qkv[2])
            return self.proj(o.transpose(1, 2).reshape(n, length, c))

    class Sdpa(torch.nn.Module):
        """timm's fused attention: F.scaled_dot_product_attention, which the dynamo exporter decomposes with
        K's transpose as Reshape (N*h, L, d) / Transpose / Reshape back and the scale's root on Q and Kᵀ."""

        def __init__(self, c: int = 64, heads: int = 2) -> None:
            super().__init__()
            self.h, self.d = heads, c // heads
            self.qkv = torch.nn.Linear(c, 3 * c)
            self.proj = torch.nn.Linear(c, c)

        def forward(self, x):
            n, length, c = x.shape
            q, k, v = self.qkv(x).reshape(n, length, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.proj(o.transpose(1, 2).reshape(n, length, c))

    class PositionMap(torch.nn.Module):
        """smp MAnet's PAB: a softmax over the whole flattened (HW x HW) map, not over the keys."""

        def __init__(self, c: int = 32) -> None:
            super().__init__()
            self.top, self.center = torch.nn.Conv2d(c, 16, 1), torch.nn.Conv2d(c, 16, 1)
            self.bottom = torch.nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            n, c, h, w = x.shape
            m = torch.matmul(self.center(x).flatten(2).transpose(1, 2), self.top(x).flatten(2))
            m = torch.softmax(m.view(n, -1), dim=1).view(n, h * w, h * w)
            return torch.matmul(m, self.bottom(x).flatten(2).transpose(1, 2)).reshape(n, c, h, w)

    class Multihead(torch.nn.Module):
        """torch's nn.MultiheadAttention, which works sequence-first: batch_first transposes (N, L, E) to
        (L, N, E) inside, the default takes (L, N, E) from the caller (permuted here); a Linear after it."""

        def __init__(self, c: int = 96, heads: int = 3, batch_first: bool = True) -> None:
            super().__init__()
            self.batch_first = batch_first
            self.attn = torch.nn.MultiheadAttention(c, heads, batch_first=batch_first)
            self.proj = torch.nn.Linear(c, c)
            with torch.no_grad():
                self.attn.out_proj.bias.normal_(0.0, 0.1)  # torch initialises it to 0

        def forward(self, x):
            t = x if self.batch_first else x.permute(1, 0, 2)
            o = self.attn(t, t, t, need_weights=False)[0]
            return self.proj(o if self.batch_first else o.permute(1, 0, 2))

    class SequenceFirst(Multihead):
        def __init__(self) -> None:
            super().__init__(64, 2, batch_first=False)

    return torch, {
        "mha": (Multihead, (1, 45, 96)),
        "mha_seq_first": (SequenceFirst, (1, 33, 64)),
        "sra": (SpatialReduction, (1, 64, 8, 8)),
        "tokens": (Tokens, (1, 49, 96)),
        "einsum": (Einsum, (1, 40, 128)),
        "sdpa": (Sdpa, (1, 30, 64)),
        "pab": (PositionMap, (1, 32, 6, 6)),
    }


def exported_fp16(tmp_path: Path, name: str, dynamo: bool) -> onnx.ModelProto:
    """The module exported as a user would (batch dynamic for dynamo=False), through the front end at fp16."""
    torch, modules = torch_modules()
    cls, shape = modules[name]
    torch.manual_seed(0)
    path = tmp_path / f"{name}_{int(dynamo)}.onnx"
    f = io.BytesIO()
    kw = {"dynamo": True} if dynamo else {"dynamo": False, "opset_version": 17, "dynamic_axes": {"x": {0: "N"}}}
    torch.onnx.export(cls().eval(), (torch.randn(*shape),), f, input_names=["x"], **kw)
    path.write_bytes(f.getvalue())
    cfg = BuildConfig(model=path, precision="fp16", batch_sizes=(1, 2), targets=["sm_80"])
    return partition.name_nodes(frontend.prepare(cfg).model)


def track_a_array(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 3, 1) if x.ndim == 4 else x
