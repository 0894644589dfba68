"""Track B launch plans (compiler/launch_plan.py reads them): what a compiled IREE CUDA module launches, or why not.

The modules are compiled here by the real iree-compile for sm_89 (no GPU needed to compile); the GPU
tests (tests/gpu/test_replay_gpu.py) run the plans against the IREE runtime, bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import iree_build as track_b
from dualtrack.compiler import launch_extract as reader
from dualtrack.compiler.launch_extract import extract
from dualtrack.contract import launch_plan
from dualtrack.contract.bundle import Bundle
from dualtrack.contract.launch_plan import Dispatch, LaunchPlan, NotReplayable
from dualtrack.contract.plan import parameter_key

RNG = np.random.default_rng(7)


def _conv_model() -> onnx.ModelProto:
    """Conv 3x3 (+bias) -> Relu -> Conv 1x1 -> Add: a weight IREE keeps as a parameter, a padded input."""
    w = numpy_helper.from_array(RNG.standard_normal((16, 8, 3, 3)).astype(np.float16), "enc:w")
    b = numpy_helper.from_array(RNG.standard_normal(16).astype(np.float16), "b")
    w2 = numpy_helper.from_array(RNG.standard_normal((4, 16, 1, 1)).astype(np.float16), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "enc:w", "b"], ["y"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["z"]),
        helper.make_node("Add", ["z", "z"], ["out"]),
    ]
    g = helper.make_graph(
        nodes,
        "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 8, 32, 32])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, ["N", 4, 32, 32])],
        [w, b, w2],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _pre_model(width: int = 128) -> onnx.ModelProto:
    """The reference's pre-processing: uint8 NHWC rows minus a per-row mean, times 1/std, to fp16.
    The row constants are concatenations of small Constant chunks (small enough for the importer to
    keep them inline, as the reference's are): IREE evaluates them at compile time, hoists the result
    and loads it at initialisation (a ``util.buffer.constant`` to carry)."""
    row = width * 3
    mean = np.tile(np.array([123.7, 116.3, 103.5], np.float32), width)
    inv_std = np.tile(1 / np.array([58.4, 57.1, 57.4], np.float32), width)
    nodes: list[onnx.NodeProto] = []
    for name, values in (("mean", mean), ("inv_std", inv_std)):
        chunks = [values[i : i + 96] for i in range(0, row, 96)]
        for i, chunk in enumerate(chunks):
            nodes.append(helper.make_node("Constant", [], [f"{name}{i}"], value=numpy_helper.from_array(chunk)))
        nodes.append(helper.make_node("Concat", [f"{name}{i}" for i in range(len(chunks))], [name], axis=0))
    rows = numpy_helper.from_array(np.array([-1, row], np.int64))
    back = numpy_helper.from_array(np.array([-1, width, width, 3], np.int64))
    nodes += [
        helper.make_node("Constant", [], ["rows_shape"], value=rows),
        helper.make_node("Constant", [], ["back_shape"], value=back),
        helper.make_node("Reshape", ["image", "rows_shape"], ["r"]),
        helper.make_node("Cast", ["r"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["f", "mean"], ["c"]),
        helper.make_node("Mul", ["c", "inv_std"], ["n"]),
        helper.make_node("Cast", ["n"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Reshape", ["h", "back_shape"], ["out"]),
    ]
    g = helper.make_graph(
        nodes,
        "main",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", width, width, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, ["N", width, width, 3])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _compile(model: onnx.ModelProto, tmp: Path, batch: int = 2) -> tuple[str, bytes, track_b.CompileResult]:
    job = track_b.CompileJob("seg", model, batch, track_b.cuda_target("sm_89"), ("--iree-opt-level=O3",))
    cache = track_b.ModuleCache(tmp / "cache")
    temps = tmp / "temps"
    result = track_b.run_job(job, cache, track_b.compiler_version(), save_temps=temps)
    hal = next((temps / f"seg-b{batch}-cuda-sm_89" / "phases").glob("*.hal.mlir")).read_text()
    return hal, result.vmfb, result


@pytest.fixture(scope="module")
def conv_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes, track_b.CompileResult]:
    return _compile(_conv_model(), tmp_path_factory.mktemp("conv"))


@pytest.fixture(scope="module")
def pre_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes, track_b.CompileResult]:
    return _compile(_pre_model(), tmp_path_factory.mktemp("pre"))


def test_plan_matches_the_compiled_module(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, _vmfb, result = conv_module
    assert result.replay is not None and result.replay.plan is not None, result.replay
    plan, ptx = result.replay.plan, result.replay.ptx
    # Every dispatch IREE records is in the plan, in order, with the executable's block size.
    recorded = re.findall(r"hal\.command_buffer\.dispatch<", hal)
    assert len(plan.dispatches) == len(recorded) >= 2
    assert plan.inputs[0].shape == (2, 8, 32, 32) and plan.inputs[0].dtype == "float16"
    assert plan.results[0].shape == (2, 4, 32, 32) and plan.results[0].dtype == "float16"
    assert plan.results[0].source.length == 2 * 4 * 32 * 32 * 2
    # The 3x3 weight is a parameter, by the key the importer gives it ("enc:w" -> "enc_w").
    assert [p.key for p in plan.params] == [parameter_key("enc:w")]
    assert plan.params[0].length == 16 * 8 * 3 * 3 * 2
    text = b"".join(ptx).decode()
    for d in plan.dispatches:
        m = re.search(r"\.entry " + re.escape(d.kernel) + r"\(([^)]*)\)", text)
        assert m, d.kernel
        params = m.group(1).count(".param")
        assert params == len(d.bindings) + len(d.constants)  # IREE's ABI: pointers, then 32-bit constants
        assert re.search(rf"\.maxntid {d.block[0]}, {d.block[1]}, {d.block[2]}", text[m.start() :])
        assert all(g >= 1 for g in d.grid)
    launch_plan.check(plan)
    # The JSON form is the plan.
    assert LaunchPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_cached_plan_is_the_compiled_one(conv_module: tuple[str, bytes, track_b.CompileResult], tmp_path: Path) -> None:
    _hal, vmfb, result = conv_module
    cache = track_b.ModuleCache(tmp_path)
    cache.put(result.key, vmfb, result.replay)
    again = cache.get_replay(result.key)
    assert again == result.replay


def test_hoisted_constants_are_carried(pre_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, vmfb, result = pre_module
    assert result.replay is not None and result.replay.plan is not None, result.replay
    plan = result.replay.plan
    assert "hal.device.queue.read" in hal or "hal.allocator.import" in hal, "IREE hoisted nothing: the test needs it"
    assert plan.constants, "the hoisted constant is not in the plan"
    # The bytes the plan carries are the ones IREE's module embeds (its rodata).
    assert all(len(c) > 0 and vmfb.find(c) >= 0 for c in plan.constants)
    values = np.frombuffer(b"".join(plan.constants), np.float32)
    assert np.isclose(values, np.float32(123.7)).any()  # the mean row is among them
    assert any(isinstance(c, Dispatch) and any(b.kind == "const" for b in c.bindings) for c in plan.commands)


def _plan_of(hal: str, vmfb: bytes) -> LaunchPlan:
    return extract(hal, vmfb)[0]


def _entry_body(hal: str) -> tuple[int, int]:
    start = hal.index("$async(%arg0")
    return start, hal.index("\n  }\n", start)


def test_control_flow_in_the_entry_is_refused(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, vmfb, _ = conv_module
    start, end = _entry_body(hal)
    body = hal[start:end]
    bad = hal[:start] + body.replace("util.return", "cf.br ^bb1\n  ^bb1:\n    util.return", 1) + hal[end:]
    with pytest.raises(NotReplayable, match=r"entry function holds (cf\.br|\^block)"):
        _plan_of(bad, vmfb)


def test_run_time_grid_is_refused(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, vmfb, _ = conv_module
    m = re.search(r"workgroups\(\[(%[-\w$.]+),", hal)
    assert m
    bad = hal.replace(m.group(0), "workgroups([%not_a_constant,", 1)
    with pytest.raises(NotReplayable, match="run-time value %not_a_constant"):
        _plan_of(bad, vmfb)


def test_unknown_kernel_is_refused(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, vmfb, _ = conv_module
    m = re.search(r"function\(@[^:]+::@[^:]+::@([^)]+)\)", hal)
    assert m
    bad = hal.replace(m.group(1) + ")", m.group(1) + "_renamed)", 1)
    with pytest.raises(NotReplayable, match="is not in the module's CUDA executables"):
        _plan_of(bad, vmfb)


def test_initialiser_with_unknown_work_is_refused(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    hal, vmfb, _ = conv_module
    # A parameter global loaded by an op this reader does not know.
    bad = hal.replace("io_parameters.load", "io_parameters.gather", 1)
    with pytest.raises(NotReplayable, match=r"initialiser holds io_parameters\.gather"):
        _plan_of(bad, vmfb)


def test_binding_past_its_buffer_is_refused(conv_module: tuple[str, bytes, track_b.CompileResult]) -> None:
    _hal, _vmfb, result = conv_module
    assert result.replay is not None and result.replay.plan is not None
    d = result.replay.plan.dispatches[0]
    bad_plan = LaunchPlan(
        **{
            **result.replay.plan.__dict__,
            "commands": (
                Dispatch(d.module, d.kernel, d.grid, d.block, d.shared_bytes,
                         (launch_plan.Ref("slab", 0, 0, 1 << 40), *d.bindings[1:]), d.constants),
            ),
        }
    )  # fmt: skip
    with pytest.raises(NotReplayable, match="runs past"):
        launch_plan.check(bad_plan)


@pytest.mark.parametrize(
    ("entry", "expect"),
    [
        ('dense<"0x0000803F00000040"> : tensor<2xf32>', np.array([1.0, 2.0], np.float32).tobytes()),
        ('dense<"0x0000803F"> : tensor<3xf32>', np.array([1.0] * 3, np.float32).tobytes()),  # a hex splat
        ("dense<2.500000e+00> : tensor<2xf16>", np.array([2.5, 2.5], np.float16).tobytes()),
        ("dense<0> : vector<5xi8>", bytes(5)),  # alignment padding
        ("dense<[1, -2, 3]> : tensor<3xi32>", np.array([1, -2, 3], np.int32).tobytes()),
    ],
)
def test_constant_forms(entry: str, expect: bytes) -> None:
    assert reader._dense_bytes(entry) == expect


def test_composite_constant() -> None:
    aliases = {
        "#c": '#util.composite<12xi8, [\n    dense<"0x0000803F00000040"> : tensor<2xf32>,\n'
        "    dense<7> : tensor<1xi32>,\n]>"
    }
    data = reader._composite_bytes("#c", aliases)
    assert data == np.array([1.0, 2.0], np.float32).tobytes() + np.array([7], np.int32).tobytes()
    with pytest.raises(NotReplayable, match="decoded to"):
        reader._composite_bytes("#d", {"#d": aliases["#c"].replace("12xi8", "16xi8")})
    with pytest.raises(NotReplayable, match="not understood"):
        reader._dense_bytes("dense_resource<blob> : tensor<4xf32>")


def test_bundle_carries_launch_plans(tiny_bundle: Path) -> None:
    """Every CUDA module of a built bundle has its plan (or the reason it has none), PTX and cubins
    for the target's arch, all hashed in the manifest."""
    b = Bundle.open(tiny_bundle)
    replay = b.manifest.artifacts.iree_replay
    plans = []
    for seg in (s for s in b.plan.segments if s.track == "B"):
        cuda = {t: per for t, per in b.manifest.artifacts.iree[seg.name].items() if t.startswith("cuda-")}
        assert cuda and set(replay[seg.name]) == set(cuda)
        for target, per_batch in replay[seg.name].items():
            assert set(per_batch) == {str(n) for n in b.plan.batch_sizes}
            for batch, e in per_batch.items():
                assert "plan" in e, e.get("refused")
                plan = LaunchPlan.from_json(json.loads((b.root / e["plan"]).read_text()))
                plans.append(plan)
                assert [r.shape for r in plan.results] == [o.at_batch(int(batch)) for o in seg.outputs] or all(
                    int(np.prod(r.shape)) == int(np.prod(o.at_batch(int(batch))))
                    for r, o in zip(plan.results, seg.outputs, strict=True)
                )
                for rel in (e["plan"], *e["ptx"], *(p for per in e["cubin"].values() for p in per)):
                    assert rel in b.manifest.files
                arches = {"cuda-sm_89": {"sm_90a"}, "cuda-sm_80": {"sm_80"}}[target]
                assert set(e["cubin"]) == arches
    # IREE transforms the decoder's ConvTranspose weights once at initialisation: carried as init
    # commands into globals, run once when the module loads.
    assert any(p.init and p.globals for p in plans)
    for p in plans:
        launch_plan.check(p)
