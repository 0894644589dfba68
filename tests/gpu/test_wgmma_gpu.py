"""The sm_90a conv3x3 (TMA + wgmma) on an H100/H200: every configuration against the numpy
reference (partial tiles, channel tails, channel-slice reads and writes, NaN-poisoned outputs, the
watchdog silent), and the engine with the kernel on, off (DUALTRACK_WGMMA=0), one launch at a time
(DUALTRACK_CUDA_GRAPHS=0) and on the CPU: the same results, and the wgmma kernel did run.

The kernel is loaded here from handwritten_ptx/ptx/compute_90a/conv3x3_wgmma.ptx (driver JIT); the
engine runs the bundle's cubin. Skipped where the GPU is not compute capability 9.0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dualtrack import kernels
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.kernel_build import SOURCE_DIR, ptx_path
from dualtrack.compiler.verify import compare, random_input, verify_engine
from dualtrack.contract.bundle import Bundle
from dualtrack.kernels.conv3x3_wgmma import input_map, weight_map
from dualtrack.kernels.problems import ConvProblem
from dualtrack.runtime import tma
from dualtrack.runtime.driver import Device, Kernel, Module
from dualtrack.runtime.engine import Engine

WG = kernels.CONV3X3_WGMMA
PTX = ptx_path(SOURCE_DIR, SOURCE_DIR / f"{WG.stem}.cu", "compute_90a")
KERNEL_TOL = Tolerance(rel_l2=2e-3, max_abs=1.0, mismatch=0)  # fp32 sums in another order, one fp16 rounding
MODEL_TOL = Tolerance(rel_l2=2e-2, max_abs=5e-2, mismatch=5e-3)  # fp16 through the whole U-Net
SENTINEL = -1234.5  # exactly representable in fp16
HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def sm90() -> None:
    cc = Device(0).cc
    if cc != (9, 0):
        pytest.skip(f"the wgmma kernel is sm_90a only; this GPU is compute capability {cc[0]}.{cc[1]}")


@pytest.fixture(scope="module")
def engine(tiny_wgmma_bundle: Path) -> Iterator[Engine]:
    with Engine.load(tiny_wgmma_bundle, "cuda") as e:
        yield e


@pytest.fixture(scope="module")
def wgmma(engine: Engine) -> Iterator[dict[str, Kernel]]:
    """Every configuration's entry, from the checked-in PTX, allowed its dynamic shared memory."""
    be = engine.backend
    be.ctx.make_current()
    mod = Module.load(be.ctx, PTX.read_bytes(), kind="ptx", origin=str(PTX), target="compute_90a")
    found = {c.entry: mod.function(c.entry) for c in WG.configs}
    for c in WG.configs:
        found[c.entry].set_max_dynamic_shared(c.smem_bytes)
    yield found
    be.ctx.make_current()
    be.stream.synchronize()
    mod.close()


def _run(
    engine: Engine,
    kern: Kernel,
    entry: str,
    n: int,
    h: int,
    w: int,
    c: int,
    k: int,
    *,
    x_off: int = 0,
    ldx: int | None = None,
    y_off: int = 0,
    ldy: int | None = None,
    bias: bool = True,
    relu: bool = True,
    residual: bool = False,
    r_off: int = 0,
    ldr: int | None = None,
    splits: int = 1,
    repeat: int = 1,
    dil: int = 1,
) -> None:
    """One launch on fresh random data: x is channels [x_off, x_off+c) of an (n,h,w,ldx) buffer, y
    channels [y_off, y_off+k) of an (n,h,w,ldy) buffer whose slice holds NaN before the launch and
    whose other channels hold SENTINEL and must keep it; the watchdog's status must stay 0.
    ``residual``: channels [r_off, r_off+k) of an (n,h,w,ldr) buffer are added before the ReLU
    (the general conv's reference: one rounding). ``splits``: split-K over that many CTAs a tile,
    launched ``repeat`` times on one workspace (its tile counters must come back to zero); ``dil``:
    the 3x3's dilation, with padding ``dil`` (the general conv's reference)."""
    be = engine.backend
    be.ctx.make_current()
    rng = np.random.default_rng()
    ldx = c + x_off if ldx is None else ldx
    ldy = k + y_off if ldy is None else ldy
    x = rng.standard_normal((n, h, w, c)).astype(np.float16)
    wt = (rng.standard_normal((k, 3, 3, c)) / np.sqrt(9 * c)).astype(np.float16)
    b = rng.standard_normal(k).astype(np.float32) if bias else None
    r = rng.standard_normal((n, h, w, k)).astype(np.float16) if residual else None
    if r is None and dil == 1:
        ref = WG.reference(x, wt, b, relu)
    else:
        act = kernels.Activation.named("relu" if relu else "none")
        geom = kernels.ConvGeometry(
            3, 3, dil_h=dil, dil_w=dil, pad_top=dil, pad_left=dil, pad_bottom=dil, pad_right=dil
        )
        ref = kernels.KERNELS["conv"].reference(x, wt, b, r, geom=geom, act=act)
    x_wide = rng.standard_normal((n, h, w, ldx)).astype(np.float16)  # other channels: noise, never read
    x_wide[..., x_off : x_off + c] = x
    y_wide = np.full((n, h, w, ldy), SENTINEL, np.float16)
    y_wide[..., y_off : y_off + k] = np.nan
    dx, dw, dy = be.from_host(x_wide), be.from_host(wt), be.from_host(y_wide)
    db = be.from_host(b) if b is not None else None
    status = be.from_host(np.zeros(8, np.int32))
    x_ptr, y_ptr = dx.ptr + 2 * x_off, dy.ptr + 2 * y_off
    problem = ConvProblem(n, h, w, c, k, ldx, ldy)
    assert WG.supported(problem, x=x_ptr, w=dw.ptr, y=y_ptr) is None
    cfg = WG.config(entry)
    tmx = tma.encode(input_map(cfg, x_ptr, n, h, w, c, ldx))
    tmw = tma.encode(weight_map(cfg, dw.ptr, k, c))
    bias = None if db is None else db.ptr
    extra = {}
    if r is not None:
        ldr = k + r_off if ldr is None else ldr
        r_wide = rng.standard_normal((n, h, w, ldr)).astype(np.float16)  # other channels: noise, never read
        r_wide[..., r_off : r_off + k] = r
        dr = be.from_host(r_wide)
        extra = {"res": dr.ptr + 2 * r_off, "ldr": ldr}
    if splits > 1:
        nbytes = WG.workspace_bytes(cfg, n, h, w, k, splits)
        ws = be.from_host(np.zeros(nbytes // 4, np.float32))
        extra["ws"] = ws.ptr
    args = WG.args(
        problem, tmx=tmx, tmw=tmw, bias=bias, y=y_ptr, relu=relu, entry=entry, status=status.ptr, dil=dil, **extra
    )
    launch = WG.launch("float16", n, h, w, c, k, entry=entry, splits=splits)
    got_wide = None
    for _ in range(repeat):
        kern.launch(launch.grid, launch.block, launch.shared_bytes, be.stream, args)
        got = be.to_host(dy)
        assert got_wide is None or np.array_equal(got, got_wide, equal_nan=True), f"{entry}: a repeat differs"
        got_wide = got
    if splits > 1:
        counters = be.to_host(ws)[-cfg.ctas(n, h, w, k) :].view(np.int32)
        assert not counters.any(), f"{entry}: split-K tile counters left at {counters.max()}"
    assert not be.to_host(status).any(), f"{entry}: the watchdog fired: {be.to_host(status).tolist()}"
    check = compare(entry, ref, got_wide[..., y_off : y_off + k], KERNEL_TOL)
    assert check.passed, check
    outside = np.delete(got_wide, np.s_[y_off : y_off + k], axis=3)
    assert (outside == SENTINEL).all(), f"{entry}: channels outside the output slice were written"


SHAPES = [
    # n, h, w, c, k, slices
    (2, 9, 13, 64, 40, {"x_off": 8, "ldx": 72, "y_off": 8, "ldy": 56}),  # partial tiles, K tail, both slices
    (1, 5, 70, 96, 64, {"x_off": 16, "ldx": 128}),  # C tail inside a tap (BK=64), W > TW for small tiles
    (3, 6, 5, 32, 200, {"ldy": 208}),  # W < TW, several channel tiles, C < BK
    (1, 17, 9, 128, 20, {"y_off": 24, "ldy": 48}),  # K < 32, not a multiple of 8: element stores at the tail
    (1, 3, 200, 32, 32, {}),  # W > BM: TW = BM, one row per tile
    (1, 1, 1, 64, 8, {"relu": False, "bias": False}),  # a 1x1 image: every tap but the centre is padding
    # the residual (ResNet's conv2 on the general conv's Hopper path): partial tiles, a K tail of
    # odd channel count (the last channel read alone), a residual slice with its own stride
    (2, 9, 13, 64, 40, {"residual": True, "r_off": 8, "ldr": 50}),
    (1, 17, 9, 128, 21, {"residual": True, "ldr": 22, "y_off": 24, "ldy": 48, "relu": False}),
    # few channels (the 16-channel k-blocks and tiles): partial tiles both ways; C = 8 in slices with a K tail
    (2, 19, 37, 16, 16, {}),
    (1, 9, 40, 8, 12, {"x_off": 8, "ldx": 24, "y_off": 8, "ldy": 24, "residual": True, "ldr": 14}),
]
GEOM_3X3 = kernels.ConvGeometry(3, 3, pad_top=1, pad_left=1, pad_bottom=1, pad_right=1)
# The 3x3 entries: the ``_1x1`` ones compute a 1x1 convolution (tests/gpu/test_wgmma1x1_gpu.py).
ENTRIES_3X3 = tuple(c.entry for c in WG.configs if not c.pointwise)
SPLIT_SHAPES = [
    # n, h, w, c, k, extra: split-K (k-blocks split unevenly, partial tiles, a residual), launched
    # three times on one workspace: the same bits every time, the counters back at zero
    (1, 16, 16, 512, 512, {"splits": 4}),
    (1, 9, 13, 200, 40, {"splits": 3, "residual": True, "ldr": 40}),
    (2, 7, 5, 96, 64, {"splits": 2, "x_off": 8, "ldx": 104, "relu": False}),
]


@pytest.mark.parametrize("entry", ENTRIES_3X3)
@pytest.mark.parametrize(("n", "h", "w", "c", "k", "extra"), SHAPES)
def test_every_configuration_computes_the_convolution(engine, wgmma, entry, n, h, w, c, k, extra) -> None:
    _run(engine, wgmma[entry], entry, n, h, w, c, k, **extra)


@pytest.mark.parametrize("entry", ENTRIES_3X3)
@pytest.mark.parametrize(("n", "h", "w", "c", "k", "extra"), SPLIT_SHAPES)
def test_every_configuration_splits_k(engine, wgmma, entry, n, h, w, c, k, extra) -> None:
    cfg = WG.config(entry)
    if (extra["splits"] - 1) * -(-cfg.k_blocks(c) // extra["splits"]) >= cfg.k_blocks(c):
        pytest.skip(f"{entry}: {cfg.k_blocks(c)} k-blocks cannot make {extra['splits']} non-empty splits")
    _run(engine, wgmma[entry], entry, n, h, w, c, k, repeat=3, **extra)


# Dilated 3x3s (DeepLab's ASPP, PAN's and FCN's output-stride-8/16 layers) on the per-tap entries: tap
# (r, s) reads at ((r-1)d, (s-1)d); TMA's zero fill is the padding d, also where d exceeds the image.
DILATED = [
    # n, h, w, c, k, extra
    (1, 21, 19, 64, 96, {"dil": 2}),
    (2, 12, 30, 128, 64, {"dil": 3, "residual": True, "ldr": 70, "x_off": 8, "ldx": 136, "relu": False}),
    (1, 5, 7, 64, 64, {"dil": 6}),  # every tap but the centre row / column is padding
    (1, 13, 11, 40, 24, {"dil": 3}),  # C tail inside a block, K < 32
    (1, 16, 16, 512, 200, {"dil": 2, "splits": 4, "y_off": 8, "ldy": 216}),
]
ENTRIES_PER_TAP = tuple(c.entry for c in WG.configs if not c.pointwise and not c.halo_tw)


@pytest.mark.parametrize("entry", ENTRIES_PER_TAP)
@pytest.mark.parametrize(("n", "h", "w", "c", "k", "extra"), DILATED)
def test_per_tap_configurations_take_dilation(engine, wgmma, entry, n, h, w, c, k, extra) -> None:
    _run(engine, wgmma[entry], entry, n, h, w, c, k, repeat=2, **extra)


@pytest.mark.parametrize(
    ("n", "hw", "c", "k", "d"), [(8, 32, 512, 512, 2), (1, 64, 256, 256, 4), (2, 40, 64, 48, 12), (1, 33, 40, 24, 3)]
)
def test_the_chosen_configuration_on_dilated_layers(engine, wgmma, n, hw, c, k, d) -> None:
    cfg = WG.choose(n, hw, hw, c, k, dilation=d)
    assert not cfg.halo_tw
    splits = WG.splits(cfg, n, hw, hw, c, k)
    _run(engine, wgmma[cfg.entry], cfg.entry, n, hw, hw, c, k, splits=splits, repeat=2, dil=d)


@pytest.mark.parametrize(
    ("n", "hw", "c", "k"),
    [
        *[(1, 64, 32, 32), (2, 32, 64, 128), (1, 16, 256, 512), (8, 16, 128, 64), (1, 32, 256, 256)],
        *[(2, 96, 16, 16), (1, 80, 16, 32), (2, 72, 32, 16), (1, 40, 64, 8)],  # few channels: the narrow tiles
    ],
)
def test_the_chosen_configuration_on_unet_like_shapes(engine, wgmma, n, hw, c, k) -> None:
    cfg = WG.choose(n, hw, hw, c, k)
    splits = WG.splits(cfg, n, hw, hw, c, k)
    _run(engine, wgmma[cfg.entry], cfg.entry, n, hw, hw, c, k, splits=splits, repeat=2)


class _Spy:
    """A Kernel that notes its name each time it is launched (directly or while a graph is captured)."""

    def __init__(self, kernel: Kernel, name: str, seen: list[str]) -> None:
        self.kernel, self.name, self.seen = kernel, name, seen

    def launch(self, *args: object) -> None:
        self.seen.append(self.name)
        self.kernel.launch(*args)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        self.kernel.set_max_dynamic_shared(nbytes)


def _spied(e: Engine) -> list[str]:
    seen: list[str] = []
    be = e.backend
    for name, kern in list(be.kernels.items()):
        be.kernels[name] = _Spy(kern, name, seen)  # type: ignore[assignment]
    return seen


def test_the_engine_runs_the_wgmma_kernel_where_it_can(tiny_wgmma_bundle: Path) -> None:
    """Verification against onnxruntime with Track A outputs poisoned, and every conv the bundle's
    plan gives the wgmma kernel launched it (the first conv, C=3, runs the small-C entry)."""
    with Engine.load(tiny_wgmma_bundle, "cuda") as e:
        be = e.backend
        assert be.stats.wgmma.startswith("on:") and be.wgmma_off is None
        seen = _spied(e)
        be.poison = True
        try:
            report = verify_engine(e, samples=2, interpret=False)
        finally:
            be.poison = False
        assert report.passed, "\n".join(report.lines())
        target = next(t for t in e.bundle.manifest.targets if t.arch == "sm_90a")
        planned = {(layer.node, layer.batch): c for layer, c in kernels.planned_conv_choices(e.bundle, target)}
        ran = {(node, n): c for node, per in be.stats.conv3x3.items() for n, c in per.items()}
        assert set(ran) == set(planned) and len({n for _, n in ran}) == len(e.batch_sizes)
        for key, c in planned.items():
            assert (ran[key]["impl"], ran[key]["entry"]) == (c.impl, c.entry), key
        wgmma_entries = {c.entry for c in planned.values() if c.impl == "wgmma"}
        assert wgmma_entries and wgmma_entries <= set(seen)
        assert {c.entry for c in planned.values() if c.impl != "wgmma"} == {"conv3x3_nhwc_f16_smallc"} <= set(seen)
        assert sum(c.impl == "wgmma" for c in planned.values()) == len(planned) - len(e.batch_sizes)  # all but C=3
        print(json.dumps(be.stats.conv3x3, indent=1))


def test_wgmma_on_off_one_by_one_and_cpu_agree(tiny_wgmma_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng()
    spec = Bundle.open(tiny_wgmma_bundle).plan.inputs[0]
    xs = {n: random_input(spec, n, rng) for n in (1, 3)}
    results: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for name, env in (
        ("on", {}),
        ("off", {"DUALTRACK_WGMMA": "0"}),
        ("on_no_graphs", {"DUALTRACK_CUDA_GRAPHS": "0"}),
    ):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with Engine.load(tiny_wgmma_bundle, "cuda") as e:
                results[name] = {n: e.run(x) for n, x in xs.items()}
                impls = {c["impl"] for per in e.backend.stats.conv3x3.values() for c in per.values()}
                assert ("wgmma" in impls) == (name != "off"), (name, impls)
                assert e.backend.use_graphs == (name != "on_no_graphs")
    with Engine.load(tiny_wgmma_bundle, "cpu") as cpu:
        results["cpu"] = {n: cpu.run(x) for n, x in xs.items()}
    for n in xs:
        # the same kernels on the same inputs: a graph replay and one-by-one launches agree
        np.testing.assert_allclose(results["on"][n]["probs"], results["on_no_graphs"][n]["probs"], rtol=0, atol=1e-6)
        for key in ("probs", "mask"):
            for other in ("off", "cpu"):
                check = compare(f"{key} N={n} on vs {other}", results[other][n][key], results["on"][n][key], MODEL_TOL)
                assert check.passed, check


def test_a_stuck_pipeline_is_an_error_not_a_hang() -> None:
    """A tensor map that delivers fewer bytes than the kernel waits for: with a status buffer the
    watchdog reports the wait and the launch finishes; with none (the engine's way) the kernel traps
    and the launch fails. In a subprocess: the trap leaves its CUDA context unusable."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "data" / "wgmma_watchdog.py"), str(PTX)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"][0] == 1 and out["status"][1] in (1, 2), out  # waiting on full[] (consumer) or empty[]
    assert out["trap"].startswith("CUDA_ERROR_"), out
    assert 1.5 < out["report_s"] < 30 and out["trap_s"] < 30, out
