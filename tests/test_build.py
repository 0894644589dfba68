"""`dualtrack build` on the tiny U-Net (IREE llvm-cpu and CUDA modules, Track A PTX and cubins):
the bundle's contents, the module cache, atomic writes, and every way a bundle is refused at load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dualtrack.compiler import iree_build as track_b
from dualtrack.compiler.build import build
from dualtrack.compiler.kernel_build import SOURCE_DIR
from dualtrack.contract.bundle import MANIFEST, Bundle, model_digest
from dualtrack.contract.manifest import BUNDLE_FORMAT, Manifest
from dualtrack.contract.plan import Plan
from dualtrack.errors import BundleError, ConfigError, VerificationError

TINY_YAML = Path(__file__).parent / "data" / "tiny.yaml"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its hash: a bundle is unchanged iff this is."""
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(dest: Path) -> list[str]:
    """Temporary or replaced siblings a build may leave next to its destination."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def config_variant(tmp_path: Path, model: Path, extra: str = "", name: str = "variant.yaml") -> Path:
    """tests/data/tiny.yaml pointing at `model` (absolute), with YAML appended."""
    text = TINY_YAML.read_text().replace("model: tiny_fp32.onnx", f"model: {model}")
    path = tmp_path / name
    path.write_text(text + extra)
    return path


@pytest.fixture
def bundle_copy(tiny_bundle: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, dest)
    return dest


# --- what a build writes ----------------------------------------------------------------------


def test_manifest_records_plan_and_model(tiny_bundle: Path, tiny_config: Path) -> None:
    b = Bundle.open(tiny_bundle)
    m = b.manifest
    assert m.format == BUNDLE_FORMAT
    assert [s.name for s in b.plan.segments] == ["seg0_B", "seg1_A", "seg2_B"]
    raw = json.loads((tiny_bundle / MANIFEST).read_text())
    assert Plan.from_json(raw["plan"]) == b.plan
    assert Manifest.from_json(json.loads(json.dumps(m.to_json())), "x") == m  # the JSON form round-trips
    files = {f: sha256(tiny_bundle / f) for f in ("model.onnx", "weights.bin")}
    assert m.model.sha256 == model_digest(files) and all(m.files[f] == h for f, h in files.items())
    assert m.weights and all(w.offset % 64 == 0 for w in m.weights.values())  # the index into weights.bin
    assert m.model.source_sha256 == sha256(tiny_config.parent / "tiny_fp32.onnx")
    assert [t.arch for t in m.targets] == ["sm_90a", "sm_80"]
    assert any("sm_89" in n for n in m.notes)
    assert m.tools["iree-compile"].startswith("IREE compiler version 3.13")
    assert m.cpu_batch == 1
    # Every file but the manifest is listed with its hash.
    assert set(m.files) == set(snapshot(tiny_bundle)) - {MANIFEST}


def test_track_a_ptx_isa_and_min_driver(tiny_bundle: Path) -> None:
    m = Bundle.open(tiny_bundle).manifest
    ptx = m.artifacts.track_a["ptx"]
    assert set(ptx) == {"compute_80", "compute_90a"}
    for ptx_arch, kernels in ptx.items():
        assert set(kernels) == {"conv3x3_nhwc", "maxpool2x2_nhwc"}
        for stem, meta in kernels.items():
            assert (meta["isa"], meta["min_driver"]) == ("9.0", 13000)
            assert meta["target"] == ptx_arch.replace("compute_", "sm_")
            # The bundle ships exactly the checked-in PTX.
            assert (tiny_bundle / meta["path"]).read_bytes() == (
                SOURCE_DIR / "ptx" / ptx_arch / f"{stem}.ptx"
            ).read_bytes()
    assert m.min_driver == 13000


def test_track_a_cubins_for_each_target(tiny_bundle: Path) -> None:
    cubins = Bundle.open(tiny_bundle).manifest.artifacts.track_a["cubin"]
    assert set(cubins) == {"sm_90a", "sm_80"}
    assert {k: v["from"] for k, v in cubins["sm_90a"].items()} == {
        "conv3x3_nhwc": "compute_90a",
        "maxpool2x2_nhwc": "compute_90a",
    }
    assert {v["from"] for v in cubins["sm_80"].values()} == {"compute_80"}
    for per in cubins.values():
        for meta in per.values():
            assert (tiny_bundle / meta["path"]).stat().st_size > 0


def test_iree_modules_for_every_target_and_batch(tiny_bundle: Path) -> None:
    b = Bundle.open(tiny_bundle)
    iree = b.manifest.artifacts.iree
    assert b.iree_targets == ["cuda-sm_80", "cuda-sm_89", "llvm-cpu"]
    for seg in b.plan.segments:
        want = {"llvm-cpu"} if seg.track == "A" else {"cuda-sm_89", "cuda-sm_80", "llvm-cpu"}
        assert set(iree[seg.name]) == want, seg.name
        for target in want:
            # The CPU runs batches image by image through its batch-1 module (track_b.CPU_BATCH).
            batches = (1,) if target == "llvm-cpu" else (1, 4)
            assert set(iree[seg.name][target]) == {str(n) for n in batches}
            for batch in batches:
                path = b.vmfb(seg, target, batch)
                assert path == tiny_bundle / f"iree/{seg.name}/{target}/b{batch}.vmfb" and path.stat().st_size > 0


def test_missing_module_names_what_exists(tiny_bundle: Path) -> None:
    b = Bundle.open(tiny_bundle)
    seg = b.plan.segments[1]
    with pytest.raises(
        BundleError,
        match=r"has no cuda-sm_89 module for seg1_A at batch 1 \(has: llvm-cpu\); add the target or batch size",
    ):
        b.vmfb(seg, "cuda-sm_89", 1)


def test_verify_json_passes(tiny_bundle: Path) -> None:
    report = json.loads((tiny_bundle / "verify.json").read_text())
    assert report["passed"] is True and report["device"] == "cpu" and report["precision"] == "fp32"
    names = [c["name"] for c in report["checks"]]
    assert any(n.startswith("seg1_A[numpy kernels]") for n in names)
    assert any(n.startswith("plan b4 probs") for n in names)
    assert all(c["passed"] for c in report["checks"])
    manifest = Bundle.open(tiny_bundle).manifest
    assert asdict(manifest.verification) == {
        "passed": True,
        "device": "cpu",
        "seed": report["seed"],
        "tolerance": report["tolerance"],  # what the first GPU load and `dualtrack verify` hold it to
    }
    assert manifest.tolerance == report["tolerance"] == {"rel_l2": 1e-4, "max_abs": 1e-3, "mismatch": 1e-4}  # fp32


# --- the cache ----------------------------------------------------------------------------------


def test_second_build_into_a_new_dir_compiles_nothing(tiny_bundle: Path, tiny_config: Path, tmp_path: Path) -> None:
    result = build(tiny_config, tmp_path / "again")
    assert (result.up_to_date, result.compiled, result.cached) == (False, 0, 11)
    assert result.verification is not None and result.verification["passed"]
    # The modules are the cached bytes, so the new bundle's are identical.
    old, new = snapshot(tiny_bundle), snapshot(tmp_path / "again")
    assert {k: v for k, v in new.items() if k.endswith(".vmfb")} == {
        k: v for k, v in old.items() if k.endswith(".vmfb")
    }


def test_second_build_into_the_same_dir_is_up_to_date(bundle_copy: Path, tiny_config: Path) -> None:
    before = snapshot(bundle_copy)
    messages: list[str] = []
    result = build(tiny_config, bundle_copy, progress=messages.append)
    assert (result.up_to_date, result.compiled, result.cached) == (True, 0, 11)
    assert "up to date" in messages and not any(m.startswith("verify") for m in messages)
    assert snapshot(bundle_copy) == before


def test_changing_one_segment_recompiles_only_its_modules(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decoder weight lives only in seg2_B's ONNX: seg0_B's and seg1_A's keys must not move.
    model = onnx.load(str(Path(Bundle.open(tiny_bundle).manifest.model.source)))
    for init in model.graph.initializer:
        if init.name == "dec1/conv2.bias":
            bias = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((bias + np.float32(0.25)).astype(bias.dtype), init.name))
    path = tmp_path / "tiny_changed.onnx"
    onnx.save(model, str(path))

    results: list[track_b.CompileResult] = []
    real = track_b.run_job

    def recording(job, *args, **kwargs):
        r = real(job, *args, **kwargs)
        results.append(r)
        return r

    monkeypatch.setattr(track_b, "run_job", recording)
    result = build(config_variant(tmp_path, path), tmp_path / "changed")
    compiled = sorted((r.job.segment, r.job.target.name, r.job.batch) for r in results if not r.cached)
    assert compiled == [
        *(("seg2_B", target, batch) for target in ("cuda-sm_80", "cuda-sm_89") for batch in (1, 4)),
        ("seg2_B", "llvm-cpu", 1),
    ]
    assert (result.compiled, result.cached) == (5, 6)
    old = [s.key for s in Bundle.open(tiny_bundle).plan.segments]
    new = [s.key for s in Bundle.open(tmp_path / "changed").plan.segments]
    assert new[:2] == old[:2] and new[2] != old[2]


# --- failed builds are atomic ---------------------------------------------------------------------


def test_unknown_iree_flag_fails_without_leaving_anything(tiny_config: Path, tmp_path: Path) -> None:
    cfg = config_variant(
        tmp_path, tiny_config.parent / "tiny_fp32.onnx", "track_b:\n  cuda_flags: [--iree-bogus-flag]\n"
    )
    dest = tmp_path / "bundle"
    with pytest.raises(ConfigError, match=r"iree-compile 3\.13 does not know `--iree-bogus-flag`; remove it"):
        build(cfg, dest)
    assert not dest.exists()
    assert leftovers(dest) == []


def test_failed_verification_leaves_no_directory(tiny_config: Path, tmp_path: Path) -> None:
    # A tolerance no fp32 computation can meet: the bundle is written, verified, refused, removed.
    tight = "  tolerance: {rel_l2: 1.0e-30, max_abs: 1.0e-30, mismatch: 0}\n"
    cfg = config_variant(tmp_path, tiny_config.parent / "tiny_fp32.onnx", tight)
    dest = tmp_path / "bundle"
    with pytest.raises(VerificationError, match=r"checks exceed the fp32 tolerance \(rel_l2 1e-30, max_abs 1e-30"):
        build(cfg, dest)
    assert not dest.exists()
    assert leftovers(dest) == []


def test_good_bundle_survives_failed_rebuilds(bundle_copy: Path, tiny_config: Path, tmp_path: Path) -> None:
    before = snapshot(bundle_copy)
    model = tiny_config.parent / "tiny_fp32.onnx"
    bad_flag = config_variant(tmp_path, model, "track_b:\n  cuda_flags: [--iree-bogus-flag]\n", "flag.yaml")
    with pytest.raises(ConfigError, match=r"--iree-bogus-flag"):
        build(bad_flag, bundle_copy)
    tight = config_variant(
        tmp_path, model, "  tolerance: {rel_l2: 1.0e-30, max_abs: 1.0e-30, mismatch: 0}\n", "tight.yaml"
    )
    with pytest.raises(VerificationError):
        build(tight, bundle_copy, force=True)
    assert snapshot(bundle_copy) == before
    assert leftovers(bundle_copy) == []
    Bundle.open(bundle_copy)


def test_build_without_output_dir(tiny_config: Path) -> None:
    with pytest.raises(BundleError, match=r"^no output directory: pass -o DIR or set `output:` in the config$"):
        build(tiny_config)


# --- Bundle.open refusals -------------------------------------------------------------------------


def test_open_missing_dir(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(
        BundleError, match=rf"^bundle {path} not found; build one with `dualtrack build CONFIG -o {path}`$"
    ):
        Bundle.open(path)


def test_open_dir_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(
        BundleError,
        match=rf"^{tmp_path} has no manifest\.json: not a dualtrack bundle, or its build did not finish; rebuild it$",
    ):
        Bundle.open(tmp_path)


def test_open_corrupt_manifest(bundle_copy: Path) -> None:
    (bundle_copy / MANIFEST).write_text('{"format": 1, "files": {')
    with pytest.raises(
        BundleError, match=rf"^{bundle_copy / MANIFEST} is corrupt \(JSONDecodeError\); rebuild the bundle$"
    ):
        Bundle.open(bundle_copy)


def test_open_truncated_vmfb(bundle_copy: Path) -> None:
    vmfb = bundle_copy / "iree/seg2_B/cuda-sm_89/b4.vmfb"
    vmfb.write_bytes(vmfb.read_bytes()[: vmfb.stat().st_size // 2])
    with pytest.raises(
        BundleError,
        match=rf"^{bundle_copy}: iree/seg2_B/cuda-sm_89/b4\.vmfb does not match its recorded hash "
        r"\(truncated or modified\); rebuild the bundle$",
    ):
        Bundle.open(bundle_copy)
    Bundle.open(bundle_copy, check_hashes=False)  # the escape hatch skips only the hashes


def test_open_missing_listed_file(bundle_copy: Path) -> None:
    (bundle_copy / "segments/seg1_A.onnx").unlink()
    with pytest.raises(
        BundleError, match=rf"^{bundle_copy} is incomplete: segments/seg1_A\.onnx is missing; rebuild the bundle$"
    ):
        Bundle.open(bundle_copy)


@pytest.mark.parametrize("fmt", [99, None])
def test_open_wrong_format(bundle_copy: Path, fmt: int | None) -> None:
    m = json.loads((bundle_copy / MANIFEST).read_text())
    m["format"] = fmt
    (bundle_copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(
        BundleError,
        match=rf"^{bundle_copy} is bundle format {fmt}, this dualtrack reads format {BUNDLE_FORMAT}; rebuild it",
    ):
        Bundle.open(bundle_copy)


def test_open_manifest_that_is_not_an_object(bundle_copy: Path) -> None:
    (bundle_copy / MANIFEST).write_text("[1, 2]")
    with pytest.raises(BundleError, match=rf"is bundle format None, this dualtrack reads format {BUNDLE_FORMAT}"):
        Bundle.open(bundle_copy)


def test_open_refuses_a_model_swapped_in_with_its_file_hash_patched(bundle_copy: Path) -> None:
    """The modules were built from the recorded model: other weights under a patched hash are refused."""
    model = onnx.load(str(bundle_copy / "model.onnx"))  # its weights resolved from weights.bin
    init = model.graph.initializer[-1]
    arr = numpy_helper.to_array(init) + 1
    init.CopyFrom(numpy_helper.from_array(arr.astype(arr.dtype), init.name))
    onnx.save(model, str(bundle_copy / "model.onnx"))  # the weights inline now: weights.bin no longer read
    m = json.loads((bundle_copy / MANIFEST).read_text())
    m["files"]["model.onnx"] = sha256(bundle_copy / "model.onnx")
    (bundle_copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"model\.onnx and weights\.bin are not the model its modules were built"):
        Bundle.open(bundle_copy)


def test_open_refuses_weights_swapped_in_with_their_file_hash_patched(bundle_copy: Path) -> None:
    data = bytearray((bundle_copy / "weights.bin").read_bytes())
    data[-1] ^= 0xFF
    (bundle_copy / "weights.bin").write_bytes(bytes(data))
    m = json.loads((bundle_copy / MANIFEST).read_text())
    m["files"]["weights.bin"] = sha256(bundle_copy / "weights.bin")
    (bundle_copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"are not the model its modules were built from .*rebuild the bundle"):
        Bundle.open(bundle_copy)


def test_check_model(tiny_bundle: Path, tiny_config: Path, tmp_path: Path) -> None:
    b = Bundle.open(tiny_bundle)
    b.check_model(tiny_config.parent / "tiny_fp32.onnx")  # the model it was built from
    other = tmp_path / "other.onnx"
    other.write_bytes((tiny_config.parent / "tiny_fp32.onnx").read_bytes() + b"\0")
    with pytest.raises(
        BundleError,
        match=rf"^{tiny_bundle} was built from another model \(sha256 [0-9a-f]{{12}}, {other} is [0-9a-f]{{12}}\); "
        rf"rebuild the bundle from {other}$",
    ):
        b.check_model(other)


def test_whole_body_on_track_a_builds_and_verifies(tiny_full_bundle: Path) -> None:
    """Encoder, bottleneck and decoder as kernels (fp16): up-convolutions and concat aliases included,
    checked at build time against onnxruntime through the kernels' numpy semantics."""
    b = Bundle.open(tiny_full_bundle)
    seg = next(s for s in b.plan.segments if s.track == "A")
    assert {c.op for c in seg.calls} == {"conv3x3", "maxpool2x2", "convt2x2", "concat"}
    # conv3x3_wgmma: the sm_90a target only (its C=8 and C=16 convs; tests/test_wgmma.py)
    assert b.track_a["kernels"] == ["conv3x3_nhwc", "conv3x3_wgmma", "convt2x2_nhwc", "maxpool2x2_nhwc"]
    assert sorted(b.track_a["ptx"]["compute_80"]) == ["conv3x3_nhwc", "convt2x2_nhwc", "maxpool2x2_nhwc"]
    report = json.loads((tiny_full_bundle / "verify.json").read_text())
    assert report["passed"] and report["precision"] == "fp16"
    interpreted = [c for c in report["checks"] if "[numpy kernels]" in c["name"]]
    assert interpreted and all(c["rel_l2"] <= 2e-2 for c in interpreted)


def test_directories_of_killed_builds_are_swept(tiny_config: Path, tmp_path: Path) -> None:
    """A build killed mid-write leaves `.NAME.tmp-PID-*`; the next build removes it, but not the
    directory of a build that is still running (its pid is alive)."""
    dest = tmp_path / "bundle"
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = tmp_path / f".bundle.tmp-{dead.pid}-deadbeef"
    (abandoned / "iree").mkdir(parents=True)
    running = tmp_path / f".bundle.tmp-{os.getpid()}-cafef00d"
    running.mkdir()
    build(tiny_config, dest)
    assert not abandoned.exists()
    assert running.exists()
    assert (dest / "manifest.json").is_file()


def test_any_onnx_model_builds_and_verifies(tmp_path: Path) -> None:
    """Not the U-Net: a float32 NCHW Conv/Relu/Conv/Sigmoid graph with unnamed nodes, its second
    conv on Track A, everything else through IREE; built, verified and run against onnxruntime."""
    from onnx import TensorProto, helper

    from dualtrack.runtime.engine import Engine

    rng = np.random.default_rng()
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 8, 3, 3)).astype(np.float32) * 0.2, "w2")
    b2 = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("Conv", ["h2", "w2", "b2"], ["h3"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("Sigmoid", ["h3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 32, 32])],
        [w1, w2, b2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "c.yaml").write_text(
        "model: m.onnx\nprecision: fp32\nbatch_sizes: [1, 2]\ntargets: [sm_80]\n"
        "partition:\n  mode: rules\n  track_a:\n    name_prefixes: [Conv_2]\n"
    )
    result = build(tmp_path / "c.yaml", tmp_path / "bundle")
    assert result.verification is not None and result.verification["passed"]
    plan = Bundle.open(tmp_path / "bundle").plan
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    assert [c.op for c in plan.segments[1].calls] == ["conv3x3"]
    x = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    ref = onnxruntime_run(tmp_path / "m.onnx", x)
    with Engine.load(tmp_path / "bundle", "cpu") as engine:
        got = engine.run(x)["y"]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def onnxruntime_run(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
