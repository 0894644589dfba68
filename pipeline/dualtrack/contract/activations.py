"""The fused activations: one table, the only definition that the plan, the lowering, the kernels'
specs and the device code read.

A row (:class:`ActivationKind`) is one activation: its name, its id (the ``act`` kernel argument and
plan attr; stable, never renumbered), the ONNX op and attributes it matches (:class:`OnnxMatch`), a
numpy reference, and its device formula, a CUDA expression over ``v`` (fp32) and the two fp32
parameters ``p0``, ``p1``. :func:`render_header` turns the table into
``handwritten_ptx/dualtrack_activations.cuh`` (``dt_activate``), which every kernel that fuses an
activation calls; the compiler's `make ptx` writes it and its freshness check compares it.

An applied activation (:class:`Activation`: an id and its parameters) travels in a plan call's attrs
as ``act`` and, for every activation but none, ``act_p0`` / ``act_p1`` (float32 bits: attrs are ints
in the plan's JSON, the bits keep the exported float exactly), and reaches the kernels as their last
arguments ``act`` (int32), ``p0``, ``p1`` (float32).

NaN propagates through every formula as through numpy (comparisons that keep NaN, never
``fminf``/``fmaxf`` on the value alone). The seghead's head activations (``plan.HEAD_ACTS``: softmax
over classes) are another concept and not in this table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dualtrack.contract.plan import KernelCall, bits_f32, f32_bits
from dualtrack.errors import InputError

Reference = Callable[[np.ndarray, Any, Any], np.ndarray]


@dataclass(frozen=True)
class OnnxParam:
    """Where an ONNX node keeps one of an activation's parameters: attribute ``attr`` (ONNX's
    ``default`` when absent), or from opset 11 on, for Clip, the optional scalar input ``input``."""

    attr: str
    default: float
    input: int = 0  # > 0: the node input that holds it (Clip's min, max); 0: an attribute only


@dataclass(frozen=True)
class OnnxMatch:
    """The ONNX op a row matches, the parameters it reads (p0, then p1), and, where one op has
    several rows (Gelu), the string attribute that picks this one: (name, this row's value, ONNX's
    default). ``opset``: the ai.onnx opset that has the op in this form (tests build models at it)."""

    op: str
    params: tuple[OnnxParam, ...] = ()
    select: tuple[str, str, str] | None = None
    opset: int = 13


@dataclass(frozen=True)
class ActivationKind:
    """One row of the table. ``device`` is a CUDA expression over ``v``, ``p0``, ``p1`` (fp32; the
    header's helpers ``dt_clamp_nan`` and ``dt_softplus`` may be used); ``numpy`` computes the same
    in its input's dtype (float32: what the kernels compute; float64: a reference). ``onnx`` is None
    where no single ONNX op is the activation (none; silu, which the partition fuses from the
    exported ``Mul(x, Sigmoid(x))``)."""

    name: str
    id: int
    device: str
    numpy: Reference
    onnx: OnnxMatch | None = None

    @property
    def defaults(self) -> tuple[float, float]:
        """p0, p1 when the ONNX node sets none of them (ONNX's defaults; 0 where unused)."""
        values = [p.default for p in self.onnx.params] if self.onnx else []
        return (*values, 0.0, 0.0)[:2]  # type: ignore[return-value]

    @property
    def enum(self) -> str:
        """The name of its id in the generated header."""
        return f"DT_ACT_{self.name.upper()}"


# --- numpy references, computed in v's dtype ----------------------------------------------------


def _t(v: np.ndarray, x: float) -> Any:
    return v.dtype.type(x)


def _clamp(v: np.ndarray, lo: Any, hi: Any) -> np.ndarray:
    # np.clip would do, but this spelling keeps NaN exactly as the device's comparisons do.
    return np.where(v < lo, lo, np.where(v > hi, hi, v)).astype(v.dtype)


def _exp(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp of a large value is inf, as on the GPU; 1/inf = 0
        return np.exp(v)


def _softplus(v: np.ndarray) -> np.ndarray:
    # log(1 + e^v) without overflow: max(v, 0) + log1p(e^-|v|).
    return np.maximum(v, _t(v, 0)) + np.log1p(np.exp(-np.abs(v)))


def _erf(v: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf element by element is exact enough for a reference.
    return np.vectorize(math.erf, otypes=[np.float64])(v).astype(v.dtype)


def _gelu_tanh(v: np.ndarray) -> np.ndarray:
    inner = _t(v, math.sqrt(2 / math.pi)) * (v + _t(v, 0.044715) * v * v * v)
    return _t(v, 0.5) * v * (_t(v, 1) + np.tanh(inner))


def _where_negative(v: np.ndarray, neg: np.ndarray) -> np.ndarray:
    return np.where(v < 0, neg, v).astype(v.dtype)


# The table. Ids are part of the plan's and the kernels' ABI: a new activation takes the next id,
# an id is never reused (tests/test_activations.py lists them).
KINDS: tuple[ActivationKind, ...] = (
    ActivationKind("none", 0, "v", lambda v, p0, p1: v),
    ActivationKind(
        "relu", 1, "v < 0.0f ? 0.0f : v", lambda v, p0, p1: _where_negative(v, np.zeros_like(v)), OnnxMatch("Relu")
    ),
    ActivationKind(  # min(max(v, p0), p1); ReLU6 is Clip(0, 6); bounds are attributes before opset 11
        "clip",
        2,
        "dt_clamp_nan(v, p0, p1)",
        lambda v, p0, p1: _clamp(v, _t(v, p0), _t(v, p1)),
        OnnxMatch("Clip", (OnnxParam("min", -math.inf, 1), OnnxParam("max", math.inf, 2))),
    ),
    ActivationKind(
        "hardsigmoid",
        3,
        "dt_clamp_nan(fmaf(p0, v, p1), 0.0f, 1.0f)",
        lambda v, p0, p1: _clamp(_t(v, p0) * v + _t(v, p1), _t(v, 0), _t(v, 1)),
        OnnxMatch("HardSigmoid", (OnnxParam("alpha", 0.2), OnnxParam("beta", 0.5))),
    ),
    ActivationKind(
        "hardswish",
        4,
        "v * dt_clamp_nan(fmaf(v, 1.0f / 6.0f, 0.5f), 0.0f, 1.0f)",
        lambda v, p0, p1: v * _clamp(v * _t(v, 1 / 6) + _t(v, 0.5), _t(v, 0), _t(v, 1)),
        OnnxMatch("HardSwish", opset=14),
    ),
    ActivationKind(
        "sigmoid",
        5,
        "1.0f / (1.0f + expf(-v))",
        lambda v, p0, p1: _t(v, 1) / (_t(v, 1) + _exp(-v)),
        OnnxMatch("Sigmoid"),
    ),
    ActivationKind("silu", 6, "v / (1.0f + expf(-v))", lambda v, p0, p1: v / (_t(v, 1) + _exp(-v))),
    ActivationKind(
        "leakyrelu",
        7,
        "v < 0.0f ? p0 * v : v",
        lambda v, p0, p1: _where_negative(v, _t(v, p0) * v),
        OnnxMatch("LeakyRelu", (OnnxParam("alpha", 0.01),)),
    ),
    ActivationKind(
        "elu",
        8,
        "v < 0.0f ? p0 * expm1f(v) : v",
        lambda v, p0, p1: _where_negative(v, _t(v, p0) * np.expm1(np.minimum(v, _t(v, 0)))),
        OnnxMatch("Elu", (OnnxParam("alpha", 1.0),)),
    ),
    ActivationKind(  # gamma * (alpha * e^v - alpha) below 0, gamma * v above (the NaN takes the first)
        "selu",
        9,
        "v > 0.0f ? p1 * v : p1 * (p0 * expm1f(v))",
        lambda v, p0, p1: np.where(
            v > 0, _t(v, p1) * v, _t(v, p1) * (_t(v, p0) * np.expm1(np.minimum(v, _t(v, 0))))
        ).astype(v.dtype),
        OnnxMatch(
            "Selu", (OnnxParam("alpha", 1.67326319217681884765625), OnnxParam("gamma", 1.05070102214813232421875))
        ),
    ),
    ActivationKind("tanh", 10, "tanhf(v)", lambda v, p0, p1: np.tanh(v), OnnxMatch("Tanh")),
    ActivationKind("softplus", 11, "dt_softplus(v)", lambda v, p0, p1: _softplus(v), OnnxMatch("Softplus")),
    ActivationKind(
        "mish",
        12,
        "v * tanhf(dt_softplus(v))",
        lambda v, p0, p1: v * np.tanh(_softplus(v)),
        OnnxMatch("Mish", opset=18),
    ),
    ActivationKind(
        "gelu",
        13,
        "0.5f * v * (1.0f + erff(v * 0.70710678118654752f))",
        lambda v, p0, p1: _t(v, 0.5) * v * (_t(v, 1) + _erf(v * _t(v, 1 / math.sqrt(2)))),
        OnnxMatch("Gelu", select=("approximate", "none", "none"), opset=20),
    ),
    ActivationKind(
        "gelu_tanh",
        14,
        "0.5f * v * (1.0f + tanhf(0.79788456080286536f * fmaf(0.044715f * v, v * v, v)))",
        lambda v, p0, p1: _gelu_tanh(v),
        OnnxMatch("Gelu", select=("approximate", "tanh", "none"), opset=20),
    ),
    ActivationKind(
        "softsign", 15, "v / (1.0f + fabsf(v))", lambda v, p0, p1: v / (_t(v, 1) + np.abs(v)), OnnxMatch("Softsign")
    ),
    ActivationKind(  # alpha * (e^(v / alpha) - 1) below 0 (ONNX's max(0, v) + min(0, ...)); ONNX takes float32 only
        "celu",
        16,
        "v < 0.0f ? p0 * expm1f(v / p0) : v",
        lambda v, p0, p1: _where_negative(v, _t(v, p0) * np.expm1(np.minimum(v, _t(v, 0)) / _t(v, p0))),
        OnnxMatch("Celu", (OnnxParam("alpha", 1.0),)),
    ),
)

BY_NAME: Mapping[str, ActivationKind] = {k.name: k for k in KINDS}
BY_ID: Mapping[int, ActivationKind] = {k.id: k for k in KINDS}
ACTIVATIONS: Mapping[str, int] = {k.name: k.id for k in KINDS}  # name -> id
# The ONNX op types some row matches: the activation nodes the lowering recognises.
ONNX_OPS: tuple[str, ...] = tuple(dict.fromkeys(k.onnx.op for k in KINDS if k.onnx))
# What the kernels with a ``relu`` flag instead of ``act, p0, p1`` (conv3x3, conv1x1, conv3x3_wgmma)
# can fuse: flag 0 is none, flag 1 relu.
RELU_FLAG: Mapping[int, int] = {BY_NAME["none"].id: 0, BY_NAME["relu"].id: 1}


@dataclass(frozen=True)
class Activation:
    """One applied activation: a row's id (:data:`ACTIVATIONS`) and its two float parameters
    (unused ones 0)."""

    code: int = 0
    p0: float = 0.0
    p1: float = 0.0

    def __post_init__(self) -> None:
        if self.code not in BY_ID:
            raise InputError(f"activation code {self.code} is not one of {dict(ACTIVATIONS)}")

    @property
    def kind(self) -> ActivationKind:
        return BY_ID[self.code]

    @classmethod
    def of(cls, call: KernelCall) -> Activation:
        """The activation a call's attrs name (``act``, ``act_p0``, ``act_p1``; none by default)."""
        return cls(call.attr("act"), bits_f32(call.attr("act_p0")), bits_f32(call.attr("act_p1")))

    @classmethod
    def named(cls, name: str, p0: float | None = None, p1: float | None = None) -> Activation:
        """The row ``name`` with these parameters (ONNX's defaults where not given)."""
        if name not in BY_NAME:
            raise InputError(f"'{name}' is not an activation; use one of {', '.join(BY_NAME)}")
        d0, d1 = BY_NAME[name].defaults
        return cls(BY_NAME[name].id, d0 if p0 is None else p0, d1 if p1 is None else p1)

    def attrs(self) -> tuple[tuple[str, int], ...]:
        """How a plan call's attrs hold it (the inverse of :meth:`of`)."""
        if self.code == 0:
            return (("act", 0),)
        return (("act", self.code), ("act_p0", f32_bits(self.p0)), ("act_p1", f32_bits(self.p1)))

    def kernel_args(self) -> dict[str, int | float]:
        """The kernels' last three arguments: ``act``, ``p0``, ``p1``."""
        return {"act": self.code, "p0": self.p0, "p1": self.p1}

    def relu_flag(self) -> int | None:
        """The ``relu`` argument of a kernel that fuses ReLU only (:data:`RELU_FLAG`), or None."""
        return RELU_FLAG.get(self.code)

    def apply(self, v: np.ndarray) -> np.ndarray:
        """The activation on float32 values (what the kernels compute before their one rounding)."""
        v = np.asarray(v, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(self.kind.numpy(v, np.float32(self.p0), np.float32(self.p1)), np.float32)


def match_onnx(
    op: str, attrs: Mapping[str, Any], inputs: Mapping[int, float | None] | None = None
) -> tuple[Activation | None, str | None]:
    """The activation an ONNX node is, from its op type, its attributes and the values of its
    optional inputs (``inputs``: index -> the scalar constant there, None when it is computed at run
    time or not a scalar); (None, why not) for a node that is none of the table's rows."""
    rows = [k for k in KINDS if k.onnx is not None and k.onnx.op == op]
    if not rows:
        return None, f"{op} is not an activation"
    for kind in rows:
        m = kind.onnx
        assert m is not None
        if m.select is None or str(attrs.get(m.select[0], m.select[2])) == m.select[1]:
            break
    else:
        attr = rows[0].onnx.select[0]  # type: ignore[union-attr,index]
        return None, f"{op} with {attr}={attrs.get(attr)!r} is not an activation the kernels compute"
    values: list[float] = []
    for p in m.params:
        value = float(attrs.get(p.attr, p.default))
        if p.input and inputs and p.input in inputs:
            given = inputs[p.input]
            if given is None:
                return None, f"{op} {p.attr} is computed at run time (the kernels take constants)"
            value = float(given)
        values.append(value)
    return Activation(kind.id, *values), None


# --- the device side: handwritten_ptx/dualtrack_activations.cuh ---------------------------------

HEADER = "dualtrack_activations.cuh"

_PRELUDE = """\
// GENERATED from the activation table, dualtrack.contract.activations (render_header): do not edit.
// `make ptx` (python -m dualtrack.compiler.kernel_build) rewrites it; its --check says when it is stale.
//
// dt_activate(v, act, p0, p1): the fused activation `act` (an id of the table) with its parameters
// p0, p1, in fp32. NaN propagates through every one of them, as through numpy.
#ifndef DUALTRACK_ACTIVATIONS_CUH
#define DUALTRACK_ACTIVATIONS_CUH

__device__ __forceinline__ float dt_clamp_nan(float v, float lo, float hi) {
    // fminf/fmaxf would turn NaN into a bound; the comparisons keep it.
    return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ float dt_softplus(float v) {
    // log(1 + e^v) without overflow; fmaxf's NaN-to-0 is harmless: the log1p term is NaN then.
    return fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v)));
}
"""


# Rows up to this id (none .. leakyrelu: the activations of the CNN segmenters) are inlined into every
# kernel's epilogue; the later rows (transcendental: erf, tanh, log1p) go through one __noinline__
# function. With all 16 rows inlined at every epilogue site the conv and mobile kernels' PTX doubled
# and LR-ASPP ran 4% slower at N=8 on an H100 (bench/results/versus-lraspp-26b42dd-h100*.json).
# LeakyReLU (a compare and a multiply; DynUNet's) is inlined: called, it held DynUNet's norm passes
# at a quarter of the memory bandwidth on an H100.
INLINE_MAX_ID = 7


def render_header() -> str:
    """The text of ``handwritten_ptx/dualtrack_activations.cuh``: the ids as an enum, one
    ``dt_act_<name>`` function a row, and the two dispatchers on ``act``: ``dt_activate`` (one value)
    and ``dt_activate_n`` (an array, the switch outside its loop, so that a kernel applying it to
    the registers of an unrolled epilogue keeps one formula's temporaries live, not every row's).
    Rows past :data:`INLINE_MAX_ID` are dispatched by ``dt_activate_rest``, never inlined."""
    enum = "".join(f"    {k.enum} = {k.id},\n" for k in KINDS)
    rows = "".join(
        f"__device__ __forceinline__ float dt_act_{k.name}(float v, float p0, float p1) {{ return {k.device}; }}\n"
        for k in KINDS
    )
    hot = [k for k in KINDS if 0 < k.id <= INLINE_MAX_ID]
    rest = [k for k in KINDS if k.id > INLINE_MAX_ID]
    last_hot = hot[-1].enum
    cases = "".join(f"        case {k.enum}: return dt_act_{k.name}(v, p0, p1);\n" for k in rest)
    one = "".join(f"        case {k.enum}: return dt_act_{k.name}(v, p0, p1);\n" for k in hot)
    many = "".join(
        f"        case {k.enum}:\n#pragma unroll\n"
        f"            for (int i = 0; i < N; ++i) v[i] = dt_act_{k.name}(v[i], p0, p1);\n"
        "            break;\n"
        for k in hot
    )
    return (
        f"{_PRELUDE}\n"
        f"enum DtAct : int {{\n{enum}}};\n\n"
        f"{rows}\n"
        "__device__ __noinline__ float dt_activate_rest(float v, int act, float p0, float p1) {\n"
        "    switch (act) {\n"
        f"{cases}"
        "        default: return v;\n"
        "    }\n"
        "}\n\n"
        "__device__ __forceinline__ float dt_activate(float v, int act, float p0, float p1) {\n"
        f"    if (act > {last_hot}) return dt_activate_rest(v, act, p0, p1);\n"
        "    switch (act) {\n"
        f"{one}"
        "        default: return v;\n"
        "    }\n"
        "}\n\n"
        "template <int N>\n"
        "__device__ __forceinline__ void dt_activate_n(float (&v)[N], int act, float p0, float p1) {\n"
        f"    if (act > {last_hot}) {{\n"
        "#pragma unroll\n"
        "        for (int i = 0; i < N; ++i) v[i] = dt_activate_rest(v[i], act, p0, p1);\n"
        "        return;\n"
        "    }\n"
        "    switch (act) {\n"
        f"{many}"
        "        default: break;\n"
        "    }\n"
        "}\n\n"
        "#endif  // DUALTRACK_ACTIVATIONS_CUH\n"
    )
