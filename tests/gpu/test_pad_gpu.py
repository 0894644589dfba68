"""The pad kernel (pad_nhwc: ONNX Pad over H and W, and Track A's channel copy) on a real GPU: every
mode, fp16 and fp32, odd shapes and pads (N=2, C=7, 19x23, pads (3, 0, 2, 5)), read from and written
into channel slices (dense, 16-byte aligned slices for the fp16 vector path, misaligned and odd
strides for its scalar fallback), against onnxruntime's Pad (exact: the kernel copies values bit
for bit; a constant is one rounding to the dtype, as onnxruntime's fp16 Pad holds it). Outputs are
poisoned first and the channels around the output slice must survive (gpu_ptx.Slices). Then a
channel copy from an offset (``c0``) against numpy. The partition side: tests/test_pad_lowering.py."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_ptx import Slices, checked_in_entries
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.compiler.verify import ort_session, run_ort
from dualtrack.kernels import PadMode
from dualtrack.runtime.engine import Engine

PAD = kernels.KERNELS["pad"]
OFFS = [0, 3, 4, 8]  # as test_mobile_gpu: dense, odd strides, misaligned fp16 pointers, aligned slices


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, ("pad_nhwc",)) as found:
        yield found


def onnx_pad(x_nhwc: np.ndarray, how: PadMode) -> np.ndarray:
    """onnxruntime's Pad of the NCHW tensor, back in NHWC: in float32 (every value a copy, the
    constant float32 as the kernel takes it) and rounded once to the dtype, as the kernel does."""
    elem = TensorProto.FLOAT
    n, h, w, c = x_nhwc.shape
    pads = numpy_helper.from_array(np.array([0, 0, how.pt, how.pl, 0, 0, how.pb, how.pr], np.int64), "pads")
    value = numpy_helper.from_array(np.array(how.value, np.float32), "value")
    node = helper.make_node("Pad", ["x", "pads", "value"], ["y"], mode=how.mode)
    g = helper.make_graph(
        [node], "pad", [helper.make_tensor_value_info("x", elem, [n, c, h, w])],
        [helper.make_tensor_value_info("y", elem, None)], [pads, value],
    )  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # the device's onnx may write an IR its onnxruntime refuses
    y = run_ort(ort_session(model), {"x": x_nhwc.transpose(0, 3, 1, 2).astype(np.float32)})["y"]
    return y.transpose(0, 2, 3, 1).astype(x_nhwc.dtype)


def launch(engine: Engine, mods, dtype: str, x: np.ndarray, how: PadMode, off: int) -> np.ndarray:
    s = Slices(engine, dtype, off)
    n, h, w, c = x.shape
    k = how.out_channels(c)
    ho, wo = h + how.pt + how.pb, w + how.pl + how.pr
    (px, ldx), (py, ldy) = s.input(x), s.output((n, ho, wo, k))
    px += how.c0 * np.dtype(dtype).itemsize
    args = PAD.args(x=px, y=py, N=n, H=h, W=w, C=k, Ho=ho, Wo=wo, ldx=ldx, ldy=ldy, how=how)
    cfg = PAD.launch(dtype, n, h, w, k, 0, Ho=ho, Wo=wo, ldy=ldy)
    mods[PAD.entry(dtype)].launch(cfg.grid, cfg.block, cfg.shared_bytes, s.be.stream, args)
    return s.result()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", OFFS)
@pytest.mark.parametrize(
    "how",
    [
        PadMode("reflect", 3, 0, 2, 5),
        PadMode("edge", 3, 0, 2, 5),
        PadMode("constant", 3, 0, 2, 5, value=0.0),
        PadMode("constant", 1, 2, 0, 3, value=-1.7),  # not exact in fp16: one rounding
        PadMode("reflect", 18, 22, 18, 22),  # the largest reflect pads of a 19x23 image
        PadMode("edge", 0, 0, 0, 0),  # a plain copy
    ],
)
@pytest.mark.parametrize("c", [7, 16])  # scalar everywhere; the fp16 vector path where off allows
def test_pad_kernel_computes_onnx_pad(engine, mods, dtype: str, off: int, how: PadMode, c: int) -> None:
    x = np.random.default_rng().standard_normal((2, 19, 23, c)).astype(dtype)
    got = launch(engine, mods, dtype, x, how, off)
    np.testing.assert_array_equal(got, onnx_pad(x, how))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("off", [0, 3])
@pytest.mark.parametrize(("c0", "k"), [(0, 8), (3, 5), (8, 16), (17, 7)])
def test_pad_kernel_copies_a_channel_slice(engine, mods, dtype: str, off: int, c0: int, k: int) -> None:
    x = np.random.default_rng().standard_normal((3, 5, 9, 24)).astype(dtype)
    got = launch(engine, mods, dtype, x, PadMode.copy(c0=c0, channels=k), off)
    np.testing.assert_array_equal(got, x[..., c0 : c0 + k])


@pytest.mark.parametrize("off", [0, 3])  # the vector path and the scalar one
def test_pad_kernel_copies_fp16_bits_nan_and_negative_zero_included(engine, mods, off: int) -> None:
    x = np.random.default_rng().standard_normal((1, 4, 4, 8)).astype("float16")
    x[0, 0, 0, :3] = [np.nan, -0.0, np.inf]
    x.view(np.uint16)[0, 0, 1, 0] = 0x7E01  # a NaN with a payload
    how = PadMode("reflect", 1, 1, 1, 1)
    got = launch(engine, mods, "float16", x, how, off)
    np.testing.assert_array_equal(got.view(np.uint16), PAD.reference(x, how).view(np.uint16))
