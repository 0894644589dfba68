"""The 1x1 convolution on the sm_90a wgmma kernel (its ``_1x1`` entries) on an H100/H200, against
onnxruntime: a Conv 1x1 with bias, a residual Add and every activation of the table, on shapes no zoo
model has (pixel counts that are no multiple of a tile, C and K of 48, 80, 200, 20, a K tail that is
no multiple of 8), reading an input slice and writing an output slice of wider buffers (a Concat's
channel offset: the channels around it must keep their SENTINEL), split-K where the pixels are few.

Launches are prepared as the engine prepares them: the general conv's spec asks the one chooser
(which must pick a ``_1x1`` entry) and hands the launch to the wgmma spec, tensor maps encoded by the
driver; one test forces every ``_1x1`` configuration. The kernel comes from the checked-in PTX
(handwritten_ptx/ptx/compute_90a/conv3x3_wgmma.ptx, driver JIT): run `make ptx` first.

Tolerance: onnxruntime runs in float32 on the same fp16-rounded inputs and weights; the kernel sums
in fp32 (another order) and rounds once to fp16, so |got - ort| <= 2e-3 * max(1, |ort|) (one fp16
rounding, 2^-11 relative, plus the device's expf/erff/tanhf ulps). Skipped where the GPU is not
compute capability 9.0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from activation_cases import ROWS, act_nodes, case_activation, opset
from gpu_ptx import SENTINEL, Slices, checked_in_entries
from onnx import TensorProto, helper, numpy_helper

from dualtrack import kernels
from dualtrack.contract.activations import Activation
from dualtrack.contract.plan import KernelCall
from dualtrack.kernels.tensormap import TiledMap
from dualtrack.runtime import tma
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.tensors import GpuTensor

WG = kernels.CONV3X3_WGMMA
GENERAL = kernels.KERNELS["conv"]
PW = tuple(c for c in WG.configs if c.pointwise)
ATOL = 2e-3  # relative to max(1, |ort|): one fp16 rounding and the device's transcendental ulps
OFF = 8  # channel offset of every slice: 16 bytes, so TMA's and the epilogue's alignment hold


@pytest.fixture(scope="module", autouse=True)
def sm90(engine: Engine) -> None:
    cc = engine.backend.device.cc
    if cc != (9, 0):
        pytest.skip(f"the wgmma kernel is sm_90a only; this GPU is compute capability {cc[0]}.{cc[1]}")


@pytest.fixture(scope="module")
def entries(engine: Engine) -> Iterator[dict[str, Any]]:
    """Every entry of the wgmma kernel, allowed its dynamic shared memory."""
    with checked_in_entries(engine, (WG.stem,)) as found:
        for c in WG.configs:
            found[c.entry].set_max_dynamic_shared(c.smem_bytes)
        yield found


class _Slices(Slices):
    """gpu_ptx.Slices with an output stride rounded up to 8 channels: the wgmma epilogue's 16-byte
    stores need ldy % 8 == 0 (a K of 20 in a 36-wide buffer would go to the mma.sync kernel)."""

    def output(self, shape: tuple[int, ...]) -> tuple[int, int]:
        ld = -(-(shape[3] + 2 * self.off) // 8) * 8
        wide = np.full((*shape[:3], ld), SENTINEL, self.dtype)
        wide[..., self.off : self.off + shape[3]] = np.nan
        self.y, self.y_c = self.be.from_host(wide), shape[3]
        return self.y.ptr + self.off * np.dtype(self.dtype).itemsize, ld


@dataclass
class _Ctx:
    """The runtime's side of a launch's preparation (kernels.LaunchContext): maps encoded by the
    driver, a zeroed split-K workspace kept alive by the test."""

    engine: Engine
    keep: list = field(default_factory=list)

    @property
    def wgmma_off(self) -> None:
        return None

    @property
    def device(self) -> kernels.DeviceInfo:
        return self.engine.backend.device.info()

    def tuned_entry(self, call: KernelCall, batch: int) -> None:
        return None

    def tensor_map(self, m: TiledMap) -> Any:
        return tma.encode(m)

    def workspace(self, nbytes: int) -> int:
        buf = self.engine.backend.from_host(np.zeros(max(nbytes // 4, 1), np.float32))
        self.keep.append(buf)
        return buf.ptr


def ort_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, r: np.ndarray | None, act: Activation) -> np.ndarray:
    """onnxruntime's Conv (``w``: KRSC, 1x1 or 3x3 with padding 1) (+ Add of ``r``) + the
    activation's nodes, float32, NHWC in and out."""
    nodes, inits = act_nodes(act, "s", "y") if act.code else ([helper.make_node("Identity", ["s"], ["y"])], [])
    conv_out = "t" if r is not None else "s"
    pad = w.shape[1] // 2
    graph_nodes = [helper.make_node("Conv", ["x", "w", "b"], [conv_out], pads=[pad] * 4)]
    feeds = {"x": x.astype(np.float32).transpose(0, 3, 1, 2)}
    if r is not None:
        graph_nodes.append(helper.make_node("Add", ["t", "r"], ["s"]))
        feeds["r"] = r.astype(np.float32).transpose(0, 3, 1, 2)
    weights = [
        numpy_helper.from_array(w.astype(np.float32).transpose(0, 3, 1, 2), "w"),
        numpy_helper.from_array(b, "b"),
    ]
    graph = helper.make_graph(
        [*graph_nodes, *nodes],
        "pointwise",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in feeds],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [*weights, *inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(act.kind))])
    model.ir_version = 9  # what onnxruntime 1.20+ loads
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0].transpose(0, 2, 3, 1)


def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    bound = ATOL * np.maximum(1.0, np.abs(want64))
    bad = ~((np.abs(got64 - want64) <= bound) | (np.isnan(got64) & np.isnan(want64)) | (got64 == want64))
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ, e.g. got {got64[bad][:4]} want {want64[bad][:4]}"


def run_conv(
    engine: Engine,
    entries: dict[str, Any],
    shape: tuple[int, int, int, int, int],
    act: Activation,
    *,
    residual: bool = False,
    entry: str | None = None,
    repeat: int = 1,
    window: int = 1,
) -> str:
    """One 1x1 conv (``window`` 3: a 3x3 one, padding 1) on fresh random data in channel slices (x,
    residual, y at channel OFF of wider buffers), prepared by the general conv's spec (``entry``
    None: the chooser's pick, which must be a wgmma entry of that window) or forced onto ``entry``;
    compared with onnxruntime. Returns the entry run."""
    n, h, w, c, k = shape
    s = _Slices(engine, "float16", OFF)
    x = s.rng.standard_normal((n, h, w, c)).astype(np.float16)
    wt = (s.rng.standard_normal((k, window, window, c)) / np.sqrt(window * window * c)).astype(np.float16)
    b = s.rng.standard_normal(k).astype(np.float32)
    r = s.rng.standard_normal((n, h, w, k)).astype(np.float16) if residual else None
    x_ptr, ldx = s.input(x)
    inputs = [GpuTensor(x_ptr, x.shape, np.dtype("float16"), ld=ldx)]
    if r is not None:
        r_ptr, ldr = s.input(r)
        inputs.append(GpuTensor(r_ptr, r.shape, np.dtype("float16"), ld=ldr))
    y_ptr, ldy = s.output((n, h, w, k))
    y = GpuTensor(y_ptr, (n, h, w, k), np.dtype("float16"), ld=ldy)
    weights = [
        GpuTensor(s.weights(wt), wt.shape, np.dtype("float16")),
        GpuTensor(s.weights(b), (k,), np.dtype("float32")),
    ]
    ctx = _Ctx(engine)
    if entry is None:
        p = window // 2
        geom = kernels.ConvGeometry(window, window, pad_top=p, pad_left=p, pad_bottom=p, pad_right=p)
        call = KernelCall(
            "conv", ("x", "r") if residual else ("x",), ("y",), ("w", "b"),
            (*geom.attrs(), *act.attrs(), ("residual", int(residual))), ("pw",),
        )  # fmt: skip
        prep = GENERAL.prepare_inputs(call, inputs, y, weights, ctx)
        assert prep.choice is not None and prep.choice.impl == "wgmma", prep.choice
    else:
        cfg = WG.config(entry)
        splits = WG.splits(cfg, n, h, w, c, k)
        choice = kernels.ConvChoice("wgmma", entry, "forced by the test", splits)
        prep = WG.prepare_entry(choice, inputs[0], y, weights, act, ctx, res=inputs[1] if residual else None)
    assert WG.config(prep.entry).pointwise is (window == 1), prep.entry
    be = engine.backend
    first = None
    for _ in range(repeat):  # split-K's tile counters must be back at zero for the next launch
        entries[prep.entry].launch(prep.config.grid, prep.config.block, prep.config.shared_bytes, be.stream, prep.args)
        got = s.result()
        assert first is None or np.array_equal(got, first, equal_nan=True), f"{prep.entry}: a repeat differs"
        first = got
    assert first is not None
    want = ort_conv(x, wt, b, r, act)
    check(f"{prep.entry} {shape} {act.kind.name}{' + residual' if residual else ''}", first, want)
    return prep.entry


SHAPES = [
    # n, h, w, c, k
    (2, 7, 9, 48, 80),  # 126 pixels: a partial tile; C = 48: the second 32-channel k-block half zeros; K tail in a tile
    (1, 13, 11, 200, 40),  # C = 200: 7 k-blocks of 32; K = 40 of a 64-wide tile
    (3, 5, 17, 80, 20),  # K = 20 <= 32: the narrow tile, a 4-channel chunk at the K tail
    (2, 33, 31, 128, 256),  # 2046 pixels, 64-channel k-blocks, two 128-channel tiles
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}_{s[3]}to{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("kind", ROWS, ids=[k.name for k in ROWS])
def test_every_activation_on_the_1x1_entries(engine: Engine, entries: dict, shape: tuple, kind: Any) -> None:
    run_conv(engine, entries, shape, case_activation(kind))


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "hardswish"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=["126px", "c200", "k20"])
def test_the_residual_is_added_before_the_activation(engine: Engine, entries: dict, shape: tuple, act: str) -> None:
    """ConvNeXt's second MLP conv (+ layer-scaled weights) + residual: none and ReLU take the fp16
    staging epilogue (per-pair residual reads), the others the fp32 one; both round once."""
    run_conv(engine, entries, shape, Activation.named(act), residual=True)


def test_few_pixels_split_the_reduction(engine: Engine, entries: dict) -> None:
    """100 pixels of 1024 channels: one tile, so split-K; launched twice on one workspace."""
    act = Activation.named("gelu")
    assert WG.splits(WG.choose_pointwise(100, 1024, 72), 1, 10, 10, 1024, 72) > 1
    run_conv(engine, entries, (1, 10, 10, 1024, 72), act, residual=True, repeat=2)


@pytest.mark.parametrize("cfg", PW, ids=[c.entry for c in PW])
def test_every_1x1_configuration(engine: Engine, entries: dict, cfg: kernels.WgmmaConfig) -> None:
    """Each compiled 1x1 entry, whatever the chooser would pick: C a multiple of its k-block."""
    c = 192 if cfg.bk == 64 else 96
    for act in ("relu", "silu"):
        run_conv(engine, entries, (1, 9, 37, c, 72), Activation.named(act), residual=True, entry=cfg.entry)


@pytest.mark.parametrize("kind", ROWS, ids=[k.name for k in ROWS])
def test_3x3_layers_take_every_activation_too(engine: Engine, entries: dict, kind: Any) -> None:
    """The 3x3 entries share the epilogue: the general conv's 3x3 stride-1 layers with any activation
    (and a residual) now run them; none and ReLU keep the measured fp16-staging path."""
    run_conv(engine, entries, (2, 9, 13, 64, 40), case_activation(kind), residual=True, window=3)
