"""The Engine on the CPU (every segment through its IREE llvm-cpu module) against onnxruntime on
the bundle's own model.onnx, on fresh random images; batching, input checks, devices, threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from dualtrack.errors import DeviceError, InputError
from dualtrack.runtime.engine import Engine

PROBS_REL_L2 = 1e-5  # fp32 through IREE llvm-cpu vs onnxruntime: summation order and fused ops only
MASK_MISMATCH = 1e-3  # argmax flips only where the two classes tie to within fp32 rounding
ROW_RTOL, ROW_ATOL = 1e-6, 1e-7  # one image through the batch-4 module vs the batch-1 module
SHAPE_TEXT = r"this bundle takes \(n, 64, 64, 3\) uint8"


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[Engine]:
    with Engine.load(tiny_bundle, "cpu") as e:
        yield e


@pytest.fixture(scope="module")
def reference(tiny_bundle: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(tiny_bundle / "model.onnx"), opts, providers=["CPUExecutionProvider"])


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 64, 64, 3), dtype=np.uint8)


def ort_run(sess: ort.InferenceSession, x: np.ndarray) -> dict[str, np.ndarray]:
    mask, probs = sess.run(["mask", "probs"], {"image": x})
    return {"mask": mask, "probs": probs}


def rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def assert_close(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], seed: int) -> None:
    assert got["probs"].shape == ref["probs"].shape and got["mask"].shape == ref["mask"].shape
    assert np.all(np.isfinite(got["probs"]))
    assert rel_l2(ref["probs"], got["probs"]) <= PROBS_REL_L2, f"seed {seed}"
    mismatch = np.mean(ref["mask"].astype(np.int64) != got["mask"].astype(np.int64))
    assert mismatch <= MASK_MISMATCH, f"seed {seed}"


# --- numerics against onnxruntime -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4])
def test_compiled_batch_matches_onnxruntime(engine: Engine, reference: ort.InferenceSession, rng, n: int) -> None:
    gen, seed = rng
    x = images(gen, n)
    assert_close(ort_run(reference, x), engine.run(x), seed)


@pytest.mark.parametrize("n", [3, 6])
def test_padded_and_split_batches_return_exactly_n_rows(
    engine: Engine, reference: ort.InferenceSession, rng, n: int
) -> None:
    gen, seed = rng
    x = images(gen, n)
    got = engine.run(x)
    assert got["probs"].shape == (n, 2, 64, 64) and got["mask"].shape == (n, 64, 64)
    assert_close(ort_run(reference, x), got, seed)
    # Each row is what that image gives on its own (through the batch-1 module): padding and splitting
    # never leak across rows. Different modules may order a reduction differently, hence ROW_RTOL.
    for i in range(n):
        one = engine.run(x[i : i + 1])
        np.testing.assert_allclose(
            got["probs"][i], one["probs"][0], rtol=ROW_RTOL, atol=ROW_ATOL, err_msg=f"row {i}, seed {seed}"
        )
        assert np.mean(got["mask"][i] != one["mask"][0]) <= MASK_MISMATCH, f"row {i}, seed {seed}"


def test_chunks_use_fewest_padded_rows(engine: Engine) -> None:
    assert engine.batch_sizes == (1, 4)
    assert engine._chunks(3) == [(0, 3, 4)]
    assert engine._chunks(6) == [(0, 4, 4), (4, 2, 4)]
    assert engine._chunks(5) == [(0, 4, 4), (4, 1, 1)]


def test_output_dtypes_follow_the_plan(engine: Engine, rng) -> None:
    got = engine.run(images(rng[0], 1))
    assert {k: v.dtype.name for k, v in got.items()} == {t.name: t.dtype for t in engine.output_specs}


def test_last_timings(engine: Engine, rng) -> None:
    engine.run(images(rng[0], 1))
    t = engine.last_timings
    assert set(t) == {"track_a_ms", "track_b_ms", "total_ms"}
    assert all(v > 0 for v in t.values())
    assert t["track_a_ms"] + t["track_b_ms"] <= t["total_ms"]


# --- input checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((1, 32, 32, 3), np.uint8),  # wrong shape
        np.zeros((1, 3, 64, 64), np.uint8),  # NCHW given for NHWC
        np.zeros((64, 64, 3), np.uint8),  # wrong rank: no batch
        np.zeros((1, 1, 64, 64, 3), np.uint8),  # wrong rank: extra dim
        np.zeros((0, 64, 64, 3), np.uint8),  # empty batch
    ],
    ids=["shape", "nchw", "rank3", "rank5", "empty"],
)
def test_wrong_shape_or_rank(engine: Engine, bad: np.ndarray) -> None:
    shape = str(bad.shape).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(InputError, match=rf"^input has shape {shape}; {SHAPE_TEXT}"):
        engine.run(bad)


def test_wrong_dtype(engine: Engine) -> None:
    with pytest.raises(
        InputError, match=rf"^input has dtype float32; {SHAPE_TEXT}: convert with \.astype\(np\.uint8\)$"
    ):
        engine.run(np.zeros((1, 64, 64, 3), np.float32))


def test_shape_error_does_not_claim_nchw(engine: Engine) -> None:
    with pytest.raises(InputError) as err:
        engine.run(np.zeros((1, 3, 64, 64), np.uint8))
    assert "NCHW" not in str(err.value)


# --- devices and lifetime -----------------------------------------------------------------------


def test_cuda_without_gpu_is_one_line_device_error(tiny_bundle: Path) -> None:
    try:
        from dualtrack.runtime.driver import load_driver

        load_driver()
    except DeviceError:
        pass
    else:
        pytest.skip("a GPU is present: this test checks the no-GPU error")
    with pytest.raises(DeviceError, match=r"^no NVIDIA GPU .*; run with --device cpu or on a GPU machine$") as err:
        Engine.load(tiny_bundle, "cuda")
    assert "\n" not in str(err.value)


def test_unknown_device(tiny_bundle: Path) -> None:
    with pytest.raises(InputError, match=r"^device must be one of cpu, cuda, not 'tpu'$"):
        Engine.load(tiny_bundle, "tpu")


def test_closed_engine(tiny_bundle: Path, rng) -> None:
    e = Engine.load(tiny_bundle, "cpu")
    e.run(images(rng[0], 1))
    e.close()
    e.close()  # closing twice is harmless
    with pytest.raises(InputError, match=r"^this engine is closed; load the bundle again$"):
        e.run(images(rng[0], 1))


def test_load_refuses_another_model(tiny_bundle: Path, tmp_path: Path) -> None:
    from dualtrack.errors import BundleError

    other = tmp_path / "other.onnx"
    other.write_bytes(b"not the model")
    with pytest.raises(BundleError, match=r"was built from another model"):
        Engine.load(tiny_bundle, "cpu", model=other)


# --- threads ----------------------------------------------------------------------------------


def test_concurrent_runs_equal_serial_runs(engine: Engine, rng) -> None:
    gen, seed = rng
    inputs = [images(gen, n) for n in (1, 3, 4, 2, 1, 6, 4, 1)]
    serial = [engine.run(x) for x in inputs]
    results: dict[int, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            for i in range(k, len(inputs), 4):
                results[i] = engine.run(inputs[i])
        except BaseException as e:  # surfaced below with the seed
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"seed {seed}: {errors[0]!r}"
    assert sorted(results) == list(range(len(inputs)))
    for i, want in enumerate(serial):
        for name in ("probs", "mask"):
            np.testing.assert_array_equal(results[i][name], want[name], err_msg=f"input {i} {name}, seed {seed}")


def test_selected_outputs_only(engine: Engine, rng) -> None:
    x = images(rng[0], 3)
    full = engine.run(x)
    only = engine.run(x, outputs=("mask",))
    assert list(only) == ["mask"]
    np.testing.assert_array_equal(only["mask"], full["mask"])
    with pytest.raises(InputError, match=r"no output named 'logits'; this bundle's outputs are mask, probs"):
        engine.run(x, outputs=("logits",))


def test_host_array_is_an_input_to_fill_in_place(engine: Engine, rng) -> None:
    gen, seed = rng
    x = engine.host_array(2)
    assert x.shape == engine.input_spec.at_batch(2) and x.dtype == np.uint8 and not x.any()
    x[:] = images(gen, 2)
    np.testing.assert_array_equal(engine.run(x)["mask"], engine.run(np.array(x))["mask"], err_msg=f"seed {seed}")


def test_run_returns_arrays_the_caller_owns(engine: Engine, rng) -> None:
    gen, _ = rng
    first = engine.run(images(gen, 1), outputs=("mask",))["mask"]
    kept = first.copy()
    engine.run(images(gen, 1), outputs=("mask",))
    np.testing.assert_array_equal(first, kept)


def test_launch_into_the_callers_rows(engine: Engine, rng) -> None:
    """launch(into=...) writes the named output row by row into the caller's arrays (None: not
    wanted) and leaves it out of the result; exactly run's rows. Wrong arrays are refused."""
    r, _ = rng
    x = images(r, 4)
    want = engine.run(x, outputs=("mask", "probs"))
    h, w = engine.input_spec.shape[1:3]
    rows = [np.full((h, w), 77, np.uint8) for _ in range(4)]
    into = [rows[0], None, rows[2], rows[3]]
    got = engine.launch(engine.stage(x), outputs=("mask", "probs"), into={"mask": into}).result()
    assert set(got) == {"probs"}
    np.testing.assert_array_equal(got["probs"], want["probs"])
    for i in (0, 2, 3):
        np.testing.assert_array_equal(rows[i], want["mask"][i])
    assert (rows[1] == 77).all()
    with pytest.raises(InputError, match=r"into\['mask'\] has 3 rows for a staged batch of 4"):
        engine.launch(engine.stage(x), outputs=("mask",), into={"mask": into[:3]})
    with pytest.raises(InputError, match=r"each row must be a C-contiguous uint8\[64, 64\]"):
        engine.launch(engine.stage(x), outputs=("mask",), into={"mask": [np.zeros((h, w), np.int32)] * 4})
    with pytest.raises(InputError, match="not among the outputs asked for"):
        engine.launch(engine.stage(x), outputs=("probs",), into={"mask": into})
    assert engine.pin_host(rows[0]) is None  # nothing to page-lock on the CPU
