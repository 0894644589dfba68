"""Several input sizes per bundle (config `sizes`, issue 40), build side: the size rules as pure functions, the
config's refusals, the spatial re-shaping of a small conv net (not a zoo model; tests/sized_net.py) with a Resize
freed and a baked spatial Reshape or an odd size refused in one line naming the node, and a bundle built for two
non-square sizes on the CPU (IREE llvm-cpu) holding a verified plan per size and the weights once.

The engine's side (padding, cropping, onnxruntime on the padded input) is tests/test_sizes_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from sized_net import CLASSES, SIZES, conv_net, write_config

from dualtrack.compiler import spatial
from dualtrack.compiler.config import BuildConfig, load_config
from dualtrack.contract import sizes
from dualtrack.contract.bundle import Bundle
from dualtrack.errors import ConfigError, ModelError


@pytest.fixture(scope="module")
def sized_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualtrack.compiler.build import build

    root = tmp_path_factory.mktemp("sizes")
    cfg = write_config(root, conv_net(), f"sizes: {json.dumps([list(s) for s in SIZES])}\n")
    out = root / "bundle"
    build(cfg, out)
    return out


# --- the rules, as pure functions -----------------------------------------------------------------


def test_an_image_runs_at_the_smallest_size_that_holds_it() -> None:
    assert sizes.choose((37, 50), SIZES) == sizes.Choice("fits", (40, 56), (37, 50))
    assert sizes.choose((41, 20), SIZES).size == (64, 48)  # too tall for 40x56
    assert sizes.choose((40, 56), SIZES) == sizes.Choice("fits", (40, 56), (40, 56))
    assert not sizes.choose((40, 56), SIZES).padded
    assert sizes.choose((65, 10), SIZES) == sizes.Choice("resize", (64, 48), (65, 10))
    assert sizes.choose((30, 57), SIZES, window=True).mode == "window"


def test_a_range_compiles_min_opt_max_and_doublings_between() -> None:
    assert sizes.range_sizes((32, 32), (64, 64), (200, 300)) == (
        (32, 32),
        (64, 64),
        (128, 128),
        (200, 256),
        (200, 300),
    )
    assert sizes.range_sizes((64, 64), (64, 64), (64, 64)) == ((64, 64),)


def test_pad_repeats_the_edge_and_crop_takes_the_image_back() -> None:
    x = np.random.default_rng(1).integers(0, 255, (2, 5, 7, 3), dtype=np.uint8)
    p = sizes.pad_to(x, (8, 9))
    assert p.shape == (2, 8, 9, 3)
    np.testing.assert_array_equal(p[:, :5, :7], x)
    np.testing.assert_array_equal(p[:, 5:, :7], np.repeat(x[:, 4:5], 3, axis=1))
    np.testing.assert_array_equal(p[:, :5, 7:], np.repeat(x[:, :, 6:7], 2, axis=2))
    np.testing.assert_array_equal(sizes.crop_to(p.transpose(0, 3, 1, 2), (8, 9), (5, 7)), x.transpose(0, 3, 1, 2))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], r"sizes is empty"),
        ([[0, 4]], r"both positive"),
        ({"min": [64, 64], "opt": [32, 32], "max": [128, 128]}, r"min \[64, 64\] <= opt \[32, 32\]"),
    ],
)
def test_bad_sizes_are_refused_with_the_fix(tmp_path: Path, value: object, match: str) -> None:
    cfg = write_config(tmp_path, conv_net(), f"sizes: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(cfg)


def test_sizes_need_an_image_input() -> None:
    with pytest.raises(ValueError, match=r"use `batch: images` or drop `sizes`"):
        BuildConfig.model_validate({"model": "m.onnx", "batch": "fixed", "sizes": [[32, 32]]})
    with pytest.raises(
        ModelError, match=r"^`sizes` needs an \(N, H, W, 3\) image input; 'x' is not one: add `preprocess`"
    ):
        spatial.image_size(conv_net())


# --- the compiler ---------------------------------------------------------------------------------


def _wrapped(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    from dualtrack.compiler import frontend

    cfg = load_config(write_config(tmp_path, model, "sizes: [[40, 56]]\n"))
    return frontend.prepare(cfg).model


def test_the_resize_to_constant_sizes_is_freed_and_every_shape_follows(tmp_path: Path) -> None:
    raw, freed = spatial.free_sizes(conv_net())  # the front end frees sizes that hold the batch itself
    assert freed == ["up"]
    (up,) = [n for n in raw.graph.node if n.name == "up"]
    scales = {i.name: numpy_helper.to_array(i) for i in raw.graph.initializer}[up.input[2]]
    np.testing.assert_array_equal(scales, [1, 1, 2, 2])
    assert len(up.input) == 3
    model, _ = spatial.free_sizes(_wrapped(conv_net(), tmp_path))
    sized = spatial.at_size(model, (40, 56))
    shapes = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim][1:] for o in sized.graph.output}
    assert shapes == {"mask": [40, 56], "probs": [CLASSES, 40, 56]}
    assert spatial.image_size(sized) == (40, 56)


def test_a_baked_spatial_reshape_is_refused_in_one_line(tmp_path: Path) -> None:
    model, _ = spatial.free_sizes(_wrapped(conv_net(baked_reshape=True), tmp_path))
    with pytest.raises(ModelError) as err:
        spatial.at_size(model, (40, 56))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("Reshape 'flatten_hw' cannot take 40x56: it writes the export's spatial size 1024")
    assert "export the model with dynamic height and width" in text


def test_a_size_the_strides_do_not_divide_is_refused_naming_the_node(tmp_path: Path) -> None:
    model, _ = spatial.free_sizes(_wrapped(conv_net(), tmp_path))
    with pytest.raises(ModelError, match=r"^Add 'skip' cannot take 41x56: .*multiples of its total stride"):
        spatial.at_size(model, (41, 56))


# --- the bundle and the engine --------------------------------------------------------------------


def test_the_bundle_holds_one_verified_plan_per_size_and_the_weights_once(sized_bundle: Path) -> None:
    b = Bundle.open(sized_bundle)
    assert b.sizes == SIZES
    assert b.size == (64, 48)  # the largest by area leads
    (entry,) = b.manifest.sizes
    assert (entry.height, entry.width) == (40, 56)
    assert entry.verification is not None and entry.verification.passed
    assert b.manifest.verification is not None and b.manifest.verification.passed
    assert [f for f in b.manifest.files if f.endswith("weights.bin")] == ["weights.bin"]
    small = b.at_size((40, 56))
    assert small.manifest.build_key != b.manifest.build_key  # the first GPU load's records are per size
    assert b.at_size((64, 48)) is b
    assert small.plan.inputs[0].shape == (1, 40, 56, 3)
    assert all(s.onnx.startswith("sizes/40x56/") for s in small.plan.segments)
    assert {s.track for s in small.plan.segments} == {"A", "B"}


def test_tune_reads_every_size_plan(sized_bundle: Path, tmp_path: Path) -> None:
    """`dualtrack tune` tunes every size's conv layers (a record is keyed by the layer's shape)."""
    from dualtrack.tuning.tiles import load_plans

    cfg = write_config(tmp_path, conv_net(), f"sizes: {json.dumps([list(s) for s in SIZES])}\n")
    for source in (cfg, sized_bundle):
        assert sorted(p.inputs[0].shape[1:3] for p in load_plans(source)) == sorted(SIZES)
