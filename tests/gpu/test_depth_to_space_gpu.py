"""The depth_to_space kernel (depth_to_space_nhwc: ONNX DepthToSpace, DCR and CRD) on a real GPU:
block sizes 1-4, odd and vector-sized channel counts (K = 3, 5, 8, 24), non-square images, batch 1
and 3, fp16 and fp32, read from and written into channel slices (dense; misaligned fp16 pointers
and odd strides for the scalar path; 16-byte aligned slices of wider buffers for the vector path;
input and output slices that differ, so DCR falls back while CRD's gather still stores vectors),
against onnxruntime's DepthToSpace. Exact: the kernel copies bits (NaN payloads and -0 included).
Outputs are poisoned first and the channels around the output slice must survive (gpu_ptx.Slices).
The partition side and the numpy reference: tests/test_depth_to_space.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_entries
from onnx import TensorProto, helper

from dualtrack import kernels
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.kernels import DepthToSpace, LaunchConfig
from dualtrack.runtime.engine import Engine

pytestmark = pytest.mark.gpu

D2S = kernels.KERNELS["depth_to_space"]
OFFS = [0, 3, 8]  # dense; odd strides and misaligned fp16 pointers (scalar); aligned slices of wider buffers


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, ("depth_to_space_nhwc",)) as found:
        yield found


@functools.cache
def d2s_session(blocksize: int, mode: str):
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=blocksize, mode=mode)
    g = helper.make_graph(
        [node], "d2s", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 9  # the device's onnx may write an IR its onnxruntime refuses
    return ort_session(model)


def onnx_d2s(x_nhwc: np.ndarray, how: DepthToSpace) -> np.ndarray:
    """onnxruntime's DepthToSpace of the NCHW tensor, back in NHWC (float32 both ways: exact for fp16)."""
    y = run_ort(d2s_session(how.blocksize, how.mode), {"x": x_nhwc.transpose(0, 3, 1, 2).astype(np.float32)})["y"]
    return y.transpose(0, 2, 3, 1).astype(x_nhwc.dtype)


def launch(
    engine: Engine,
    mods,
    dtype: str,
    x: np.ndarray,
    how: DepthToSpace,
    off: int,
    off_y: int | None = None,
    grid: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """The kernel on ``x`` read from a slice at channel ``off`` and written into one at ``off_y``
    (default ``off``), with the registry's grid or ``grid``."""
    src, dst = Slices(engine, dtype, off), Slices(engine, dtype, off if off_y is None else off_y)
    n, h, w, c = x.shape
    s, k = how.blocksize, how.out_channels(c)
    (px, ldx), (py, ldy) = src.input(x), dst.output((n, h * s, w * s, k))
    kw = {"x": px, "y": py, "N": n, "H": h, "W": w, "C": c, "K": k, "ldx": ldx, "ldy": ldy, "how": how}
    cfg = D2S.call_launch(dtype, kw)
    if grid is not None:
        cfg = LaunchConfig(grid=grid, block=cfg.block, shared_bytes=cfg.shared_bytes)
    mods[D2S.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, dst.be.stream, D2S.args(**kw))
    return dst.result()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("bs", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [3, 5, 8, 24])
@pytest.mark.parametrize("shape", [(1, 5, 7), (3, 4, 3)])
def test_depth_to_space_kernel_computes_onnx_depth_to_space(
    engine, mods, dtype: str, off: int, mode: str, bs: int, k: int, shape: tuple[int, int, int]
) -> None:
    x = np.random.default_rng().standard_normal((*shape, k * bs * bs)).astype(dtype)
    how = DepthToSpace(bs, mode)
    np.testing.assert_array_equal(launch(engine, mods, dtype, x, how, off), onnx_d2s(x, how))


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize(("off_x", "off_y"), [(3, 8), (8, 3), (1, 0)])
def test_fp16_input_and_output_slices_of_different_alignment(engine, mods, mode: str, off_x: int, off_y: int) -> None:
    """A misaligned input with an aligned output: DCR's 16-byte load falls back to the scalar path,
    CRD still stores vectors; an aligned input with a misaligned output: both scalar."""
    x = np.random.default_rng().standard_normal((2, 3, 5, 16 * 4)).astype("float16")
    how = DepthToSpace(2, mode)
    np.testing.assert_array_equal(launch(engine, mods, "float16", x, how, off_x, off_y), onnx_d2s(x, how))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_a_small_grid_loops_over_every_work_item(engine, mods, dtype: str, mode: str) -> None:
    x = np.random.default_rng().standard_normal((3, 6, 5, 8 * 9)).astype(dtype)
    how = DepthToSpace(3, mode)
    got = launch(engine, mods, dtype, x, how, 0, grid=(2, 1, 1))
    np.testing.assert_array_equal(got, onnx_d2s(x, how))


@pytest.mark.parametrize("off", [0, 3])  # the vector path and the scalar one
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_copies_fp16_bits_nan_and_negative_zero_included(engine, mods, off: int, mode: str) -> None:
    x = np.random.default_rng().standard_normal((1, 3, 4, 8 * 4)).astype("float16")
    x[0, 0, 0, :3] = [np.nan, -0.0, np.inf]
    x.view(np.uint16)[0, 0, 1, 0] = 0x7E01  # a NaN with a payload
    x.view(np.uint16)[0, 2, 3, 9] = 0x7C01  # a signalling NaN
    how = DepthToSpace(2, mode)
    got = launch(engine, mods, "float16", x, how, off)
    np.testing.assert_array_equal(got.view(np.uint16), D2S.reference(x, how).view(np.uint16))
