"""Export the model zoo: real PyTorch segmentation networks as ONNX, deterministically.

Each entry is built with seeded random weights (nothing is downloaded), its batch-norm statistics randomised so
the network is not degenerate, and exported in eval mode with one input `image` (1, 3, H, W) float32 and one
output `logits`. Two runs with the same arguments write byte-identical files.

    python models/zoo/export.py [NAMES...] [-o DIR] [--size H W] [--opset 17] [--exporter torchscript|dynamo]

Needs the `zoo` extra (torch, torchvision, segmentation-models-pytorch): `make zoo` installs it and runs this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

# torchvision on PyPI is a CUDA build; beside the CPU torch wheel its C extension does not load, and
# `torchvision/__init__` then fails in `_meta_registrations`, which registers fake kernels for the detection C ops
# (torchvision::nms, roi_align, ...) that do not exist. The segmentation models use none of those ops, so an empty
# module stands in for it (timm, imported by smp, imports torchvision too, hence before both). Where torchvision
# loads normally (the GPU machine) this only skips those fake kernels, which no zoo export calls.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))

import segmentation_models_pytorch as smp  # noqa: E402
import torchvision  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parent
INPUT_NAME = "image"
OUTPUT_NAME = "logits"
EXPORTERS = ("torchscript", "dynamo")


class OutTensor(nn.Module):
    """Return the `"out"` tensor of a torchvision segmentation model, whose forward returns a dict."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)["out"]


def _smp_unet_resnet34() -> nn.Module:
    return smp.Unet("resnet34", encoder_weights=None, classes=2)


def _tv_lraspp_mobilenet_v3_large() -> nn.Module:
    net = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=2)
    return OutTensor(net)


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its file name (without `.onnx`), how to build it, and what it is."""

    name: str
    build: Callable[[], nn.Module]
    about: str


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("smp_unet_resnet34", _smp_unet_resnet34, 'segmentation-models-pytorch Unet("resnet34"), 2 classes'),
        ZooEntry(
            "tv_lraspp_mobilenet_v3_large",
            _tv_lraspp_mobilenet_v3_large,
            "torchvision lraspp_mobilenet_v3_large, 2 classes, the dict's 'out' tensor",
        ),
    )
}


@dataclass(frozen=True)
class ExportResult:
    """What `export_model` wrote and how long it took."""

    name: str
    path: Path
    params: int
    size_bytes: int  # the model file plus any external-data file beside it
    seconds: float


class ZooError(Exception):
    """A zoo export that cannot run; the message names the value and the fix."""


def _randomise_batch_norm(model: nn.Module, rng: np.random.Generator, size: tuple[int, int]) -> None:
    # Fresh batch norms have mean 0, var 1, weight 1, bias 0: each is then an identity, and a test comparing two
    # backends would not notice a normalisation dropped or mis-fused. Statistics drawn at random do not normalise
    # either: activations then grow layer by layer (logits with a spread of 1e2 in the Unet), which no trained
    # network has and which fp16 cannot carry (its spacing at 128 is 0.125). So the statistics are measured, as
    # training would: forward passes in train mode over seeded random images at the export size (one thread, rounded to
    # 4 significant digits so that the export stays byte-identical), then perturbed per channel; the affine
    # weights and biases are drawn. Drawn with numpy so the values do not depend on torch's RNG implementation.
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for module in norms:
            n = module.num_features
            module.weight.copy_(torch.from_numpy(rng.normal(1.0, 0.1, n).astype(np.float32)))
            module.bias.copy_(torch.from_numpy(rng.normal(0.0, 0.1, n).astype(np.float32)))
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over the calibration passes
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model.train()
            for _ in range(2):
                model(torch.from_numpy(rng.standard_normal((2, 3, *size)).astype(np.float32)))
        finally:
            torch.set_num_threads(threads)
            model.eval()
        for module in norms:
            n = module.num_features
            mean = module.running_mean.numpy() + rng.normal(0.0, 0.1, n) * np.sqrt(module.running_var.numpy())
            var = module.running_var.numpy() * rng.uniform(0.8, 1.25, n)
            for tensor, value in ((module.running_mean, mean), (module.running_var, var)):
                tensor.copy_(torch.from_numpy(np.array([float(f"{v:.4g}") for v in value], np.float32)))
            module.momentum = 0.1


def build_model(name: str, seed: int = 0, size: tuple[int, int] = (512, 512)) -> nn.Module:
    """Build zoo entry `name` in eval mode with weights drawn from `seed` and batch-norm statistics measured at
    `size` (the same seed and size give the same weights)."""
    if name not in ZOO:
        raise ZooError(f"{name!r} is not in the zoo; choose from {', '.join(ZOO)}")
    torch.manual_seed(seed)  # the constructors' own initialisers draw from torch's global generator
    model = ZOO[name].build()
    _randomise_batch_norm(model, np.random.default_rng(seed), size)
    return model.eval()


def example_input(size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """A (1, 3, H, W) float32 image drawn from N(0, 1) with `seed`, the export's example and a test input."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((1, 3, *size), generator=generator, dtype=torch.float32)


def _export_to(model: nn.Module, image: torch.Tensor, path: Path, opset: int, exporter: str) -> None:
    if exporter not in EXPORTERS:
        raise ZooError(f"exporter {exporter!r} is not one of {', '.join(EXPORTERS)}")
    if exporter == "dynamo":
        try:
            import onnxscript  # noqa: F401  (only the dynamo exporter needs it; a clear error beats torch's)
        except ImportError as exc:
            raise ZooError("--exporter dynamo needs onnxscript: pip install onnxscript") from exc
    try:
        with warnings.catch_warnings():
            # torch >= 2.9 warns that the TorchScript exporter is legacy; choosing it is deliberate (the README says
            # why: its names and shape arithmetic are what the front end must handle).
            warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
            torch.onnx.export(
                model,
                (image,),
                str(path),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                opset_version=opset,
                dynamo=exporter == "dynamo",
            )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ZooError(
            f"torch {torch.__version__} --exporter {exporter} failed: {type(exc).__name__}: {first}"
            f" (the default --exporter torchscript is the one the zoo is checked with)"
        ) from exc
    # The dynamo exporter builds opset 18 and only tries to convert down, keeping 18 where it cannot (a log line,
    # no error); a zoo file must have the opset it was asked for.
    written = {o.domain: o.version for o in onnx.load(str(path), load_external_data=False).opset_import}.get("")
    if written != opset:
        raise ZooError(
            f"torch {torch.__version__} --exporter {exporter} wrote opset {written} for {path.stem}, not the requested"
            f" {opset} (its version converter could not lower the graph); pass --opset {written} or use"
            f" --exporter torchscript"
        )


def export_model(
    name: str,
    out_dir: Path = DEFAULT_DIR,
    size: tuple[int, int] = (512, 512),
    opset: int = 17,
    exporter: str = "torchscript",
    seed: int = 0,
) -> ExportResult:
    """Export zoo entry `name` to `out_dir/<name>.onnx` (plus `<name>.onnx.data` if the exporter writes one).

    The files are written in a temporary folder beside the target and renamed into place, so a reader never sees a
    half-written model; the temporary folder keeps the final file name because an external-data file is referenced
    by name from inside the model.
    """
    start = time.perf_counter()
    model = build_model(name, seed, size)
    image = example_input(size, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.onnx"
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
    try:
        with torch.no_grad():
            _export_to(model, image, tmp_dir / path.name, opset, exporter)
        produced = sorted(tmp_dir.iterdir(), key=lambda f: f.name == path.name)  # the model file last
        size_bytes = sum(f.stat().st_size for f in produced)
        # A data file left by an earlier export with the other exporter would be read by nobody, yet look current.
        stale = out_dir / f"{path.name}.data"
        if stale.name not in {f.name for f in produced}:
            stale.unlink(missing_ok=True)
        # Once the model file is in place, any external data it names is already there.
        for f in produced:
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    return ExportResult(name, path, params, size_bytes, time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: export the named entries (all by default) and print one line per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"zoo entries (default: all): {', '.join(ZOO)}")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_DIR, help="output folder (default: %(default)s)")
    parser.add_argument("--size", nargs=2, type=int, default=(512, 512), metavar=("H", "W"), help="input height, width")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (default: %(default)s)")
    parser.add_argument("--exporter", choices=EXPORTERS, default="torchscript", help="torch.onnx exporter")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        for name in args.names or list(ZOO):
            r = export_model(name, args.out, tuple(args.size), args.opset, args.exporter, args.seed)
            print(f"{r.name:32s} {r.params / 1e6:7.2f} M params {r.size_bytes / 2**20:8.1f} MiB {r.seconds:6.1f} s")
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
