"""An engine of a bundle of two input sizes (config `sizes`, issue 40) on the CPU: an image runs at the smallest
compiled size that holds it, padded by its edge pixels and every output cropped back, and matches onnxruntime run
on the padded input, cropped; an image larger than every size is refused naming the resize rule; a manifest
written before `sizes` existed reads as one size; `dualtrack run` and the service answer at the image's own size
and `dualtrack info` lists the sizes.

Tolerances: probabilities within rel_l2 1e-5 (fp32 through IREE llvm-cpu, summation order only; as
test_engine_cpu.py), masks on at most 1e-3 of pixels (argmax ties); fresh random images.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from sized_net import CLASSES, SIZES, conv_net, reference, rel_l2, write_config

from dualtrack.cli.commands import main
from dualtrack.contract import sizes
from dualtrack.contract.bundle import MANIFEST, Bundle
from dualtrack.errors import InputError
from dualtrack.runtime.engine import Engine

PROBS_REL_L2 = 1e-5
MASK_MISMATCH = 1e-3


@pytest.fixture(scope="module")
def sized_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualtrack.compiler.build import build

    root = tmp_path_factory.mktemp("sizes")
    # No seed: the build draws one after its key, for every size's reference cases and verification.
    cfg = write_config(root, conv_net(), f"sizes: {json.dumps([list(s) for s in SIZES])}\n", seed=False)
    out = root / "bundle"
    build(cfg, out)
    return out


@pytest.fixture(scope="module")
def engine(sized_bundle: Path) -> Iterator[Engine]:
    with Engine.load(sized_bundle, "cpu") as e:
        yield e


def test_an_image_at_its_own_size_matches_onnxruntime_on_the_padded_input_cropped(engine: Engine) -> None:
    rng = np.random.default_rng(7)
    x = rng.integers(0, 255, (2, 37, 50, 3), dtype=np.uint8)
    got = engine.run(x)
    assert got["mask"].shape == (2, 37, 50)
    assert got["probs"].shape == (2, CLASSES, 37, 50)
    assert engine.last_size == sizes.Choice("fits", (40, 56), (37, 50))
    padded = sizes.pad_to(x, (40, 56))
    want = {k: sizes.crop_to(v, (40, 56), (37, 50)) for k, v in reference(engine.bundle, (40, 56), padded).items()}
    assert rel_l2(got["probs"], want["probs"]) < PROBS_REL_L2
    assert np.mean(got["mask"] != want["mask"]) <= MASK_MISMATCH


def test_an_image_at_a_compiled_size_runs_unpadded(engine: Engine) -> None:
    x = np.random.default_rng(8).integers(0, 255, (1, 40, 56, 3), dtype=np.uint8)
    got = engine.run(x)
    want = reference(engine.bundle, (40, 56), x)
    assert rel_l2(got["probs"], want["probs"]) < PROBS_REL_L2
    assert not engine.last_size.padded


def test_an_image_taller_than_the_small_size_gets_the_other(engine: Engine) -> None:
    x = np.random.default_rng(9).integers(0, 255, (1, 50, 30, 3), dtype=np.uint8)
    got = engine.run(x)
    assert engine.last_size.size == (64, 48)
    want = {
        k: sizes.crop_to(v, (64, 48), (50, 30))
        for k, v in reference(engine.bundle, (64, 48), sizes.pad_to(x, (64, 48))).items()
    }
    assert rel_l2(got["probs"], want["probs"]) < PROBS_REL_L2


def test_an_image_larger_than_every_size_is_refused_with_the_resize_rule(engine: Engine) -> None:
    x = np.zeros((1, 65, 20, 3), np.uint8)
    with pytest.raises(InputError, match=r"65x20 is larger than every compiled size \(40x56, 64x48\).*resize"):
        engine.run(x)


def test_an_old_one_size_bundle_reads_as_before(sized_bundle: Path, tmp_path: Path) -> None:
    """A manifest written before `sizes` existed has no key: it reads as one size, its own."""
    old = tmp_path / "old"
    shutil.copytree(sized_bundle, old)
    raw = json.loads((old / MANIFEST).read_text())
    del raw["sizes"]
    (old / MANIFEST).write_text(json.dumps(raw))
    b = Bundle.open(old)
    assert b.manifest.sizes == ()
    assert b.sizes == ((64, 48),)
    assert "sizes" not in b.manifest.to_json()
    with Engine.load(b, "cpu") as e:
        x = np.random.default_rng(10).integers(0, 255, (1, 64, 48, 3), dtype=np.uint8)
        assert e.run(x)["mask"].shape == (1, 64, 48)
        with pytest.raises(InputError, match=r"this bundle takes \(n, 64, 48, 3\) uint8"):
            e.run(np.zeros((1, 40, 56, 3), np.uint8))


# --- `dualtrack run`, `dualtrack info` and the service ------------------------------------------------


def _png(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, format="PNG")
    return buf.getvalue()


def test_cli_run_answers_at_the_image_size_as_engine_run(sized_bundle: Path, engine: Engine, tmp_path: Path) -> None:
    x = np.random.default_rng(11).integers(0, 255, (37, 50, 3), dtype=np.uint8)
    (tmp_path / "in.png").write_bytes(_png(x))
    result = CliRunner().invoke(
        main, ["run", str(sized_bundle), str(tmp_path / "in.png"), "-o", str(tmp_path / "m.png")]
    )
    assert result.exit_code == 0, result.output
    assert "mask 50x37 (run at 40x56, padded and cropped back)" in result.output
    got = np.asarray(Image.open(tmp_path / "m.png"))
    np.testing.assert_array_equal(got, engine.run(x[None])["mask"][0])


def test_cli_info_lists_the_sizes(sized_bundle: Path) -> None:
    result = CliRunner().invoke(main, ["info", str(sized_bundle)])
    assert result.exit_code == 0, result.output
    assert "sizes      40x56, 64x48: an image runs at the smallest that holds it" in result.output
    assert "a larger one is resized to 64x48" in result.output


def test_the_service_answers_at_the_image_size(sized_bundle: Path, engine: Engine) -> None:
    """An image the batch shape (64x48, the largest) holds runs there padded, its mask cropped back: what
    onnxruntime gives on the padded image, cropped; a wider one is resized to 64x48 and its mask back."""
    from test_serve import _wait_ready, serving

    from dualtrack.serve import create_app

    rng = np.random.default_rng(12)
    small = rng.integers(0, 255, (30, 41, 3), dtype=np.uint8)
    wide = rng.integers(0, 255, (20, 60, 3), dtype=np.uint8)
    with serving(create_app(sized_bundle, max_batch_delay_ms=1)) as (base, _server, _thread):
        _wait_ready(base)
        got = [np.asarray(Image.open(io.BytesIO(_post(base, _png(x))))) for x in (small, wide)]
    assert got[0].shape == (30, 41)
    want = reference(engine.bundle, (64, 48), sizes.pad_to(small[None], (64, 48)))["mask"][0, :30, :41]
    assert np.mean(got[0] != want) <= MASK_MISMATCH
    assert got[1].shape == (20, 60)
    resized = np.asarray(Image.fromarray(wide).resize((48, 64), Image.Resampling.BILINEAR))
    back = Image.fromarray(engine.at_size((64, 48)).run(resized[None])["mask"][0]).resize((60, 20), Image.NEAREST)
    assert np.mean(got[1] != np.asarray(back)) <= MASK_MISMATCH


def _post(base: str, data: bytes) -> bytes:
    import httpx

    r = httpx.post(f"{base}/v1/segment", content=data, headers={"content-type": "image/png"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def test_cli_verify_checks_every_size(sized_bundle: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(sized_bundle), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("40x56: ") for line in result.output.splitlines())
    assert any(line.startswith("64x48: ") for line in result.output.splitlines())
    assert "checks passed on cpu (seed 3)" in result.output
