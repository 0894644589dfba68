"""Both tracks on a real GPU: Track A kernels against their numpy semantics, the whole engine
against onnxruntime (with Track A outputs poisoned first), GPU against CPU, threads, DLPack I/O."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from dualtrack import kernels
from dualtrack.compiler.bundle_writer import load_model
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare, ort_session, random_input, run_ort
from dualtrack.errors import ArchError, DeviceError
from dualtrack.runtime.engine import Engine

# fp16 kernels accumulate in fp32 and round once, like the reference; fp32 sums in another order.
KERNEL_TOL = {"float16": 2e-3, "float32": 1e-5}


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path):
    with Engine.load(tiny_bundle, "cuda") as e:
        yield e


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("n", "h", "w", "c", "k", "relu"),
    [
        (1, 64, 64, 3, 8, 1),
        (2, 37, 23, 5, 7, 0),
        (1, 32, 32, 64, 128, 1),
        (3, 16, 16, 40, 72, 1),
        (2, 37, 45, 3, 40, 0),
    ],
)
def test_conv3x3_kernel(engine, dtype, n, h, w, c, k, relu) -> None:
    """Each conv kernel against its numpy semantics, on odd sizes and channel counts, fresh inputs."""
    be = engine.backend
    rng = np.random.default_rng()
    x = rng.standard_normal((n, h, w, c)).astype(dtype)
    wt = (rng.standard_normal((k, 3, 3, c)) / np.sqrt(9 * c)).astype(dtype)
    b = rng.standard_normal(k).astype(np.float32)
    ref = kernels.KERNELS["conv3x3"].reference(x, wt, b, bool(relu))
    dx, dw, db = be.from_host(x), be.from_host(wt), be.from_host(b)
    spec = kernels.KERNELS["conv3x3"]
    suffix = "_f16" if dtype == "float16" else "_f32"
    # Every tile variant of this dtype, not only the one `variant` would pick for this shape (the
    # small-C entry where it takes the shape: C <= 4).
    assert isinstance(spec, kernels.Conv3x3Spec)
    entries = [e for e in spec.entries if suffix in e]
    for entry in [e for e in entries if e != spec.smallc_entry or spec.smallc_supported(dtype, c, k) is None]:
        dy = be.from_host(np.full(ref.shape, np.nan, dtype))  # poisoned: every element must be written
        cfg = spec.launch(dtype, n, h, w, c, k, entry=entry)
        args = spec.args(x=dx.ptr, w=dw.ptr, bias=db.ptr, y=dy.ptr, N=n, H=h, W=w, C=c, K=k, relu=bool(relu))
        be.kernels[entry].launch(cfg.grid, cfg.block, cfg.shared_bytes, be.stream, args)
        got = be.to_host(dy)
        check = compare(entry, ref, got, Tolerance(rel_l2=KERNEL_TOL[dtype], max_abs=1.0, mismatch=0))
        assert check.passed, check


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("n", "h", "w", "c"), [(1, 64, 64, 32), (2, 38, 22, 5), (1, 8, 8, 512)])
def test_maxpool_kernel(engine, dtype, n, h, w, c) -> None:
    be = engine.backend
    x = np.random.default_rng().standard_normal((n, h, w, c)).astype(dtype)
    spec = kernels.KERNELS["maxpool2x2"]
    ref = spec.reference(x)
    dx, dy = be.from_host(x), be.from_host(np.full(ref.shape, np.nan, dtype))
    cfg = spec.launch(dtype, n, h, w, c)
    be.kernels[spec.entry(dtype)].launch(
        cfg.grid, cfg.block, cfg.shared_bytes, be.stream, spec.args(x=dx.ptr, y=dy.ptr, N=n, H=h, W=w, C=c)
    )
    np.testing.assert_array_equal(be.to_host(dy), ref)  # max is exact


def test_engine_verifies_on_gpu(engine) -> None:
    """Every segment (kernels and IREE CUDA) and the whole plan against onnxruntime, outputs poisoned."""
    from dualtrack.compiler.verify import verify_engine

    engine.backend.poison = True
    try:
        report = verify_engine(engine, samples=2, interpret=False)
    finally:
        engine.backend.poison = False
    assert report.passed, "\n".join(report.lines())
    assert any("[kernels]" in c.name for c in report.checks)


def test_gpu_matches_cpu_and_onnxruntime(engine, tiny_bundle: Path) -> None:
    x = random_input(engine.input_spec, 4, np.random.default_rng())
    ref = run_ort(ort_session(load_model(engine.bundle)), {engine.input_spec.name: x})
    with Engine.load(tiny_bundle, "cpu") as cpu:
        want = cpu.run(x)
    got = engine.run(x)
    tol = Tolerance(rel_l2=1e-4, max_abs=1e-3, mismatch=1e-3)
    for name in ("probs", "mask"):
        assert compare(name, ref[name], got[name], tol).passed
        assert compare(name, want[name], got[name], tol).passed


def test_shares_primary_context_with_iree(engine) -> None:
    from cuda.bindings import driver as cu

    from dualtrack.runtime.driver import call

    engine.run(random_input(engine.input_spec, 1, np.random.default_rng()))
    current = call(cu.cuCtxGetCurrent)
    assert int(current) == int(engine.backend.ctx.handle)


def test_threads_share_one_engine(engine) -> None:
    rng = np.random.default_rng()
    xs = [random_input(engine.input_spec, 1, rng) for _ in range(6)]
    serial = [engine.run(x)["probs"] for x in xs]
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        results[i] = engine.run(xs[i])["probs"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, s in enumerate(serial):
        np.testing.assert_allclose(results[i], s, rtol=0, atol=1e-6)


def test_gpu_tensor_in_gpu_tensor_out(engine) -> None:
    torch = pytest.importorskip("torch", reason="needs torch for a third-party GPU tensor")
    x = random_input(engine.input_spec, 1, np.random.default_rng())
    want = engine.run(x)["probs"]
    out = engine.run(torch.from_numpy(x).cuda())
    probs = torch.from_dlpack(out["probs"])
    assert probs.is_cuda
    np.testing.assert_allclose(probs.cpu().numpy(), want, rtol=0, atol=1e-6)


def test_gpu_outputs_wait_for_the_inference_before_another_stream_reads_them(engine) -> None:
    """A torch consumer reads an output on its own stream, which does not follow the engine's: the output's
    __dlpack__ waits for the engine's stream. The engine's stream is kept busy first (a spin queued on it
    through torch), so a read that did not wait would copy the outputs before the inference wrote them."""
    torch = pytest.importorskip("torch", reason="needs torch for a third-party GPU tensor")
    x = random_input(engine.input_spec, 1, np.random.default_rng(3))
    want = engine.run(x)["probs"]
    busy = torch.cuda.ExternalStream(int(engine.backend.stream.handle))
    for _ in range(3):
        gpu_x = torch.from_numpy(x).cuda()
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200_000_000)  # about 0.1 s of cycles ahead of the inference on its stream
        out = engine.run(gpu_x)
        assert out["probs"].__cuda_array_interface__["stream"] == (int(engine.backend.stream.handle) or 1)
        got = torch.from_dlpack(out["probs"]).cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_bundle_without_this_arch_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle, other)
    m = json.loads((other / "manifest.json").read_text())
    m["targets"] = [t for t in m["targets"] if t["arch"] == "sm_120"] or [{**m["targets"][0], "arch": "sm_120"}]
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArchError, match="add sm_"):
        Engine.load(other, "cuda")


def test_missing_device_index() -> None:
    from dualtrack.runtime.driver import Device

    with pytest.raises(DeviceError, match="does not exist"):
        Device(99)


def test_whole_body_on_track_a_verifies_on_gpu(tiny_full_bundle: Path) -> None:
    """fp16 encoder + bottleneck + decoder as kernels (concat by channel slices), outputs poisoned."""
    from dualtrack.compiler.verify import verify_engine

    with Engine.load(tiny_full_bundle, "cuda") as e:
        report = verify_engine(e, samples=2, interpret=False)
        assert report.passed, "\n".join(report.lines())
        x = random_input(e.input_spec, 4, np.random.default_rng())
        ref = run_ort(ort_session(load_model(e.bundle)), {e.input_spec.name: x})
        got = e.run(x)
    tol = Tolerance(rel_l2=2e-2, max_abs=5e-2, mismatch=5e-3)
    for name in ("probs", "mask"):
        assert compare(name, ref[name], got[name], tol).passed


def test_engine_is_bit_identical_with_the_gil_kept_or_released(tiny_full_bundle: Path) -> None:
    """The enqueue calls through driver.HeldCalls (ctypes, the GIL kept: the default) and through
    cuda-python give the same engine: graph replay, copies, the overlapped stage and launch, the
    masks copied into page-locked rows. Exact (the same kernels in the same order)."""
    from dualtrack.runtime import driver

    x = None
    results = []
    for hold in (True, False):
        driver.set_hold_gil(hold)
        try:
            with Engine.load(tiny_full_bundle, "cuda") as e:
                if x is None:
                    x = random_input(e.input_spec, 4, np.random.default_rng(11))
                direct = e.run(x)
                rows = e.host_array(4)
                mask_rows = np.zeros_like(direct["mask"])
                e.pin_host(mask_rows)
                rows[:] = x
                sub = e.launch(
                    e.stage(rows), outputs=("mask", "probs"), into={"mask": [mask_rows[i] for i in range(4)]}
                )
                overlapped = sub.result()
                results.append((direct, overlapped["probs"], mask_rows.copy()))
        finally:
            driver.set_hold_gil(True)
    (held, held_probs, held_rows), (released, released_probs, released_rows) = results
    for name in ("mask", "probs"):
        np.testing.assert_array_equal(held[name], released[name])
    np.testing.assert_array_equal(held_probs, released_probs)
    np.testing.assert_array_equal(held_rows, released_rows)
    np.testing.assert_array_equal(held_rows, held["mask"])


def test_host_array_is_page_locked_and_uploaded_without_staging(engine) -> None:
    from cuda.bindings import driver as cu

    from dualtrack.runtime.driver import call

    x = engine.host_array(1)
    x[:] = random_input(engine.input_spec, 1, np.random.default_rng())
    flags = call(cu.cuMemHostGetFlags, x.ctypes.data)  # fails with CUDA_ERROR_INVALID_VALUE if pageable
    assert int(flags) & cu.CU_MEMHOSTALLOC_PORTABLE
    assert engine.backend._is_host_array(x) and not engine.backend._is_host_array(np.array(x))
    want = engine.run(np.array(x))
    got = engine.run(x)
    for name in ("mask", "probs"):
        np.testing.assert_array_equal(got[name], want[name])


def test_the_first_load_on_this_gpu_is_checked_and_recorded(tiny_bundle: Path, tmp_path: Path, monkeypatch) -> None:
    """runtime/selfcheck.py: the load verifies the bundle on this GPU once and keeps a passed record."""
    from dualtrack.runtime.selfcheck import record_path

    monkeypatch.setenv("DUALTRACK_CACHE_DIR", str(tmp_path))
    with Engine.load(tiny_bundle, "cuda") as e:
        dev = e.backend.device
        name = f"{dev.name} cc{dev.cc[0]}.{dev.cc[1]} driver{dev.driver_version}"
        record = json.loads(record_path(tmp_path, e.bundle.manifest.build_key, name).read_text())
    assert record["passed"] is True and record["device"] == name
    assert any(c["name"].startswith("plan b") for c in record["checks"])


def test_a_bundle_whose_gpu_results_are_wrong_is_refused_at_load(
    tiny_bundle: Path, tmp_path: Path, monkeypatch
) -> None:
    """A failing record does not stand in for a pass: the load checks again and refuses, engine closed."""
    from dualtrack.contract.checks import Check, Report
    from dualtrack.errors import VerificationError
    from dualtrack.runtime import selfcheck

    check_cases = selfcheck.check_cases

    def wrong(engine):
        good = check_cases(engine)
        return Report(
            good.device,
            good.precision,
            good.tolerance,
            [*good.checks, Check("plan b1 probs #0", 1, 1, 0, 0, False)],
            good.seed,
        )

    monkeypatch.setenv("DUALTRACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(selfcheck, "check_cases", wrong)
    with pytest.raises(VerificationError, match="computes wrong results on NVIDIA"):
        Engine.load(tiny_bundle, "cuda")
