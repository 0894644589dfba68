"""`dualtrack tune` on a real GPU (the tiny fp16 U-Net, a small space), every record checked again
on its own, and an engine built with tuned tiles against the CPU engine and onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dualtrack import kernels
from dualtrack.compiler import tuned as tuning
from dualtrack.compiler.bundle_writer import load_model
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare, ort_session, random_input, run_ort, verify_engine
from dualtrack.contract.bundle import Bundle
from dualtrack.kernels.problems import by_problem, conv_layers
from dualtrack.runtime.driver import Module
from dualtrack.runtime.engine import Engine
from dualtrack.tuning import TuneOptions, tune_track_a
from dualtrack.tuning.tiles import arch_of, compile_candidates

CONV = kernels.KERNELS["conv3x3"]
FP16_KERNEL = Tolerance(rel_l2=2e-3, max_abs=1.0, mismatch=0)  # one fp16 rounding, fp32 sums in another order


@pytest.fixture(scope="module")
def tuned_file(tiny_full_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("tune") / "tuning.json"
    result = tune_track_a(tiny_full_bundle, out, TuneOptions(max_configs=10, iters=5, warmup=1))
    return out, result


def test_tune_writes_a_verified_record_per_problem(tiny_full_bundle: Path, tuned_file) -> None:
    out, result = tuned_file
    # Layers with C <= 4 run the small-C entry, which has no tiles: they are not tuned.
    problems = {
        p: ls
        for p, ls in by_problem(conv_layers(Bundle.open(tiny_full_bundle).plan)).items()
        if CONV.smallc_supported(p.dtype, p.C, p.K) is not None
    }
    assert problems and sorted(r.problem for r in result.records) == sorted(problems)
    assert {r.key for r in tuning.load(out)} == {r.key for r in result.records}
    for r in result.records:
        assert r.rel_l2 <= FP16_KERNEL.rel_l2, r
        assert 0 < r.time_ms <= r.baseline_ms, r  # the baseline is always a candidate
        assert r.baseline_entry == CONV.variant("float16", *(getattr(r.problem, d) for d in "NHWCK"))
        assert r.source_sha256 == tuning.source_sha256() and r.arch == result.arch and r.gpu == result.gpu
        assert r.tried >= 1 and all(reason for _, reason in r.rejected)
        assert set(r.layers) == {f"{x.node}@{x.batch}" for x in problems[r.problem]}
    assert {"plan", "compile", "inputs", "verify", "time", "write"} <= set(result.phases)
    assert result.seconds < 120


def test_every_winner_computes_the_convolution(tiny_full_bundle: Path, tuned_file) -> None:
    """Each record's entry again, compiled on its own, on fresh inputs, against the full reference
    with ReLU (the tuner checked sampled pixels without it)."""
    _, result = tuned_file
    with Engine.load(tiny_full_bundle, "cuda") as engine:
        be = engine.backend
        tiles = sorted({r.params for r in result.records})
        built = compile_candidates(CONV, tiles, arch_of(be.device.cc), jobs=4)
        modules = [Module.load(be.ctx, c, kind="cubin", origin="test", target="gpu") for c in built.cubins]
        rng = np.random.default_rng()
        for r in result.records:
            p = r.problem
            x = rng.standard_normal((p.N, p.H, p.W, p.ldx)).astype(np.float16)
            w = (rng.standard_normal((p.K, 3, 3, p.C)) / np.sqrt(9 * p.C)).astype(np.float16)
            b = rng.standard_normal(p.K).astype(np.float32)
            ref = CONV.reference(np.ascontiguousarray(x[..., : p.C]), w, b, True)
            dx, dw, db = be.from_host(x), be.from_host(w), be.from_host(b)
            dy = be.from_host(np.full((p.N, p.H, p.W, p.ldy), np.nan, np.float16))
            args = CONV.args(
                x=dx.ptr, w=dw.ptr, bias=db.ptr, y=dy.ptr, N=p.N, H=p.H, W=p.W, C=p.C, K=p.K,
                ldx=p.ldx, ldy=p.ldy, relu=True,
            )  # fmt: skip
            cfg = CONV.launch("float16", p.N, p.H, p.W, p.C, p.K, entry=r.entry)
            kern = modules[built.program.get(r.entry, 0)].function(r.entry)
            kern.launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
            got = be.to_host(dy)
            assert compare(r.entry, ref, got[..., : p.K], FP16_KERNEL).passed, (r.entry, p)
            assert np.isnan(got[..., p.K :]).all(), "channels past K belong to another tensor"


def test_engine_built_with_tuned_tiles_matches_cpu_and_onnxruntime(
    tiny_tuned_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wgmma kernel would take the C=8 and C=16 convs on sm_90a (tuned mma.sync tiles never
    # displace it: kernels.choose_conv3x3); this test is about the tuned tiles.
    monkeypatch.setenv("DUALTRACK_WGMMA", "0")
    # The spies below must see the first launches: the load's own check (runtime/selfcheck.py) would
    # prepare them first. This test verifies below, with the spies in place.
    monkeypatch.setenv("DUALTRACK_GPU_SELF_CHECK", "0")
    with Engine.load(tiny_tuned_bundle, "cuda") as engine:
        be = engine.backend
        if be.device.cc != (9, 0):
            pytest.skip("the hand-written tuning file (tests/conftest.py) has records for cc 9.0 only")
        want = {e for per in be.tuned.values() for e in per.values()}
        assert len(be.tuned) == 6 and want  # 10 layers, of which the 4 with C <= 4 run the small-C entry
        launched: set[str] = set()
        for name, kern in list(be.kernels.items()):
            be.kernels[name] = _Spy(kern, name, launched)
        be.poison = True
        try:
            report = verify_engine(engine, samples=2, interpret=False)
        finally:
            be.poison = False
        assert report.passed, "\n".join(report.lines())
        # every conv on its tuned entry, but those with C <= 4 on the small-C one
        assert {e for e in launched if e.startswith("conv3x3")} == want | {CONV.smallc_entry}
        x = random_input(engine.input_spec, 4, np.random.default_rng())
        got = engine.run(x)
    ref = run_ort(ort_session(load_model(Bundle.open(tiny_tuned_bundle))), {engine.input_spec.name: x})
    with Engine.load(tiny_tuned_bundle, "cpu") as cpu:
        cpu_out = cpu.run(x)
    tol = Tolerance(rel_l2=2e-2, max_abs=5e-2, mismatch=5e-3)
    for name in ("probs", "mask"):
        assert compare(name, ref[name], got[name], tol).passed
        assert compare(name, cpu_out[name], got[name], tol).passed


class _Spy:
    """A Kernel that notes its name when launched (directly or while a CUDA graph is captured)."""

    def __init__(self, kernel: object, name: str, seen: set[str]) -> None:
        self.kernel, self.name, self.seen = kernel, name, seen

    def launch(self, *args: object) -> None:
        self.seen.add(self.name)
        self.kernel.launch(*args)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        self.kernel.set_max_dynamic_shared(nbytes)
