"""CRD DepthToSpace (torch's pixel_shuffle) reaches IREE as its definition (iree_forms.depth_to_space_crd,
Track B's stage 0 in iree_build).

IREE 3.13 computes DepthToSpace with ``mode`` CRD wrong for every block size on llvm-cpu (measured here: a
blocksize-1 CRD, an identity, moved values by up to 3.5 on random data; blocksizes 2 and 3 wrong too; DCR
right), so a CPU build of a net with a PixelShuffle failed verification, and a CRD DepthToSpace on Track B
would have been refused on the GPU. Track A's depth_to_space kernel takes CRD itself: the rewrite is only in
what IREE is given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dualtrack.compiler import iree_build
from dualtrack.compiler.iree_forms import depth_to_space_crd
from dualtrack.compiler.verify import ort_session, run_ort

ENTRY = "d2s"


def d2s_model(blocksize: int, mode: str, c: int = 12, h: int = 5, w: int = 7) -> onnx.ModelProto:
    """x (N, c b², h, w) -> Relu -> DepthToSpace -> y, batch dynamic."""
    cin = c * blocksize * blocksize
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("DepthToSpace", ["r"], ["y"], name="d2s", blocksize=blocksize, mode=mode),
    ]
    graph = helper.make_graph(
        nodes,
        ENTRY,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", cin, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, h * blocksize, w * blocksize])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("blocksize", [1, 2, 3])
def test_the_definition_computes_crd_bit_for_bit(blocksize: int) -> None:
    model = d2s_model(blocksize, "CRD")
    before = model.SerializeToString()
    out = depth_to_space_crd(model)
    assert model.SerializeToString() == before, "the segment model is shared by every job: never changed in place"
    assert "DepthToSpace" not in {n.op_type for n in out.graph.node}
    x = np.random.default_rng().standard_normal((3, 12 * blocksize**2, 5, 7)).astype(np.float32)
    want = run_ort(ort_session(model), {"x": x})["y"]
    got = run_ort(ort_session(out), {"x": x})["y"]
    assert got.shape == want.shape and np.array_equal(got, want)


def test_dcr_and_a_second_pass_are_left_alone() -> None:
    dcr = d2s_model(2, "DCR")
    assert depth_to_space_crd(dcr) is dcr
    once = depth_to_space_crd(d2s_model(2, "CRD"))
    assert depth_to_space_crd(once) is once


@pytest.mark.parametrize(("blocksize", "mode"), [(1, "CRD"), (2, "CRD"), (2, "DCR")])
def test_llvm_cpu_computes_what_onnxruntime_does(blocksize: int, mode: str, tmp_path: Path) -> None:
    """Through Track B's own job (stage 0 included) and runtime module on the CPU."""
    from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index

    model = d2s_model(blocksize, mode)
    job = iree_build.CompileJob("d2s", model, 2, iree_build.cpu_target("x86-64-v3"), ())
    result = iree_build.run_job(job, iree_build.ModuleCache(tmp_path, enabled=False), iree_build.compiler_version())
    vmfb = tmp_path / "d2s.vmfb"
    vmfb.write_bytes(result.vmfb)
    index = parameter_index({})
    module = IreeModule(IreeDevice.create("cpu"), vmfb, index, ENTRY)
    x = np.random.default_rng().standard_normal((2, 12 * blocksize**2, 5, 7)).astype(np.float32)
    got = np.array(module(x)[0].to_host(), copy=True)
    del module, index
    assert np.array_equal(got, run_ort(ort_session(model), {"x": x})["y"])


def test_a_graph_with_nodes_of_no_inputs_is_rewritten_too() -> None:
    """A Constant node (no inputs) beside the DepthToSpace: the rewrite looks at DepthToSpace nodes only."""
    model = d2s_model(2, "CRD")
    model.graph.node.insert(0, helper.make_node("Constant", [], ["k"], value_float=1.0))
    assert "DepthToSpace" not in {n.op_type for n in depth_to_space_crd(model).graph.node}
