"""The runtime and the service never import the compiler: a serving process imports only the
build<->runtime contract, the kernels' launch specs and the CUDA / IREE runtimes (docs/architecture.md,
"What a serving container needs"). Each import runs in a fresh interpreter, so nothing a test
imported before can hide a dependency."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dualtrack.contract
import dualtrack.runtime
from dualtrack.contract.bundle import CASES, Bundle
from dualtrack.contract.cases import FULL_MAX, SAMPLE, ReferenceCases, sample_stride
from dualtrack.contract.checks import MASK, PROBS, Tolerance, top2_margin
from dualtrack.contract.plan import TensorSpec
from dualtrack.errors import VerificationError
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.selfcheck import GpuCheckError, check_cases, self_check

# Build-machine packages and modules; none may be loaded by serving.
FORBIDDEN = ("onnx", "onnxruntime", "iree.compiler", "onnxslim", "onnxconverter_common")
FORBIDDEN_PREFIXES = ("dualtrack.compiler", "dualtrack.tuning", "dualtrack.cli")

SERVING = [
    *(f"dualtrack.runtime.{m.name}" for m in pkgutil.iter_modules(dualtrack.runtime.__path__)),
    *(f"dualtrack.contract.{m.name}" for m in pkgutil.iter_modules(dualtrack.contract.__path__)),
    "dualtrack.kernels",
    "dualtrack.serve.app",
    "dualtrack.serve.shared",
    "dualtrack.serve.batcher",
    "dualtrack.serve.protocol",
    "dualtrack.serve.workers",
    "dualtrack.serve.metrics",
]

_REPORT = """
import json, sys
forbidden = {forbidden!r}
prefixes = {prefixes!r}
bad = sorted(m for m in sys.modules
             if m in forbidden or m.split(".")[0] in forbidden or m.startswith(forbidden) or m.startswith(prefixes))
print(json.dumps(bad))
"""


def _loaded_forbidden(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the forbidden modules loaded when it ends."""
    tail = _REPORT.format(forbidden=FORBIDDEN, prefixes=FORBIDDEN_PREFIXES)
    done = subprocess.run([sys.executable, "-c", code + tail], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_runtime_serve_and_contract_modules_import_nothing_of_the_compiler() -> None:
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in SERVING)
    assert _loaded_forbidden(code) == []


def test_loading_and_running_a_bundle_on_the_cpu_imports_nothing_of_the_compiler(tiny_bundle: Path) -> None:
    code = (
        "import numpy as np\n"
        "from dualtrack.runtime.engine import Engine\n"
        f"with Engine.load({str(tiny_bundle)!r}, 'cpu') as e:\n"
        "    x = np.random.default_rng(0).integers(0, 256, size=(2, *e.input_spec.shape[1:]), dtype=np.uint8)\n"
        "    out = e.run(x)\n"
        "    assert all(len(v) == 2 for v in out.values())\n"
        "    e.bundle.weights\n"
    )
    assert _loaded_forbidden(code) == []


def test_the_weights_read_without_onnx_equal_the_models_initializers(tiny_bundle: Path) -> None:
    import onnx
    from onnx import numpy_helper

    from dualtrack.compiler.bundle_writer import load_model

    bundle = Bundle.open(tiny_bundle)
    want = {t.name: numpy_helper.to_array(t) for t in load_model(bundle).graph.initializer}
    got = bundle.weights
    assert got.keys() == want.keys() and want
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
        np.testing.assert_array_equal(got[name], arr)
    # model.onnx stays a valid model: its initializers are external data in weights.bin
    onnx.checker.check_model(str(tiny_bundle / "model.onnx"))


def test_the_cpu_engine_passes_the_bundles_reference_cases(tiny_bundle: Path, tmp_path: Path) -> None:
    with Engine.load(tiny_bundle, "cpu") as engine:
        report = check_cases(engine)
        record = self_check(engine, "Some GPU cc9.0", tmp_path)
    assert report.passed, report.lines()
    batches = engine.plan.batch_sizes
    assert {c.name.split()[1] for c in report.checks} == {f"b{b}" for b in batches}
    assert record["passed"] is True and len(record["checks"]) == len(report.checks)


def _perturbed_copy(tiny_bundle: Path, dest: Path, scale: float) -> Bundle:
    """The tiny bundle with its stored probabilities scaled (the manifest's hash patched to match)."""
    import shutil

    from dualtrack.contract.bundle import MANIFEST, sha256

    shutil.copytree(tiny_bundle, dest)
    cases = Bundle.open(dest).cases
    outputs = {k: (v * scale if k == PROBS else v) for k, v in cases.outputs.items()}
    data = ReferenceCases(cases.seed, cases.inputs, outputs, cases.strides, cases.margin).to_bytes()
    (dest / CASES).write_bytes(data)
    raw = json.loads((dest / MANIFEST).read_text())
    raw["files"][CASES] = sha256(data)
    (dest / MANIFEST).write_text(json.dumps(raw))
    return Bundle.open(dest)


def test_a_bundle_whose_stored_reference_differs_is_refused_with_one_line(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = _perturbed_copy(tiny_bundle, tmp_path / "bundle", 1.5)
    with Engine.load(bundle, "cpu") as engine, pytest.raises(GpuCheckError) as err:
        self_check(engine, "Bad GPU", tmp_path / "cache")
    message = err.value.message
    assert isinstance(err.value, VerificationError) and "\n" not in message
    assert "computes wrong results on Bad GPU" in message and f"plan b{engine.plan.batch_sizes[0]} probs" in message
    assert "dualtrack verify BUNDLE --device cuda" in message and "DUALTRACK_GPU_SELF_CHECK=0" in message
    assert any(not c["passed"] for c in err.value.record["checks"])


def test_a_large_float_output_is_sampled_over_every_row_and_column() -> None:
    h, w = 1024, 1000  # 4 classes: 4M elements per image, above FULL_MAX
    shape = (4, h, w)
    stride = sample_stride(shape, "float32")
    assert stride > 1 and np.gcd(stride, w) == 1 and sample_stride((4, 16, 16), "float32") == 1
    assert sample_stride(shape, "uint8") == 1  # class ids are stored whole
    kept = np.arange(0, np.prod(shape), stride)
    assert 0.8 * SAMPLE < len(kept) <= SAMPLE and np.prod(shape) > FULL_MAX  # about SAMPLE kept
    assert len(np.unique(kept % w)) == w and len(np.unique((kept // w) % h)) == h


def test_the_tie_rule_excuses_a_flipped_pixel_only_within_rounding_of_a_tie() -> None:
    """Reference probs with one near-tie pixel; the engine flips that pixel's class (excused) and,
    in the second case, a decided one too (a mismatch)."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    probs = rng.dirichlet(np.ones(3), size=(1, 8, 8)).transpose(0, 3, 1, 2).astype(np.float32)
    probs[0, :, 0, 0] = (0.4, 0.4 + 1e-4, 0.2 - 1e-4)
    mask = np.argmax(probs, axis=1).astype(np.uint8)
    specs = [TensorSpec(MASK, (1, 8, 8), "uint8"), TensorSpec(PROBS, (1, 3, 8, 8), "float32")]
    cases = ReferenceCases.from_reference(7, np.zeros((1, 4), np.uint8), specs, {MASK: mask, PROBS: probs})
    tol = Tolerance(rel_l2=1e-2, max_abs=1e-2, mismatch=0.0)
    got_probs = probs + 1e-3  # well within tolerance, beyond the tie's margin
    flipped = mask.copy()
    flipped[0, 0, 0] = 0
    assert all(c.passed for c in cases.check({MASK: flipped, PROBS: got_probs}, 1, tol, "plan b1"))
    wrong = flipped.copy()
    decided = np.unravel_index(np.argmax(top2_margin(probs)[0]), (8, 8))  # the clearest pixel
    wrong[0, decided[0], decided[1]] = (mask[0, decided[0], decided[1]] + 1) % 3
    checks = cases.check({MASK: wrong, PROBS: got_probs}, 1, tol, "plan b1")
    assert [c.passed for c in checks] == [False, True]
