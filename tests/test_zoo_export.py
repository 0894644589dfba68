"""The model zoo (models/zoo/export.py): each entry exports with the zoo's interface, onnxruntime agrees with torch
on fresh random images, and two exports are byte-identical (an entry of each library and exporter). Skipped where
the `zoo` extra is not installed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from zoo import EXPORT_BEYOND_CI, beyond_ci, in_ci, load_export, shared_export

# fp32 both sides; only summation order and the exporter's batch-norm folding differ. 1e-4 was too thin:
# smp MAnet's position attention (a softmax over all 4096 positions) reached 1.05e-4 on one fresh image
# (seed 3067276296, December 2026); an export that computes something else is off by orders more.
REL_L2 = 3e-4

zoo = load_export()
torch = zoo.torch
NAMES = list(zoo.ZOO)
EXPORTED = [n for n in NAMES if not beyond_ci(n, EXPORT_BEYOND_CI)]
# Exported a second time for the byte-for-byte check: the first entry of each library (its name's prefix) and
# exporter, not all of them (an export takes 5 to 40 s on CI's cores; the code that makes one deterministic is
# the library's and the exporter's, not the entry's).
TWICE = list({(zoo.ZOO[n].exporter, n.split("_")[0]): n for n in reversed(EXPORTED)}.values())[::-1]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path]:
    """Every entry exported at its smallest side of 64 or more (the run's shared exports, which the corpus
    builds read too), and TWICE's again into a folder of this module's own."""
    first = {name: shared_export(name, zoo.small_size(name)) for name in EXPORTED}
    second = tmp_path_factory.mktemp("zoo_b")
    for name in TWICE:
        zoo.export_model(name, second, zoo.small_size(name))
    return first, second


@pytest.mark.parametrize("name", in_ci(NAMES, EXPORT_BEYOND_CI))
def test_export_has_the_zoo_interface(exports: tuple[dict[str, Path], Path], name: str) -> None:
    model = onnx.load(str(exports[0][name]))
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*model.graph.input, *model.graph.output)]
    assert [i.name for i in model.graph.input] == ["image"]
    assert [o.name for o in model.graph.output] == ["logits"]
    size = zoo.small_size(name)
    assert dims == [[1, 3, *size], [1, 2, *size]]
    opset = {o.domain: o.version for o in model.opset_import}[""]
    assert opset == zoo.ZOO[name].opset if zoo.ZOO[name].opset is not None else opset >= 17  # None: dynamo's own


@pytest.mark.parametrize("name", in_ci(NAMES, EXPORT_BEYOND_CI))
def test_onnxruntime_matches_torch_on_a_fresh_image(exports: tuple[dict[str, Path], Path], name: str) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    size = zoo.small_size(name)
    image = np.random.default_rng(seed).standard_normal((1, 3, *size), dtype=np.float32)
    with torch.no_grad():
        expected = zoo.build_model(name, size=size).eval()(torch.from_numpy(image)).numpy()
    session = ort.InferenceSession(str(exports[0][name]), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"image": image})
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel <= REL_L2, f"{name}: relative L2 {rel:.2e} > {REL_L2:.0e} (image seed {seed})"


@pytest.mark.parametrize("name", TWICE)
def test_two_exports_are_byte_identical(exports: tuple[dict[str, Path], Path], name: str) -> None:
    first, again = exports[0][name], exports[1] / f"{name}.onnx"
    assert hashlib.sha256(first.read_bytes()).hexdigest() == hashlib.sha256(again.read_bytes()).hexdigest()
    # No leftovers: each model, and the weights file the dynamo exporter writes beside it.
    data = [f"{n}.onnx.data" for n in TWICE if zoo.ZOO[n].exporter == "dynamo"]
    assert sorted(p.name for p in exports[1].iterdir()) == sorted([*(f"{n}.onnx" for n in TWICE), *data])
    own = [f"{name}.onnx", *([f"{name}.onnx.data"] if zoo.ZOO[name].exporter == "dynamo" else [])]
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(own)


def test_an_unknown_entry_names_the_zoo(tmp_path: Path) -> None:
    with pytest.raises(zoo.ZooError, match=r"'unet' is not in the zoo; choose from smp_unet_resnet34"):
        zoo.export_model("unet", tmp_path)


def test_a_side_the_network_cannot_take_names_the_sizes_it_takes(tmp_path: Path) -> None:
    with pytest.raises(zoo.ZooError, match=r"smp_pspnet_resnet34 takes sides that are multiples of 48 .* not 512x512"):
        zoo.export_model("smp_pspnet_resnet34", tmp_path, (512, 512))
