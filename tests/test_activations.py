"""The activation table (dualtrack.contract.activations): stable ids, every row's numpy reference
against onnxruntime on a one-node model of the op it matches, the ONNX node -> row -> parameters
round trip the lowering relies on, and the generated CUDA header in step with the table."""

from __future__ import annotations

import numpy as np
import pytest
from activation_cases import ROWS, TEST_PARAMS, act_nodes, case_activation, run_ort_activation
from onnx import numpy_helper

from dualtrack.compiler import lower_mobile
from dualtrack.compiler.kernel_build import GENERATED_HEADERS
from dualtrack.contract import activations
from dualtrack.contract.activations import (
    ACTIVATIONS,
    BY_NAME,
    INLINE_MAX_ID,
    KINDS,
    Activation,
    match_onnx,
    render_header,
)
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError
from dualtrack.kernels.sources import SOURCE_DIR

# onnxruntime computes in float32 with its own exp/tanh/erf approximations; the references agree with
# it to a few float32 ulps, so: |ref - ort| <= ATOL + RTOL * |ort|.
RTOL, ATOL = 2e-6, 2e-6


def test_ids_are_stable() -> None:
    # The ids are the kernels' `act` argument and a plan attr: a renumbering must show up here.
    assert dict(ACTIVATIONS) == {
        "none": 0, "relu": 1, "clip": 2, "hardsigmoid": 3, "hardswish": 4, "sigmoid": 5, "silu": 6,
        "leakyrelu": 7, "elu": 8, "selu": 9, "tanh": 10, "softplus": 11, "mish": 12, "gelu": 13,
        "gelu_tanh": 14, "softsign": 15, "celu": 16,
    }  # fmt: skip


def test_names_ids_and_onnx_matches_are_unique() -> None:
    assert len({k.name for k in KINDS}) == len({k.id for k in KINDS}) == len(KINDS)
    matches = [(k.onnx.op, k.onnx.select) for k in KINDS if k.onnx]
    assert len(set(matches)) == len(matches)
    assert set(TEST_PARAMS) == {k.name for k in KINDS if k.onnx and k.onnx.params}


def _inputs(rng: np.random.Generator) -> np.ndarray:
    """Negatives and positives around the knees, large magnitudes, and the special values."""
    return np.concatenate(
        [
            rng.standard_normal(2000) * 4,
            rng.uniform(-100, 100, 500),
            [-1e30, -88.8, -20.0, -1e-30, 0.0, -0.0, 1e-30, 20.0, 88.8, 1e30, np.nan, np.inf, -np.inf],
        ]
    ).astype(np.float32)


@pytest.mark.parametrize("kind", ROWS, ids=[k.name for k in ROWS])
def test_every_reference_matches_onnxruntime(kind: activations.ActivationKind) -> None:
    act = case_activation(kind)
    x = _inputs(np.random.default_rng())
    want = run_ort_activation(act, x).astype(np.float64)
    with np.errstate(all="ignore"):
        exact = kind.numpy(x.astype(np.float64), act.p0, act.p1)  # float64: the reference
    kernels = act.apply(x).astype(np.float64)  # float32: what the kernels compute
    for name, got in (("float64", exact), ("float32", kernels)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=f"{kind.name} {name}")


@pytest.mark.parametrize("kind", ROWS, ids=[k.name for k in ROWS])
def test_an_onnx_node_lowers_to_its_row_and_parameters(kind: activations.ActivationKind) -> None:
    act = case_activation(kind)
    nodes, inits = act_nodes(act, "t", "y")
    consts = {i.name: numpy_helper.to_array(i) for i in inits}
    if kind.name == "silu":  # a pattern the partition fuses after a Conv, not one node
        assert [n.op_type for n in nodes] == ["Sigmoid", "Mul"]
        return
    (node,) = nodes
    got, why = lower_mobile.match_activation(node, consts.get)
    assert why is None and got == act
    call = KernelCall("eltwise", ("t",), ("y",), (), got.attrs())
    assert Activation.of(call) == act  # through the plan's int attrs and back, bit for bit


def test_onnx_defaults_fill_missing_attributes() -> None:
    assert match_onnx("HardSigmoid", {}) == (Activation.named("hardsigmoid", 0.2, 0.5), None)
    assert match_onnx("LeakyRelu", {"alpha": 0.5}) == (Activation.named("leakyrelu", 0.5), None)
    assert match_onnx("Clip", {}) == (Activation.named("clip", -np.inf, np.inf), None)
    assert match_onnx("Clip", {"min": 0.0, "max": 6.0}) == (Activation.named("clip", 0.0, 6.0), None)  # opset 6
    assert match_onnx("Clip", {}, {2: 6.0}) == (Activation.named("clip", -np.inf, 6.0), None)
    assert match_onnx("Gelu", {})[0] == Activation.named("gelu")
    assert match_onnx("Gelu", {"approximate": "tanh"})[0] == Activation.named("gelu_tanh")


def test_nodes_the_table_does_not_compute_say_why() -> None:
    assert match_onnx("Softmax", {}) == (None, "Softmax is not an activation")
    assert match_onnx("Clip", {}, {1: None}) == (None, "Clip min is computed at run time (the kernels take constants)")
    act, why = match_onnx("Gelu", {"approximate": "cubic"})
    assert act is None and why == "Gelu with approximate='cubic' is not an activation the kernels compute"


def test_an_unknown_code_or_name_is_refused() -> None:
    with pytest.raises(InputError, match="activation code 99 is not one of"):
        Activation(99)
    with pytest.raises(InputError, match="'swish' is not an activation; use one of none, relu"):
        Activation.named("swish")


def test_the_kernels_with_a_relu_flag_take_none_and_relu_only() -> None:
    assert [k.name for k in KINDS if Activation(k.id).relu_flag() is not None] == ["none", "relu"]
    assert (Activation().relu_flag(), Activation.named("relu").relu_flag()) == (0, 1)


def test_checked_in_header_is_the_rendered_table() -> None:
    assert GENERATED_HEADERS[activations.HEADER] == render_header()
    assert (SOURCE_DIR / activations.HEADER).read_text() == render_header(), "run `make ptx` and commit the result"


def test_header_has_one_case_per_row() -> None:
    text = render_header()
    for k in KINDS:
        assert f"{k.enum} = {k.id}," in text
        assert f"dt_act_{k.name}(float v, float p0, float p1) {{ return {k.device}; }}" in text
    # The rows up to INLINE_MAX_ID twice (dt_activate, dt_activate_n), the rest once (dt_activate_rest).
    hot = sum(1 for k in KINDS if 0 < k.id <= INLINE_MAX_ID)
    rest = sum(1 for k in KINDS if k.id > INLINE_MAX_ID)
    assert text.count("case DT_ACT_") == 2 * hot + rest
    assert "__noinline__ float dt_activate_rest" in text


def test_the_lowering_recognises_every_op_of_the_table() -> None:
    assert set(lower_mobile.ACT_OPS) == {k.onnx.op for k in KINDS if k.onnx}
    assert all(op in lower_mobile.RULES for op in lower_mobile.ACT_OPS)
    assert BY_NAME["silu"].onnx is None
