"""Programmatic dependent launch on the CPU: the kernels' entry sequence in the checked-in PTX, the
launch configuration the driver gets, which of a segment's launches depend programmatically on
the one before, and the setting that turns it off. tests/gpu/test_wgmma_gpu.py runs the engine
with and without it (bit-identical results) and with poisoned outputs (a kernel that read its
input before its predecessor finished would pass NaN on)."""

from __future__ import annotations

import re

import pytest
from cuda.bindings import driver as cu

from dualtrack import kernels
from dualtrack.plan import KernelCall, Segment, TensorSpec
from dualtrack.ptx import SOURCE_DIR
from dualtrack.runtime import driver
from dualtrack.settings import Settings

PTX = SOURCE_DIR / "ptx"
# What an entry may do before its griddepcontrol.wait: nothing that touches memory another kernel
# writes, and no exit (a grid that completes without waiting would break the chain of waits).
_BEFORE_WAIT = re.compile(r"\b(ld\.global|st\.global|red\.|atom\.|cp\.async|ret;|exit;|trap;|bra)\b")


def _entries(text: str) -> dict[str, str]:
    """Each ``.entry`` of a PTX module: name -> body."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", text):
        start = text.index("{", m.end())
        out[m.group(1)] = text[start : text.find("\n}\n", start)]
    return out


@pytest.mark.parametrize("arch", ["compute_90a", "compute_120"])
def test_every_sm90_plus_entry_waits_for_its_predecessor_first(arch: str) -> None:
    files = sorted((PTX / arch).glob("*.ptx"))
    assert len(files) == len([s for s in kernels.SPECS if arch in s.ptx_arches])
    names = set()
    for f in files:
        for name, body in _entries(f.read_text()).items():
            names.add(name)
            wait = body.find("griddepcontrol.wait;")
            launch = body.find("griddepcontrol.launch_dependents;")
            assert 0 <= wait < launch, (f.name, name)
            assert not _BEFORE_WAIT.search(body[:wait]), (f.name, name, _BEFORE_WAIT.search(body[:wait]))
            assert body.count("griddepcontrol.wait;") == 1, (f.name, name)
    assert names >= set(kernels.KERNELS["conv3x3"].entries)


def test_sm80_ptx_has_no_grid_dependency_control() -> None:
    """griddepcontrol is sm_90+: the compute_80 PTX (sm_80, sm_86, sm_89 through the JIT) has none."""
    for f in (PTX / "compute_80").glob("*.ptx"):
        assert "griddepcontrol" not in f.read_text(), f.name


class _Stream:
    handle = cu.CUstream(0)


def test_launch_config_carries_the_programmatic_attribute() -> None:
    cfg = driver.launch_config((7, 3), 288, 205824, _Stream(), pdl=True)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (7, 3, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes) == (288, 1, 1, 205824)
    assert cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert driver.launch_config(5, 64, 0, _Stream(), pdl=False).numAttrs == 0


def test_kernel_launch_uses_launch_kernel_ex_only_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple]] = []

    def fake(name: str):
        def fn(*args):
            calls.append((name, args))
            return (cu.CUresult.CUDA_SUCCESS,)

        fn.__name__ = name
        return fn

    monkeypatch.setattr(cu, "cuLaunchKernel", fake("cuLaunchKernel"))
    monkeypatch.setattr(cu, "cuLaunchKernelEx", fake("cuLaunchKernelEx"))
    k = driver.Kernel.__new__(driver.Kernel)
    k.handle, k.name = cu.CUfunction(), "k"
    args = [(0x7F00, kernels.ctypes.c_void_p), (3, kernels.ctypes.c_int32)]
    k.launch(4, 128, 0, _Stream(), args)
    k.launch(4, 128, 0, _Stream(), args, pdl=True)
    assert [c[0] for c in calls] == ["cuLaunchKernel", "cuLaunchKernelEx"]
    cfg, fn, params, extra = calls[1][1]
    assert fn is k.handle and extra == 0 and params == driver.kernel_params(args)
    assert (cfg.gridDimX, cfg.blockDimX, cfg.numAttrs) == (4, 128, 1)


def _segment() -> Segment:
    t = TensorSpec("t", (1, 8, 8, 8), "float16", "NHWC")
    calls = (
        KernelCall("conv3x3", ("x",), ("a",), nodes=("c1",)),
        KernelCall("concat", ("a", "b"), ("cat",), nodes=("cat",)),
        KernelCall("maxpool2x2", ("cat",), ("p",), nodes=("p1",)),
        KernelCall("conv3x3", ("p",), ("y",), nodes=("c2",)),
    )
    return Segment(1, "A", ("c1", "cat", "p1", "c2"), (t,), (t,), "segments/seg1_A.onnx", calls=calls)


@pytest.mark.parametrize("pdl", [True, False])
def test_a_segment_launches_all_but_its_first_kernel_programmatically(pdl: bool) -> None:
    from dualtrack.runtime import gpu

    launched: list[tuple[str, bool]] = []

    class _Launch:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, stream, *, pdl: bool = False) -> None:
            launched.append((self.name, pdl))

    be = gpu.CudaBackend.__new__(gpu.CudaBackend)
    be.stream, be.pdl = _Stream(), pdl
    be._prepared = lambda c, env: _Launch(c.nodes[0])  # type: ignore[method-assign]
    be._launch_all(_segment(), {})
    assert launched == [("c1", False), ("p1", pdl), ("c2", pdl)]  # the concat is an alias: no launch


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False), ("no", False)])
def test_pdl_setting(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    if value is None:
        monkeypatch.delenv("DUALTRACK_PDL", raising=False)
    else:
        monkeypatch.setenv("DUALTRACK_PDL", value)
    assert Settings.from_env().pdl is expected


@pytest.mark.parametrize(
    ("on", "cc", "want"), [(True, (8, 0), False), (True, (8, 9), False), (True, (9, 0), True), (True, (12, 0), True),
                          (False, (9, 0), False)],
)  # fmt: skip
def test_pdl_only_where_griddepcontrol_exists(on: bool, cc: tuple[int, int], want: bool) -> None:
    from dualtrack.runtime import gpu

    settings = Settings(cache_dir=SOURCE_DIR, save_temps=None, jobs=1, use_cache=False, cuda_graphs=True, pdl=on)
    assert gpu.use_pdl(settings, cc) is want
