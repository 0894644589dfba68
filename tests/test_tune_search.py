"""`dualtrack tune`'s search loop on the CPU, through a fake driver whose "kernels" are the numpy
reference (two of them broken on purpose) and whose events read a fake clock: candidates are
compiled for real (NVRTC, nvJitLink), verified before they are timed, rejected with the reason,
the fastest verified one wins, and the records land in the tuning file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dualtrack.compiler import tuned as tuning
from dualtrack.errors import VerificationError
from dualtrack.kernels import KERNELS, Conv3x3Spec
from dualtrack.kernels.device import REFERENCE, DeviceInfo
from dualtrack.kernels.problems import by_problem, conv_layers
from dualtrack.settings import Settings
from dualtrack.tuning import TuneOptions, space
from dualtrack.tuning import tiles as search

CONV = KERNELS["conv3x3"]
assert isinstance(CONV, Conv3x3Spec)
TILES = space.conv3x3_space((9, 0))[:4]  # what --max-configs 8 adds to the 4 fixed entries
UNWRITTEN, WRONG, FAST = (CONV.tuned_entry(TILES[i]) for i in (1, 2, 3))
COST_MS = {UNWRITTEN: 0.1, WRONG: 0.1, FAST: 0.5, "conv3x3_nhwc_f16_narrow": 1.0}  # else 2.0


class FakeGpu:
    """Device memory as numpy byte arrays by address, a clock that launches advance, a launch log."""

    def __init__(self, broken_baseline: bool = False) -> None:
        self.mem: dict[int, np.ndarray] = {}
        self.next_ptr = 1 << 20
        self.clock = 0.0
        self.log: list[tuple[str, str]] = []  # (entry, "verify" | "time")
        self.poisoned = False
        self.broken_baseline = broken_baseline

    # driver.call: only the memset the tuner uses
    def call(self, fn: Any, ptr: int, value: int, count: int, stream: Any) -> None:
        assert fn.__name__ == "cuMemsetD16Async"
        self.mem[ptr].view(np.uint16)[:count] = value
        self.poisoned = True

    def alloc(self, nbytes: int) -> Any:
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + nbytes + 256
        self.mem[ptr] = np.zeros(nbytes, np.uint8)
        return _Obj(ptr=ptr, nbytes=nbytes, close=lambda: None)

    def launch(self, entry: str, grid: tuple, block: tuple, args: list) -> None:
        v = dict(zip(CONV.PARAMS, (a for a, _ in args), strict=True))
        N, H, W, C, K, ldx, ldy = (v[k] for k in ("N", "H", "W", "C", "K", "ldx", "ldy"))
        tile = CONV.entry_tile(entry)
        assert block == (tile.threads, 1, 1) and grid[0] * tile.bm >= N * H * W and grid[1] * tile.bn >= K
        x = self.mem[v["x"]].view(np.float16).reshape(N, H, W, ldx)[..., :C]
        w = self.mem[v["w"]].view(np.float16).reshape(K, 3, 3, C)
        b = self.mem[v["bias"]].view(np.float32)
        y = self.mem[v["y"]].view(np.float16).reshape(N * H * W, ldy)
        out = CONV.reference(np.ascontiguousarray(x), w, b, bool(v["relu"])).reshape(-1, K)
        if entry == WRONG or (self.broken_baseline and entry == "conv3x3_nhwc_f16_narrow"):
            out[:, -1] += 0.5  # the last channel of every pixel, so a sampled check finds it too
        rows = out.shape[0] - tile.bm if entry == UNWRITTEN else out.shape[0]  # skips the last block
        y[:rows, :K] = out[:rows]
        self.log.append((entry, "verify" if self.poisoned else "time"))
        self.poisoned = False
        self.clock += COST_MS.get(entry, 2.0)


class _Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    gpu = FakeGpu()

    class Device:
        def __init__(self, index: int) -> None:
            self.name, self.cc, self.driver_version, self.index = "Fake H200", (9, 0), 13000, index

        def primary_context(self) -> Any:
            return _Obj(close=lambda: None)

        def info(self) -> DeviceInfo:
            return REFERENCE  # the H200 the fixed entries' thresholds were measured on

    class Stream:
        def __init__(self, ctx: Any) -> None:
            self.handle = 0

        def synchronize(self) -> None: ...
        def close(self) -> None: ...

    class Event:
        def __init__(self, ctx: Any) -> None:
            self.t = 0.0

        def record(self, stream: Any) -> None:
            self.t = gpu.clock

        def elapsed_ms(self, end: Any) -> float:
            return end.t - self.t

    class Pool:
        def __init__(self, ctx: Any) -> None: ...
        def alloc(self, nbytes: int, stream: Any) -> Any:
            return gpu.alloc(nbytes)

        def close(self) -> None: ...

    class Host:
        def __init__(self, ctx: Any, nbytes: int) -> None:
            self.buf = np.zeros(nbytes, np.uint8)

        def numpy(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
            return self.buf.view(dtype)[: int(np.prod(shape))].reshape(shape)

        def close(self) -> None: ...

    class Module:
        @classmethod
        def load(cls, ctx: Any, data: bytes, **_: Any) -> Any:
            assert data[:4] == b"\x7fELF"  # a real cubin from nvJitLink

            def function(name: str) -> Any:
                assert name.encode() in data, f"{name} is not in this cubin"
                launch = lambda grid, block, shared, stream, args: gpu.launch(name, grid, block, args)  # noqa: E731
                return _Obj(launch=launch)

            return _Obj(function=function)

    def upload(stream: Any, buf: Any, arr: np.ndarray) -> None:
        gpu.mem[buf.ptr][: arr.nbytes] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    def download(stream: Any, host: Any, buf: Any) -> None:
        host.buf[:] = gpu.mem[buf.ptr]

    for name, value in {
        "Device": Device, "Stream": Stream, "Event": Event, "DevicePool": Pool, "HostBuffer": Host,
        "Module": Module, "upload": upload, "download": download, "call": gpu.call,
    }.items():  # fmt: skip
        monkeypatch.setattr(search, name, value)
    return gpu


def test_search_verifies_before_timing_and_keeps_the_fastest_verified(
    fake: FakeGpu, tiny_full_config: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tuning.json"
    opts = TuneOptions(max_configs=8, iters=5, warmup=2)
    steps: list[str] = []
    bar: list[tuple[int, int]] = []
    result = search.tune_track_a(
        tiny_full_config,
        out,
        opts,
        progress=steps.append,
        on_problem=lambda done, total, what: bar.append((done, total)),
        settings=dataclasses.replace(Settings.from_env(), jobs=2),
    )
    plan = search.load_plan(tiny_full_config)
    # The C <= 4 layers run the small-C entry, which has no tiles: they are not tuned.
    problems = {
        p: ls for p, ls in by_problem(conv_layers(plan)).items() if CONV.smallc_supported(p.dtype, p.C, p.K) is not None
    }
    assert problems and len(problems) < len(by_problem(conv_layers(plan)))
    assert [r.problem for r in result.records] == list(problems)
    assert bar[0] == (0, len(problems)) and bar[-1] == (len(problems), len(problems))
    for r in result.records:
        assert r.entry == FAST and r.baseline_entry == "conv3x3_nhwc_f16_narrow"  # K <= 32 everywhere here
        assert (r.time_ms, r.baseline_ms, r.speedup) == pytest.approx((0.5, 1.0, 2.0))
        reasons = dict(r.rejected)
        bm, k = CONV.entry_tile(UNWRITTEN).bm, r.problem.K
        assert reasons[UNWRITTEN] == f"{bm * k} of {r.problem.pixels * k} outputs not written"
        assert reasons[WRONG].startswith("rel L2 ") and reasons[WRONG].endswith(" > 2e-03")
        assert r.tried == 5  # narrow + the 4 space tiles; default, wide and small have BN > 2 x 16
        assert r.rel_l2 < 1e-3 and r.gpu == "Fake H200" and r.arch == "sm_90a" and r.driver == 13000
        assert r.source_sha256 == tuning.source_sha256()
    # Every candidate was verified once per problem; only the verified ones were ever timed.
    timed = {e for e, phase in fake.log if phase == "time"}
    assert timed == {"conv3x3_nhwc_f16_narrow", FAST, CONV.tuned_entry(TILES[0])}
    verified = [e for e, phase in fake.log if phase == "verify"]
    assert len(verified) == 5 * len(problems)
    assert sum(1 for e, phase in fake.log if phase == "time" and e == FAST) == len(problems) * (5 + 2)
    assert {r.key for r in tuning.load(out)} == {r.key for r in result.records}
    assert set(result.phases) == {"plan", "compile", "inputs", "verify", "time", "write"}
    assert result.candidates == 8 and any("rejected" in s for s in steps)


def test_sampled_check_of_a_large_problem(fake: FakeGpu, tiny_full_config: Path, tmp_path: Path) -> None:
    # sample_all=0: every problem is checked at one pixel per run of 64, as large ones are on a GPU.
    opts = TuneOptions(max_configs=8, iters=2, batches=(4,), layers="mid/*", sample_all=0)
    result = search.tune_track_a(tiny_full_config, tmp_path / "t.json", opts)
    for r in result.records:
        reasons = dict(r.rejected)
        assert r.entry == FAST and set(reasons) == {UNWRITTEN, WRONG}
        assert reasons[WRONG].startswith("rel L2 ")


def test_a_failing_baseline_is_a_kernel_bug(fake: FakeGpu, tiny_full_config: Path, tmp_path: Path) -> None:
    fake.broken_baseline = True
    out = tmp_path / "tuning.json"
    with pytest.raises(VerificationError, match=r"the heuristic's entry conv3x3_nhwc_f16_narrow fails on .*rel L2"):
        search.tune_track_a(tiny_full_config, out, TuneOptions(max_configs=4, iters=2, batches=(1,)))
    assert not out.exists()


def test_batches_and_layers_narrow_the_problems(fake: FakeGpu, tiny_full_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "tuning.json"
    opts = TuneOptions(max_configs=4, iters=2, batches=(2,), layers="mid/*")
    result = search.tune_track_a(tiny_full_config, out, opts)
    assert {r.problem.N for r in result.records} == {2}
    assert {layer.split("@")[0] for r in result.records for layer in r.layers} == {"mid/conv1", "mid/conv2"}
    # A second run merges: the same keys are replaced, nothing is duplicated.
    search.tune_track_a(tiny_full_config, out, opts)
    assert len(tuning.load(out)) == len(result.records)


def test_cli_prints_a_line_per_problem_and_the_phases(fake: FakeGpu, tiny_full_config: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dualtrack.cli import main

    out = tmp_path / "tuning.json"
    args = ["tune", str(tiny_full_config), "-o", str(out), "--batch", "1", "--layers", "enc*", "--max-configs", "8"]
    result = CliRunner().invoke(main, [*args, "--iters", "3"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    lines = result.stdout.splitlines()
    assert len(lines) == 1 + len(tuning.load(out))
    fast = FAST.removeprefix("conv3x3_nhwc_")
    assert all(re.search(rf"1\.0000 ->   0\.5000 ms   2\.00x  {fast}  \[enc", line) for line in lines[:-1]), lines
    assert re.fullmatch(
        rf"{re.escape(str(out))}: \d+ problems tuned on Fake H200 \(sm_90a\), 8 tiles, in \d+\.\d s "
        r"\(plan \d+\.\d s, compile \d+\.\d s, inputs \d+\.\d s, verify \d+\.\d s, time \d+\.\d s, write \d+\.\d s\)",
        lines[-1],
    ), lines[-1]
    assert "- compile 8 candidate tiles for sm_90a (Fake H200)" in result.stderr
