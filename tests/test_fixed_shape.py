"""`batch: fixed`: a model whose dim 0 holds data (a reduction, softmax or concatenation over axis 0) is built at
its exported shape, run whole on the CPU and held to onnxruntime; the engine refuses any other shape with one line;
the default (`batch: images`) still refuses such a model and names `batch: fixed` as the fix.

Tolerance: the fp32 default (contract/checks.py DEFAULT_TOLERANCES), on fresh random inputs (seeded per test).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.build import build
from dualtrack.compiler.config import FIXED_BATCH, BuildConfig
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.contract.plan import Plan, TensorSpec
from dualtrack.errors import ConfigError, DualtrackError, InputError
from dualtrack.runtime.engine import Engine

SHAPE = (3, 4, 5)


def axis0_model() -> onnx.ModelProto:
    """x (3, 4, 5) -> ReduceMean over axis 0 (1, 4, 5), and Concat(x, Softmax over axis 0 of x * w) on axis 0
    (6, 4, 5): every output's dim 0 is data, none of them one row per image."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(SHAPE[1:]).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        helper.make_node("Mul", ["x", "w"], ["xw"]),
        helper.make_node("Softmax", ["xw"], ["soft"], axis=0),
        helper.make_node("Concat", ["x", "soft"], ["both"], axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "axis0",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [
            helper.make_tensor_value_info("mean", TensorProto.FLOAT, (1, *SHAPE[1:])),
            helper.make_tensor_value_info("both", TensorProto.FLOAT, (2 * SHAPE[0], *SHAPE[1:])),
        ],
        [w, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _config(tmp_path: Path, batch: str | None) -> Path:
    onnx.save(axis0_model(), str(tmp_path / "axis0.onnx"))
    cfg = tmp_path / "axis0.yaml"
    extra = f"batch: {batch}\n" if batch else ""
    cfg.write_text(f"model: axis0.onnx\ntargets: []\n{extra}verify: {{seed: 3}}\n")
    return cfg


@pytest.fixture(scope="module")
def fixed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fixed")
    result = build(_config(tmp, "fixed"), tmp / "bundle")
    assert result.verification is not None and result.verification["passed"]
    return result.bundle


def test_an_axis_0_model_builds_whole_and_matches_onnxruntime(fixed_bundle: Path) -> None:
    x = np.random.default_rng(11).standard_normal(SHAPE).astype(np.float32)
    ref = ort.InferenceSession(axis0_model().SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip(["mean", "both"], ref.run(None, {"x": x}), strict=True))
    with Engine.load(fixed_bundle, "cpu") as engine:
        got = engine.run(x)
    for name in ("mean", "both"):
        assert got[name].shape == want[name].shape
        check = compare(name, want[name], got[name], DEFAULT_TOLERANCES["fp32"])
        assert check.passed, check


def test_the_plan_records_exact_shapes_and_one_batch(fixed_bundle: Path) -> None:
    bundle = Bundle.open(fixed_bundle)
    plan = bundle.plan
    assert plan.fixed_shape and plan.batch_sizes == (SHAPE[0],)
    assert {o.name: o.at_batch(99) for o in plan.outputs} == {"mean": (1, 4, 5), "both": (6, 4, 5)}
    assert all(s.track == "B" for s in plan.segments)
    assert bundle.manifest.cpu_batch == SHAPE[0]
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("shape", [(1, 4, 5), (6, 4, 5), (3, 4), (4, 4, 5)])
def test_another_shape_is_refused_with_one_line(fixed_bundle: Path, shape: tuple[int, ...]) -> None:
    want = r"`batch: fixed` and takes exactly \(3, 4, 5\) float32"
    with Engine.load(fixed_bundle, "cpu") as engine, pytest.raises(InputError, match=want) as e:
        engine.run(np.zeros(shape, np.float32))
    assert "\n" not in str(e.value)


def test_the_image_mode_refuses_it_naming_batch_fixed(tmp_path: Path) -> None:
    with pytest.raises(DualtrackError, match=FIXED_BATCH) as e:
        build(_config(tmp_path, None), tmp_path / "bundle")
    assert "\n" not in e.value.message


def test_a_batched_spec_serialises_as_before() -> None:
    spec = TensorSpec("x", (1, 3, 8, 8), "float32")
    plan = Plan((spec,), (spec,), (), "fp32", (1, 2))
    assert "batched" not in plan.dumps()
    assert not plan.fixed_shape and spec.at_batch(4) == (4, 3, 8, 8)
    fixed = TensorSpec("x", (3, 4), "float32", batched=False)
    assert Plan((fixed,), (fixed,), (), "fp32", (3,)).to_json()["inputs"][0]["batched"] is False


@pytest.mark.parametrize(
    "extra, fix",
    [
        ({"batch_sizes": [1, 2]}, "drop `batch_sizes`"),
        ({"preprocess": {"layout": "NCHW"}}, "drop `preprocess`"),
        ({"partition": {"mode": "rules", "track_a": {"op_types": ["Conv"]}}}, "drop the partition's track_a rules"),
    ],
)
def test_fixed_refuses_what_only_images_take(extra: dict, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        BuildConfig.model_validate({"model": "m.onnx", "batch": "fixed", **extra})


def test_a_symbolic_input_is_refused_in_fixed_mode(tmp_path: Path) -> None:
    model = axis0_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "m.yaml").write_text("model: m.onnx\ntargets: []\nbatch: fixed\n")
    with pytest.raises(DualtrackError, match=r"static input shape, or use `batch: images`"):
        build(tmp_path / "m.yaml", tmp_path / "bundle")


def test_the_config_file_spelling(tmp_path: Path) -> None:
    from dualtrack.compiler.config import load_config

    (tmp_path / "c.yaml").write_text("model: m.onnx\nbatch: fixed\nbatch_sizes: [2]\n")
    with pytest.raises(ConfigError, match="drop `batch_sizes`"):
        load_config(tmp_path / "c.yaml")
