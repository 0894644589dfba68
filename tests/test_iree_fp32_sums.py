"""fp16 pools and sums reach IREE in fp32 (iree_forms.fp32_sums, Track B's stage 0 in iree_build).

IREE 3.13's ONNX import lowers AveragePool, GlobalAveragePool, the summing Reduce ops and CumSum with the
element type as the accumulator, on every target: an fp16 sum over a large window or map loses precision or
overflows (a ReduceMean over 256x256 of values near 1 came out wrong by a relative L2 of 1.0 on llvm-cpu).
Convolutions, matmuls, norms and softmax accumulate in fp32 already. The cases are tests/iree_fp16_ops.py's;
the same cases on the GPU are tests/gpu/test_iree_fp16_gpu.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from iree_fp16_ops import BY_NAME, CASES, ENTRY, IREE_ARCH, TOLERANCE, case_input, models, reference, rel_l2, weights_of
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler import iree_build
from dualtrack.compiler.iree_forms import F16_ACCUMULATED, fp32_sums

SUM_CASES = [c.name for c in CASES if BY_NAME[c.name].build(TensorProto.FLOAT16, {})[0][0].op_type in F16_ACCUMULATED]
# An accumulator's initial value in a dispatch: `linalg.fill ins(%cst : f16)` is an fp16 sum.
FILL = re.compile(r"linalg\.fill ins\(%\w+ : (\w+)\)")


def _mixed_model(elem: int) -> onnx.ModelProto:
    """x -> AveragePool -> Conv -> ReduceSum(axes as an input) -> y, at ``elem``."""
    dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    nodes = [
        helper.make_node("AveragePool", ["x"], ["p"], name="pool", kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Conv", ["p", "w"], ["c"], name="conv"),
        helper.make_node("ReduceSum", ["c", "axes"], ["y"], name="sum", keepdims=1),
    ]
    inits = [
        numpy_helper.from_array(np.ones((4, 8, 1, 1), dtype), "w"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        ENTRY,
        [helper.make_tensor_value_info("x", elem, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", elem, [1, 4, 1, 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_each_fp16_sum_is_computed_in_fp32_between_casts() -> None:
    model = _mixed_model(TensorProto.FLOAT16)
    before = model.SerializeToString()
    out = fp32_sums(model)
    assert model.SerializeToString() == before, "the segment model is shared by every job: never changed in place"
    ops = [(n.op_type, n.name) for n in out.graph.node]
    assert ops == [
        ("Cast", "pool__wide0"),
        ("AveragePool", "pool"),
        ("Cast", "pool__narrow"),
        ("Conv", "conv"),  # accumulates in fp32 in IREE already
        ("Cast", "sum__wide0"),
        ("ReduceSum", "sum"),
        ("Cast", "sum__narrow"),
    ]
    reduce_sum = out.graph.node[5]
    assert list(reduce_sum.input) == ["sum__wide0", "axes"], "the int64 axes are not cast"
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((1, 8, 16, 16)).astype(np.float16)
    from dualtrack.compiler.verify import ort_session

    want = ort_session(_mixed_model(TensorProto.FLOAT)).run(None, {"x": x.astype(np.float32)})[0]
    got = ort_session(out).run(None, {"x": x})[0]
    assert got.dtype == np.float16 and rel_l2(got, want) < TOLERANCE


def test_a_second_pass_and_an_fp32_graph_are_left_alone() -> None:
    once = fp32_sums(_mixed_model(TensorProto.FLOAT16))
    assert fp32_sums(once).SerializeToString() == once.SerializeToString()
    fp32 = _mixed_model(TensorProto.FLOAT)
    assert fp32_sums(fp32) is fp32


def test_every_track_b_job_gets_the_rewrite(tmp_path: Path) -> None:
    """run_job imports :func:`iree_build.iree_graph` of the segment: what it writes has the casts."""
    fp16, _ = models(BY_NAME["global_average_pool"])
    job = iree_build.CompileJob("gap", fp16, 1, iree_build.cpu_target("x86-64-v3"), ())
    cache = iree_build.ModuleCache(tmp_path / "cache")
    iree_build.run_job(job, cache, iree_build.compiler_version(), save_temps=tmp_path)
    written = onnx.load(str(tmp_path / "gap-b1-llvm-cpu" / "segment.onnx"))
    assert [n.op_type for n in written.graph.node] == ["Cast", "GlobalAveragePool", "Cast"]


def _cuda_fills(model: onnx.ModelProto, work: Path) -> set[str]:
    """The accumulator types of the dispatches IREE forms for ``model`` on CUDA (executable sources only:
    no code generation, no GPU)."""
    work.mkdir(parents=True, exist_ok=True)
    mlir = iree_build.import_onnx(model, work)
    flags = ("--compile-to=executable-sources",)
    src = iree_build.compile_module(mlir, iree_build.cuda_target(IREE_ARCH), flags, work / "sources.mlir")
    return set(FILL.findall(src.read_text()))


@pytest.mark.parametrize("name", SUM_CASES)
def test_the_cuda_dispatches_sum_in_fp32(name: str, tmp_path: Path) -> None:
    fp16, _ = models(BY_NAME[name])
    assert _cuda_fills(fp16, tmp_path) == {"f32"}


def test_without_the_rewrite_iree_sums_fp16_in_fp16(tmp_path: Path) -> None:
    """Why the rewrite exists: IREE 3.13 given the fp16 graph as it is forms an fp16 accumulator (if a
    newer IREE stops doing so, this fails and stage 0's fp32 sums can go)."""
    fp16, _ = models(BY_NAME["average_pool_k33"])
    with mock.patch.object(iree_build, "fp32_sums", lambda m: m):
        assert _cuda_fills(fp16, tmp_path) == {"f16"}


@pytest.mark.parametrize("name", SUM_CASES)
def test_each_sum_on_llvm_cpu_is_within_fp16_storage_error(name: str, tmp_path: Path) -> None:
    """Through Track B's own job and runtime module on the CPU, against onnxruntime fp32. Before the
    rewrite these missed (relative L2 on this machine: average pool 64x64 6.8e-3, 33x33 4.0e-3,
    GlobalAveragePool 2.4e-2, ReduceMean 1.0, ReduceSum 3.4e-3, ReduceL2 3.8e-2, CumSum 2.5e-3)."""
    from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index

    case = BY_NAME[name]
    fp16, _ = models(case)
    job = iree_build.CompileJob(name, fp16, 1, iree_build.cpu_target("x86-64-v3"), ())
    result = iree_build.run_job(job, iree_build.ModuleCache(tmp_path, enabled=False), iree_build.compiler_version())
    vmfb = tmp_path / f"{name}.vmfb"
    vmfb.write_bytes(result.vmfb)
    weights = weights_of(fp16)
    index = parameter_index(weights)  # the module reads the arrays through it: both outlive the call
    module = IreeModule(IreeDevice.create("cpu"), vmfb, index, ENTRY)
    x = case_input(case, np.random.default_rng())
    got = np.array(module(x)[0].to_host(), copy=True)  # to_host() maps the module's buffer: copied before it goes
    del module, index
    assert rel_l2(got, reference(case, x)) <= TOLERANCE
