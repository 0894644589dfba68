"""The `dualtrack` command through click's CliRunner (and once as a real process): summaries,
`info`, `run`, `verify`, `doctor`, and every bad input as one `error: ` line with its exit code."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import uvicorn
from click.testing import CliRunner, Result
from onnx import helper
from PIL import Image

from dualtrack.cli import main
from dualtrack.contract.manifest import BUNDLE_FORMAT
from dualtrack.errors import (
    EXIT_CODES,
    ArchError,
    BundleError,
    ConfigError,
    DeviceError,
    InputError,
    ModelError,
    PartitionError,
)
from dualtrack.runtime.engine import Engine
from dualtrack.serve import app as app_module
from dualtrack.serve.options import ServeOptions

TINY_YAML = Path(__file__).parent / "data" / "tiny.yaml"


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_error(result: Result, exit_code: int, pattern: str) -> str:
    """One `error: ` line, last on stderr (after any `- ` progress lines), nothing on stdout, no traceback."""
    assert result.exit_code == exit_code, (result.exit_code, result.stderr, result.exception)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("error: "), lines
    assert all(line.startswith("- ") for line in lines[:-1]), lines
    assert "Traceback" not in result.stderr
    assert re.search(pattern, lines[-1]), lines[-1]
    return lines[-1]


def tiny_variant(tmp_path: Path, model: Path, extra: str = "", replace: tuple[str, str] | None = None) -> Path:
    text = TINY_YAML.read_text().replace("model: tiny_fp32.onnx", f"model: {model}")
    if replace is not None:
        assert replace[0] in text
        text = text.replace(*replace)
    path = tmp_path / "variant.yaml"
    path.write_text(text + extra)
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny_config: Path) -> Path:
    return tiny_config.parent / "tiny_fp32.onnx"


@pytest.fixture
def image_png(tmp_path: Path) -> tuple[Path, np.ndarray]:
    x = np.random.default_rng().integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    path = tmp_path / "image.png"
    Image.fromarray(x).save(path)
    return path, x


# --- commands that work -------------------------------------------------------------------------


def test_help_lists_the_exit_codes() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())  # click wraps the epilog
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {' '.join(meaning.split())}" in text, (code, meaning)
    for command in ("build", "run", "verify", "info", "doctor"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command


def test_build_prints_a_one_line_summary(tiny_bundle: Path, tiny_config: Path, tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    result = invoke("build", tiny_config, "-o", dest)
    assert result.exit_code == 0, result.stderr
    assert re.fullmatch(
        rf"{re.escape(str(dest))}: built in \d+\.\d s \(0 modules compiled, 11 from cache\); verification passed\n",
        result.stdout,
    ), result.stdout
    assert "- note: sm_90a: Track B: sm_89" in result.stderr

    again = invoke("build", tiny_config, "-o", dest)
    assert again.exit_code == 0
    assert re.fullmatch(
        rf"{re.escape(str(dest))}: up to date, nothing compiled \(11 modules unchanged\) in \d+\.\d s\n", again.stdout
    )


def test_build_json(tiny_bundle: Path, tiny_config: Path, tmp_path: Path) -> None:
    result = invoke("build", tiny_config, "-o", tmp_path / "bundle", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    out = json.loads(result.stdout)
    assert (out["compiled"], out["cached"], out["up_to_date"], out["verification_passed"]) == (0, 11, False, True)


def test_info(tiny_bundle: Path) -> None:
    result = invoke("info", tiny_bundle)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"bundle     {tiny_bundle}  (format {BUNDLE_FORMAT}, dualtrack ")
    assert "precision  fp32; batch sizes [1, 4]" in out
    assert "target     sm_90a (cc 9.0): Track A compute_90a -> sm_90a cubin; Track B IREE sm_89" in out
    assert "segment    seg1_A: 14 nodes, 8 kernel calls" in out
    assert "ptx        compute_80: conv3x3_nhwc, maxpool2x2_nhwc (ISA 9.0)" in out
    assert "driver     needs CUDA 13.0 or newer for the PTX" in out
    assert "iree       targets cuda-sm_80, cuda-sm_89, llvm-cpu" in out
    assert re.search(r"^cpu        llvm-cpu modules for (x86-64(-v\d)?|host) \(batch 1\)$", out, re.MULTILINE)
    assert re.search(r"^verified   passed on cpu \(seed \d+\)$", out, re.MULTILINE)
    # Which path each Track B module takes on a GPU: its launch plan replayed, for every target and batch.
    for seg in ("seg0_B", "seg2_B"):
        for target in ("cuda-sm_80", "cuda-sm_89"):
            replayed = "replayed on the engine's stream"
            assert f"track B    {seg} {target}: N=1: {replayed}; N=4: {replayed}" in out


def test_info_shows_which_convs_run_the_wgmma_kernel(tiny_full_bundle: Path) -> None:
    result = invoke("info", tiny_full_bundle)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    # base-4 U-Net: the convs with C a multiple of 8 (6 of 10 layers; dec1/conv1's 4-channel output is a buffer of
    # its own, laid out 8 channels apart: contract.plan.padded_channels), both batch sizes; the rest have C <= 4
    # and run the small-C entry
    assert "conv3x3    sm_90a: 12 of 20 launches on the wgmma kernel, the rest on direct" in out
    assert re.search(
        r"^             enc1/conv1: direct f16_smallc \(C=3 <= 4: small-C direct conv; wgmma: C=3: ", out, re.M
    )
    assert re.search(r"^             dec1/conv1: bn16_mt2_wg2_bk16_h16$", out, re.MULTILINE)
    assert re.search(r"^             mid/conv2: bn16_mt2_wg2_bk16_h16$", out, re.MULTILINE)  # few channels: 16-wide
    assert "conv3x3    sm_80" not in out


def test_info_json(tiny_bundle: Path) -> None:
    result = invoke("info", "--json", tiny_bundle)
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert "files" not in m
    assert [s["index"] for s in m["plan"]["segments"]] == [0, 1, 2]
    assert m["min_driver"] == 13000 and m["verification"]["passed"] is True


def test_run_writes_the_engines_mask(tiny_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    path, x = image_png
    out = tmp_path / "mask.png"
    result = invoke("run", tiny_bundle, path, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert re.fullmatch(
        rf"{re.escape(str(out))}: mask 64x64, class pixels \[\d+, \d+\], "
        r"[\d.]+ ms on cpu \(track A [\d.]+ ms, track B [\d.]+ ms\)\n",
        result.stdout,
    ), result.stdout
    written = np.asarray(Image.open(out))
    with Engine.load(tiny_bundle, "cpu") as engine:
        want = engine.run(x[None])["mask"][0].astype(np.uint8)
    assert written.dtype == np.uint8 and written.shape == (64, 64)
    np.testing.assert_array_equal(written, want)
    assert not list(tmp_path.glob(".mask.png.tmp"))


def test_run_resizes_the_mask_back_to_the_image(tiny_bundle: Path, tmp_path: Path) -> None:
    img = tmp_path / "wide.png"
    Image.fromarray(np.random.default_rng().integers(0, 256, size=(40, 100, 3), dtype=np.uint8)).save(img)
    result = invoke("run", tiny_bundle, img, "-o", tmp_path / "mask.png")
    assert result.exit_code == 0, result.stderr
    assert Image.open(tmp_path / "mask.png").size == (100, 40)


def test_serve_hands_its_options_to_the_app(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` builds one ServeOptions from the option table (the others at their defaults) and hands
    it, with --jpeg-decoder, to create_app; uvicorn is not started."""
    built: list[tuple[dict[str, Any], Any]] = []
    real_create_app = app_module.create_app

    def create_app(source: Any, **kwargs: Any) -> Any:
        app = real_create_app(source, **kwargs)
        built.append((kwargs, app))
        return app

    monkeypatch.setattr(app_module, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **server: None)
    result = invoke("serve", tiny_bundle, "--jpeg-decoder", "cpu", "--max-queue", "7", "--image-threads", "2")
    assert result.exit_code == 0, (result.stderr, result.exception)
    [(kwargs, app)] = built
    assert kwargs.pop("jpeg_decoder") == "cpu"
    assert ServeOptions(**kwargs) == ServeOptions(max_queue=7, image_threads=2) == app.state.options
    assert "2 image threads" in result.stderr


def test_verify_passes(tiny_bundle: Path) -> None:
    result = invoke("verify", tiny_bundle)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("ok   ") for line in lines[:-1]), lines
    assert re.fullmatch(rf"all {len(lines) - 1} checks passed on cpu \(seed \d+\)", lines[-1])


def test_verify_json(tiny_bundle: Path) -> None:
    result = invoke("verify", tiny_bundle, "--json", "--seed", "7", "--samples", "2")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["seed"] == 7
    assert any(c["name"].endswith("#1") for c in report["checks"])


def test_doctor_json_reports_no_gpu() -> None:
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    if not report["gpu"].startswith("none: "):
        pytest.skip(f"a GPU is present: {report['gpu']}")
    assert "run with --device cpu or on a GPU machine" in report["gpu"]
    assert report["iree-compile"].startswith("IREE compiler version 3.13")
    assert "sm_89" in report["iree_cuda_targets"]


def test_doctor_with_bundle(tiny_bundle: Path) -> None:
    result = invoke("doctor", "--json", "--bundle", tiny_bundle)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    if report["gpu"].startswith("none: "):
        assert report["bundle"] == "Track A PTX compute_80, compute_90a; no GPU here to check against"


# --- bad inputs: one line, documented exit code -------------------------------------------------


def test_malformed_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: m.onnx\ntargets: [sm_90a\nbatch_sizes: [1]\n")
    line = assert_error(invoke("build", cfg, "-o", tmp_path / "b"), ConfigError.exit_code, r"invalid YAML")
    assert line.startswith(f"error: {cfg}:3:12: ")
    assert len(invoke("build", cfg).stderr.splitlines()) == 1


def test_unknown_key(tiny_model: Path, tmp_path: Path) -> None:
    cfg = tiny_variant(tmp_path, tiny_model, "batch_size: [2]\n")
    assert_error(
        invoke("build", cfg, "-o", tmp_path / "b"), 2, r"unknown key `batch_size`; did you mean `batch_sizes`\?$"
    )


def test_missing_model_file(tmp_path: Path) -> None:
    cfg = tiny_variant(tmp_path, tmp_path / "missing.onnx")
    assert_error(
        invoke("build", cfg, "-o", tmp_path / "b"),
        ModelError.exit_code,
        rf"model file {tmp_path}/missing\.onnx not found",
    )


def test_onnx_file_of_garbage(tmp_path: Path) -> None:
    model = tmp_path / "garbage.onnx"
    model.write_bytes(b"\x08\x07garbage, not protobuf\xff\xfe" * 4)
    cfg = tiny_variant(tmp_path, model)
    assert_error(invoke("build", cfg, "-o", tmp_path / "b"), 3, r"is not a readable ONNX model")


def test_onnx_graph_failing_the_checker(tiny_model: Path, tmp_path: Path) -> None:
    model = onnx.load(str(tiny_model))
    model.graph.node[3].input[0] = "nowhere"
    path = tmp_path / "broken.onnx"
    onnx.save(model, str(path))
    assert_error(invoke("build", tiny_variant(tmp_path, path), "-o", tmp_path / "b"), 3, r"fails the ONNX checker")


def test_op_no_track_can_take(tiny_model: Path, tmp_path: Path) -> None:
    model = onnx.load(str(tiny_model))
    custom = copy.deepcopy(model)
    for node in custom.graph.node:
        if node.name == "post/softmax":
            node.domain, node.op_type = "com.acme", "FastSoftmax"
    custom.opset_import.append(helper.make_opsetid("com.acme", 1))
    path = tmp_path / "custom.onnx"
    onnx.save(custom, str(path))
    assert_error(
        invoke("build", tiny_variant(tmp_path, path), "-o", tmp_path / "b"),
        PartitionError.exit_code,
        r"node 'post/softmax' is op com\.acme::FastSoftmax, which no track can take",
    )


def test_partition_naming_nodes_that_do_not_exist(tiny_model: Path, tmp_path: Path) -> None:
    cfg = tiny_variant(
        tmp_path, tiny_model, replace=("name_prefixes: [enc, mid/]", "name_prefixes: [encoder/, bottleneck/]")
    )
    assert_error(invoke("build", cfg, "-o", tmp_path / "b"), 4, r"'encoder/' matches no node of the model")


def test_arch_no_toolchain_can_target(tiny_model: Path, tmp_path: Path) -> None:
    cfg = tiny_variant(tmp_path, tiny_model, replace=("targets: [sm_90a, sm_80]", "targets: [sm_95]"))
    assert_error(
        invoke("build", cfg, "-o", tmp_path / "b"),
        ArchError.exit_code,
        r"'sm_95' is not an architecture dualtrack can target",
    )
    assert not (tmp_path / "b").exists()


def test_truncated_bundle_at_load(tiny_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    vmfb = bundle / "iree/seg1_A/llvm-cpu/b1.vmfb"
    vmfb.write_bytes(vmfb.read_bytes()[:100])
    pattern = r"iree/seg1_A/llvm-cpu/b1\.vmfb does not match its recorded hash \(truncated or modified\)"
    assert_error(invoke("run", bundle, image_png[0], "-o", tmp_path / "m.png"), BundleError.exit_code, pattern)
    assert_error(invoke("info", bundle), 8, pattern)
    assert not (tmp_path / "m.png").exists()


def test_corrupt_manifest_at_load(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    (bundle / "manifest.json").write_bytes(b"\xff\xfe not json")
    assert_error(invoke("verify", bundle), 8, r"manifest\.json is corrupt \(UnicodeDecodeError\); rebuild the bundle$")


def test_run_with_a_text_file_as_image(tiny_bundle: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("this is not an image\n")
    assert_error(
        invoke("run", tiny_bundle, text, "-o", tmp_path / "m.png"),
        InputError.exit_code,
        rf"{re.escape(str(text))} is not an image Pillow can read \(UnidentifiedImageError\); pass a PNG or JPEG$",
    )


def test_run_with_a_missing_image(tiny_bundle: Path, tmp_path: Path) -> None:
    assert_error(
        invoke("run", tiny_bundle, tmp_path / "nope.png", "-o", tmp_path / "m.png"), 10, r"image .*nope\.png not found$"
    )


def test_run_on_cuda_without_gpu(tiny_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    if not json.loads(invoke("doctor", "--json").stdout)["gpu"].startswith("none: "):
        pytest.skip("a GPU is present: this test checks the no-GPU error")
    assert_error(
        invoke("run", "--device", "cuda", tiny_bundle, image_png[0], "-o", tmp_path / "m.png"),
        DeviceError.exit_code,
        r"^error: no NVIDIA GPU .*run with --device cpu or on a GPU machine$",
    )


# --- the installed console script, end to end ---------------------------------------------------


def test_console_script_exit_code_and_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "dualtrack"
    if not script.exists():
        found = shutil.which("dualtrack")
        if found is None:
            pytest.skip("the dualtrack console script is not installed (pip install -e .)")
        script = Path(found)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: m.onnx\nbatch_size: [1]\n")
    proc = subprocess.run([str(script), "build", str(cfg)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == ConfigError.exit_code
    assert proc.stdout == ""
    assert proc.stderr == f"error: {cfg}:2: unknown key `batch_size`; did you mean `batch_sizes`?\n"


# --- tuning ----------------------------------------------------------------------------------------


def test_tune_without_a_gpu_is_one_device_error_line(tiny_full_config: Path, tmp_path: Path) -> None:
    if not json.loads(invoke("doctor", "--json").stdout)["gpu"].startswith("none: "):
        pytest.skip("a GPU is present: this test checks the no-GPU error (tests/gpu tunes for real)")
    out = tmp_path / "tuning.json"
    assert_error(
        invoke("tune", tiny_full_config, "-o", out, "--batch", "1", "--max-configs", "4"),
        DeviceError.exit_code,
        r"^error: dualtrack tune times kernels on a GPU: no NVIDIA GPU or driver found \(libcuda\.so\.1 not "
        r"loadable\); run it on the GPU machine and build with its file \(`dualtrack build CONFIG --tuning FILE`\)$",
    )
    assert not out.exists()


def test_tune_with_nothing_to_tune(tiny_config: Path, tiny_full_config: Path) -> None:
    # tiny.yaml is fp32: its convolutions have one entry each.
    assert_error(invoke("tune", tiny_config), ConfigError.exit_code, r"no fp16 Track A conv3x3 layer to tune")
    assert_error(
        invoke("tune", tiny_full_config, "--layers", "head*"), ConfigError.exit_code, r"layer matching 'head\*'"
    )
    assert_error(invoke("tune", tiny_full_config, "--iters", "0"), ConfigError.exit_code, r"--iters 0")


@pytest.mark.parametrize("content", [None, "[]", '{"schema": "dualtrack-tuning", "version": 1, "records": [{}]}'])
def test_build_with_a_missing_or_malformed_tuning_file(
    tiny_full_config: Path, tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "tuning.json"
    if content is not None:
        path.write_text(content)
    line = assert_error(
        invoke("build", tiny_full_config, "-o", tmp_path / "b", "--tuning", path),
        ConfigError.exit_code,
        rf"{re.escape(str(path))}.*re-run `dualtrack tune CONFIG -o ",
    )
    assert "not found" in line if content is None else "not found" not in line
    assert not (tmp_path / "b").exists()


def test_info_shows_the_tuned_layers(tiny_tuned_bundle: Path) -> None:
    result = invoke("info", tiny_tuned_bundle)
    assert result.exit_code == 0, result.stderr
    assert re.search(
        r"^tuned      sm_90a: 12 conv launches \(6 layers\) on tuned tiles, 3 extra entries; "
        r"tuned on NVIDIA H200 \(driver 13\.0\)$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout
    assert re.search(r"^             mid/conv1: N=1: f16_t64x32x32_w2x2_s4_b4, N=4: ", result.stdout, re.MULTILINE)
    # The 4 layers with C <= 4 run the small-C entry: their records (the file has one for every
    # problem) are not used.
    assert not re.search(r"^             (enc1/conv[12]|enc2/conv1|dec1/conv2): N=", result.stdout, re.MULTILINE)


# --- `run`: what the image and the bundle must be -----------------------------------------------


def _tiny_variant_bundle(tiny_model: Path, root: Path, name: str, surgery: Callable[[onnx.ModelProto], str]) -> Path:
    """Build the tiny U-Net after ``surgery`` (which edits the graph and returns the config's `input:`)."""
    from dualtrack.compiler.build import build

    model = onnx.load(str(tiny_model))
    input_line = surgery(model)
    onnx.checker.check_model(model, full_check=True)
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / f"{name}.onnx"))
    config = root / f"{name}.yaml"
    config.write_text(
        f"model: {name}.onnx\nprecision: fp32\n{input_line}\nbatch_sizes: [1]\ntargets: [sm_80]\n"
        "partition: iree\nverify:\n  samples: 1\n"
    )
    build(config, root / "bundle")
    return root / "bundle"


def _drop_mask(model: onnx.ModelProto) -> str:
    """The U-Net without post/argmax and `mask`: it outputs `probs` only."""
    keep = [n for n in model.graph.node if n.name not in ("post/argmax", "mask")]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    outputs = [o for o in model.graph.output if o.name != "mask"]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    return "input: {name: image, shape: [1, 64, 64, 3], dtype: uint8}"


def _drop_preprocessing(model: onnx.ModelProto) -> str:
    """The U-Net without pre/: it takes a normalised float32 NCHW tensor `x`."""
    first = next(n for n in model.graph.node if n.name.startswith("enc1/conv1"))
    normalised = first.input[0]
    keep = [n for n in model.graph.node if not n.name.startswith("pre/")]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    for node in model.graph.node:
        node.input[:] = ["x" if name == normalised else name for name in node.input]
    weights = [i for i in model.graph.initializer if not i.name.startswith("pre/")]
    del model.graph.initializer[:]
    model.graph.initializer.extend(weights)
    del model.graph.input[:]
    model.graph.input.append(helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 64, 64]))
    return "input: {name: x, shape: [1, 3, 64, 64], dtype: float32}"


@pytest.fixture(scope="module")
def no_mask_bundle(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_variant_bundle(tiny_model, tmp_path_factory.mktemp("no_mask"), "no_mask", _drop_mask)


@pytest.fixture(scope="module")
def tensor_bundle(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_variant_bundle(tiny_model, tmp_path_factory.mktemp("tensor"), "tensor", _drop_preprocessing)


def test_run_refuses_a_bundle_without_a_mask_output(
    no_mask_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    assert_error(
        invoke("run", no_mask_bundle, image_png[0], "-o", tmp_path / "m.png"),
        InputError.exit_code,
        r"'s outputs are probs \(n, 2, 64, 64\) float32; build it with `postprocess:` in the config so it "
        r"outputs a mask$",
    )
    assert list(tmp_path.iterdir()) == [image_png[0]]  # nothing written, not even a temporary file


def test_run_refuses_a_bundle_whose_input_is_not_an_image(
    tensor_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    assert_error(
        invoke("run", tensor_bundle, image_png[0], "-o", tmp_path / "m.png"),
        InputError.exit_code,
        rf"^error: bundle {re.escape(str(tensor_bundle))} takes \(n, 3, 64, 64\) float32, not an image; "
        r"add `preprocess:` to the config to build an image model$",
    )
    assert list(tmp_path.iterdir()) == [image_png[0]]


def test_run_refuses_an_output_folder_that_does_not_exist(
    tiny_bundle: Path, image_png: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "such"
    assert_error(
        invoke("run", tiny_bundle, image_png[0], "-o", missing / "m.png"),
        InputError.exit_code,
        rf"folder {re.escape(str(missing))} does not exist; create the folder first \(mkdir -p ",
    )
    assert not (tmp_path / "no").exists()  # refused, not created
    assert_error(invoke("run", tiny_bundle, image_png[0], "-o", tmp_path), 10, r"is a folder; pass a file path")


def test_run_refuses_a_decompression_bomb_before_decoding_it(tiny_bundle: Path, tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.png"
    Image.new("L", (9000, 8000)).save(bomb)  # 72 megapixels in 70 KB
    assert bomb.stat().st_size < 200_000
    assert_error(
        invoke("run", tiny_bundle, bomb, "-o", tmp_path / "m.png"),
        InputError.exit_code,
        rf"^error: {re.escape(str(bomb))} is 9000x8000 = 72000000 pixels, over the limit of 67108864 "
        r"\(64 megapixels\): downscale it first$",
    )
    assert not (tmp_path / "m.png").exists()


def test_run_refuses_an_animated_png(tiny_bundle: Path, tmp_path: Path) -> None:
    frames = [Image.new("RGB", (64, 64), (i * 80, 0, 0)) for i in range(3)]
    anim = tmp_path / "anim.png"
    frames[0].save(anim, save_all=True, append_images=frames[1:])
    assert_error(
        invoke("run", tiny_bundle, anim, "-o", tmp_path / "m.png"),
        InputError.exit_code,
        r"anim\.png is an animated PNG of 3 frames; dualtrack segments one still picture",
    )


def test_run_reads_a_16_bit_rotated_png_by_the_imaging_rules(tiny_bundle: Path, tmp_path: Path) -> None:
    from test_imaging import raw_png

    samples = np.random.default_rng().integers(0, 65536, (40, 64, 3), dtype=np.uint16)
    image = tmp_path / "deep.png"
    # 48-bit, displayed turned a quarter counter-clockwise (EXIF 8): 40 wide, 64 high.
    image.write_bytes(raw_png(samples, color_type=2, orientation=8))
    result = invoke("run", tiny_bundle, image, "-o", tmp_path / "m.png")
    assert result.exit_code == 0, result.stderr
    assert "mask 40x64," in result.stdout
    upright = np.ascontiguousarray(np.rot90((samples >> 8).astype(np.uint8), k=1))  # the reference, in numpy
    x = np.asarray(Image.fromarray(upright).resize((64, 64), Image.Resampling.BILINEAR))
    with Engine.load(tiny_bundle, "cpu") as engine:
        mask = engine.run(x[None])["mask"][0].astype(np.uint8)
    want = np.asarray(Image.fromarray(mask).resize((40, 64), Image.Resampling.NEAREST))
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "m.png")), want)
