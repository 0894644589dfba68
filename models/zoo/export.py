"""Export the model zoo: real PyTorch segmentation networks as ONNX, deterministically.

Each entry is built with seeded random weights (nothing is downloaded), its batch-norm statistics measured in
train-mode passes and the other normalisations' affine parameters drawn, so the network is not degenerate, and
exported in eval mode with one input `image` (1, 3, H, W) float32 and one output `logits`. Two runs with the same
arguments write byte-identical files.

    python models/zoo/export.py [NAMES...] [-o DIR] [--size H W] [--opset 17] [--exporter torchscript|dynamo]

Needs the `zoo` extra (torch, torchvision, segmentation-models-pytorch, monai): `make zoo` installs it and runs this.
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
from functools import partial
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


def _monai() -> types.ModuleType:
    """MONAI's networks, imported where a MONAI model is built: the smp and torchvision models need
    no MONAI (a GPU machine that carries smp alone still runs their torch rows in bench/zoo_bench.py)."""
    import monai.networks.nets as nets

    return nets


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


def _smp(arch: str, encoder: str) -> nn.Module:
    return getattr(smp, arch)(encoder, encoder_weights=None, classes=2)


def _tv_lraspp_mobilenet_v3_large() -> nn.Module:
    net = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=2)
    return OutTensor(net)


def _tv_deeplabv3_mobilenet_v3_large() -> nn.Module:
    net = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=2, aux_loss=False
    )
    return OutTensor(net)


def _tv_fcn_resnet50() -> nn.Module:
    net = torchvision.models.segmentation.fcn_resnet50(
        weights=None, weights_backbone=None, num_classes=2, aux_loss=False
    )
    return OutTensor(net)


# The MONAI networks as their tutorials build them in 2D: five levels, four stride-2 steps.
_MONAI_LEVELS = {"channels": (16, 32, 64, 128, 256), "strides": (2, 2, 2, 2)}


def _monai_unet() -> nn.Module:
    return _monai().UNet(spatial_dims=2, in_channels=3, out_channels=2, num_res_units=2, **_MONAI_LEVELS)


def _monai_attention_unet() -> nn.Module:
    return _monai().AttentionUnet(spatial_dims=2, in_channels=3, out_channels=2, **_MONAI_LEVELS)


def _monai_segresnet() -> nn.Module:
    return _monai().SegResNet(spatial_dims=2, init_filters=16, in_channels=3, out_channels=2)


def _monai_basicunet() -> nn.Module:
    return _monai().BasicUNet(spatial_dims=2, in_channels=3, out_channels=2)


def _monai_dynunet() -> nn.Module:
    return _monai().DynUNet(
        spatial_dims=2,
        in_channels=3,
        out_channels=2,
        kernel_size=[3, 3, 3, 3, 3],
        strides=[1, 2, 2, 2, 2],
        upsample_kernel_size=[2, 2, 2, 2],
    )


# The transformer segmenters of issue 39, as MONAI builds them in 2D. UNETR's constructor fixes the input size (its
# position embedding has one row per 16x16 patch), so it is built for the size being exported.
def _monai_unetr(size: tuple[int, int]) -> nn.Module:
    return _monai().UNETR(in_channels=3, out_channels=2, img_size=size, spatial_dims=2)


def _monai_swinunetr() -> nn.Module:
    return _monai().SwinUNETR(in_channels=3, out_channels=2, spatial_dims=2)


def _monai_mednext() -> nn.Module:
    return _monai().MedNeXt(spatial_dims=2, in_channels=3, out_channels=2)


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its file name (without `.onnx`), how to build it, and what it is.

    `multiple`: the input side must be a multiple of it (the network's total stride, or what its pooling needs to
    export); `min_size`: the smallest side it takes; `size`: the side exported by default. `exporter` and `opset`:
    how it is exported by default (opset None: the exporter's own default); `sized`: `build` takes the (H, W) size.
    """

    name: str
    build: Callable[..., nn.Module]
    about: str
    multiple: int = 32
    min_size: int = 64
    size: int = 512
    exporter: str = "torchscript"
    opset: int | None = 17
    sized: bool = False


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            "smp_unet_resnet34",
            partial(_smp, "Unet", "resnet34"),
            'segmentation-models-pytorch Unet("resnet34"), 2 classes',
        ),
        ZooEntry(
            "tv_lraspp_mobilenet_v3_large",
            _tv_lraspp_mobilenet_v3_large,
            "torchvision lraspp_mobilenet_v3_large, 2 classes, the dict's 'out' tensor",
        ),
        ZooEntry(
            "monai_unet",
            _monai_unet,
            "MONAI UNet, 2D, channels 16..256, strides 2x4, 2 residual units (InstanceNorm, PReLU)",
            multiple=16,
        ),
        ZooEntry(
            "monai_attention_unet",
            _monai_attention_unet,
            "MONAI AttentionUnet, 2D, channels 16..256, strides 2x4 (BatchNorm, sigmoid attention gates)",
            multiple=16,
        ),
        ZooEntry(
            "monai_segresnet",
            _monai_segresnet,
            "MONAI SegResNet, 2D, 16 initial filters (GroupNorm of 8 groups, bilinear upsampling)",
            multiple=8,
        ),
        ZooEntry(
            "monai_dynunet",
            _monai_dynunet,
            "MONAI DynUNet, 2D, 3x3 kernels, strides 1,2,2,2,2 (InstanceNorm + LeakyReLU, transposed convs)",
            multiple=16,
        ),
        *(
            ZooEntry(f"smp_{arch.lower()}_resnet34", partial(_smp, arch, "resnet34"), f'smp {arch}("resnet34")')
            for arch in ("UnetPlusPlus", "FPN", "MAnet", "Linknet")
        ),
        # PSPNet pools its 1/8 map into 1, 2, 3 and 6 bins; the TorchScript exporter writes that adaptive pooling
        # only where every bin count divides the map (its error otherwise: "output size that are not factor of input
        # size"), so the side is a multiple of 8 * 6 and 528 stands in for 512.
        ZooEntry("smp_pspnet_resnet34", partial(_smp, "PSPNet", "resnet34"), 'smp PSPNet("resnet34")', 48, 96, 528),
        # PAN's feature pyramid attention halves the 1/32 map three times more: 128 is the smallest side it takes.
        ZooEntry("smp_pan_resnet34", partial(_smp, "PAN", "resnet34"), 'smp PAN("resnet34")', min_size=128),
        *(
            ZooEntry(f"smp_unet_{tag}", partial(_smp, "Unet", encoder), f'smp Unet("{encoder}")')
            for tag, encoder in (
                ("mobilenet_v2", "mobilenet_v2"),
                ("resnext50_32x4d", "resnext50_32x4d"),
                ("convnext_tiny", "tu-convnext_tiny"),
            )
        ),
        ZooEntry(
            "tv_fcn_resnet50",
            _tv_fcn_resnet50,
            "torchvision fcn_resnet50, 2 classes, no aux head, the dict's 'out' tensor",
            multiple=8,
        ),
        # Issue 39's transformer segmenters, exported as a user who was handed them would find them: batch 1, the
        # dynamo exporter with its defaults (its opset, its optimiser; the batch written into every view's shape).
        *(
            ZooEntry(f"smp_{tag}", partial(_smp, arch, encoder), about, exporter="dynamo", opset=None)
            for tag, arch, encoder, about in (
                ("segformer_mit_b0", "Segformer", "mit_b0", 'smp Segformer("mit_b0") (MiT, SR attention)'),
                ("segformer_mit_b2", "Segformer", "mit_b2", 'smp Segformer("mit_b2")'),
                ("upernet_convnext_tiny", "UPerNet", "tu-convnext_tiny", 'smp UPerNet("tu-convnext_tiny")'),
            )
        ),
        ZooEntry(
            "monai_unetr",
            _monai_unetr,
            "MONAI UNETR, 2D, ViT-B/16 encoder (12 layers, 768 wide, global attention), img_size = the export size",
            multiple=16,
            exporter="dynamo",
            opset=None,
            sized=True,
        ),
        ZooEntry(
            "monai_swinunetr",
            _monai_swinunetr,
            "MONAI SwinUNETR, 2D, feature size 24 (windowed attention of 7x7, shifted windows, patch merging)",
            exporter="dynamo",
            opset=None,
        ),
        # Session 13's breadth probe, kept: architectures no earlier entry has. DenseNet's dense blocks (every layer
        # concatenates all before it), DeepLabV3+ (ASPP: dilated 3x3s and a global pool, a 4x decoder), torchvision's
        # DeepLabV3 on MobileNetV3 (dilated depthwise convs, hardswish, SE), MONAI's BasicUNet (InstanceNorm +
        # LeakyReLU, transposed convs, 32 channels at full size) and ResNeSt's split attention (a softmax over radix
        # groups, reductions over a 5-D view).
        ZooEntry("smp_unet_densenet121", partial(_smp, "Unet", "densenet121"), 'smp Unet("densenet121")'),
        ZooEntry(
            "smp_deeplabv3plus_resnet34", partial(_smp, "DeepLabV3Plus", "resnet34"), 'smp DeepLabV3Plus("resnet34")'
        ),
        ZooEntry(
            "tv_deeplabv3_mobilenet_v3_large",
            _tv_deeplabv3_mobilenet_v3_large,
            "torchvision deeplabv3_mobilenet_v3_large, 2 classes, no aux head, the dict's 'out' tensor",
        ),
        ZooEntry(
            "monai_basicunet",
            _monai_basicunet,
            "MONAI BasicUNet, 2D, features 32..256 (InstanceNorm, LeakyReLU, transposed convs)",
            multiple=16,
        ),
        # Session 14's probe: the exporter users get from torch 2.9 on (dynamo) asked for an old opset, as README.md's
        # example does: its GELU is x * (0.5 * (1 + erf(x / sqrt 2))), its GroupNorm Reshape / InstanceNorm, and it
        # stays at opset 18 (its Pads do not convert down). MedNeXt: ConvNeXt blocks for medical images (7x7
        # depthwise convs, GroupNorm of one channel a group, 1x1 expansion, GELU, residuals).
        ZooEntry(
            "monai_mednext",
            _monai_mednext,
            "MONAI MedNeXt, 2D, defaults (32 initial filters, 7x7 depthwise, GroupNorm, GELU), dynamo at opset 18",
            multiple=16,
            exporter="dynamo",
            opset=18,
        ),
        ZooEntry("smp_fpn_resnest14d", partial(_smp, "FPN", "tu-resnest14d"), 'smp FPN("tu-resnest14d") (split attention)'),
    )
}


@dataclass(frozen=True)
class ExportResult:
    """What `export_model` wrote and how long it took."""

    name: str
    path: Path
    size: tuple[int, int]
    params: int
    size_bytes: int  # the model file plus any external-data file beside it
    seconds: float


class ZooError(Exception):
    """A zoo export that cannot run; the message names the value and the fix."""


def default_size(name: str) -> tuple[int, int]:
    """The (H, W) zoo entry `name` is exported at by default."""
    return (_entry(name).size,) * 2


def small_size(name: str, at_least: int = 64) -> tuple[int, int]:
    """The smallest square (H, W) of at least `at_least` that zoo entry `name` takes: CI's export size."""
    entry = _entry(name)
    side = max(at_least, entry.min_size)
    return (-(-side // entry.multiple) * entry.multiple,) * 2


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ZooError(f"{name!r} is not in the zoo; choose from {', '.join(ZOO)}")
    return ZOO[name]


def _check_size(name: str, size: tuple[int, int]) -> None:
    entry = _entry(name)
    if any(s % entry.multiple or s < entry.min_size for s in size):
        raise ZooError(
            f"{name} takes sides that are multiples of {entry.multiple} and at least {entry.min_size}, not"
            f" {size[0]}x{size[1]}; pass e.g. --size {entry.size} {entry.size}"
        )


def _randomise_batch_norm(model: nn.Module, rng: np.random.Generator, size: tuple[int, int]) -> None:
    # Fresh batch norms have mean 0, var 1, weight 1, bias 0: each is then an identity, and a test comparing two
    # backends would not notice a normalisation dropped or mis-fused. Statistics drawn at random do not normalise
    # either: activations then grow layer by layer (logits with a spread of 1e2 in the Unet), which no trained
    # network has and which fp16 cannot carry (its spacing at 128 is 0.125). So the statistics are measured, as
    # training would: forward passes in train mode over seeded random images at the export size (one thread, rounded to
    # 4 significant digits so that the export stays byte-identical), then perturbed per channel; the affine
    # weights and biases are drawn. Drawn with numpy so the values do not depend on torch's RNG implementation.
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    with torch.no_grad():
        for module in norms:
            n = module.num_features
            if module.affine:
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


def _randomise_affine(model: nn.Module, rng: np.random.Generator) -> None:
    # Group, instance and layer norms start with weight 1 and bias 0, and PReLU with one slope (0.25) on every
    # channel: a kernel that dropped the affine step or read the slope of the wrong channel would still agree.
    # A layer scale (ConvNeXt's gamma) starts at one tiny value (1e-6), which silences its residual branch: the
    # branch's kernels would go unchecked. Trained ones are 0.1 to 1. Drawn per channel before the batch-norm
    # passes, so those measure the network as exported.
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                first = float(param.flatten()[0]) if param.ndim == 1 else 0.0
                if 0.0 < abs(first) < 1e-3 and bool(torch.all(param == first)):
                    scale = rng.uniform(0.1, 0.5, param.shape) * np.sign(first)
                    param.copy_(torch.from_numpy(scale.astype(np.float32)))
            if isinstance(module, nn.PReLU):
                n = module.weight.numel()
                module.weight.copy_(torch.from_numpy(rng.uniform(0.05, 0.4, n).astype(np.float32)))
            elif isinstance(module, nn.GroupNorm | nn.modules.instancenorm._InstanceNorm | nn.LayerNorm):
                if getattr(module, "weight", None) is not None:
                    shape = module.weight.shape
                    module.weight.copy_(torch.from_numpy(rng.normal(1.0, 0.1, shape).astype(np.float32)))
                if getattr(module, "bias", None) is not None:
                    shape = module.bias.shape
                    module.bias.copy_(torch.from_numpy(rng.normal(0.0, 0.1, shape).astype(np.float32)))


def build_model(name: str, seed: int = 0, size: tuple[int, int] | None = None) -> nn.Module:
    """Build zoo entry `name` in eval mode with weights drawn from `seed` and batch-norm statistics measured at
    `size` (default: the entry's export size; the same seed and size give the same weights)."""
    size = size or default_size(name)
    _check_size(name, size)
    torch.manual_seed(seed)  # the constructors' own initialisers draw from torch's global generator
    entry = ZOO[name]
    model = entry.build(size) if entry.sized else entry.build()
    rng = np.random.default_rng(seed)
    _randomise_affine(model, rng)
    _randomise_batch_norm(model, rng, size)
    return model.eval()


def example_input(size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """A (1, 3, H, W) float32 image drawn from N(0, 1) with `seed`, the export's example and a test input."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((1, 3, *size), generator=generator, dtype=torch.float32)


def _export_to(model: nn.Module, image: torch.Tensor, path: Path, opset: int | None, exporter: str) -> None:
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
                dynamo=exporter == "dynamo",
                **({} if opset is None else {"opset_version": opset}),
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
    if opset is not None and written != opset:
        raise ZooError(
            f"torch {torch.__version__} --exporter {exporter} wrote opset {written} for {path.stem}, not the requested"
            f" {opset} (its version converter could not lower the graph); pass --opset {written} or use"
            f" --exporter torchscript"
        )


def export_model(
    name: str,
    out_dir: Path = DEFAULT_DIR,
    size: tuple[int, int] | None = None,
    opset: int | None = None,
    exporter: str | None = None,
    seed: int = 0,
) -> ExportResult:
    """Export zoo entry `name` to `out_dir/<name>.onnx` (plus `<name>.onnx.data` if the exporter writes one).

    The files are written in a temporary folder beside the target and renamed into place, so a reader never sees a
    half-written model; the temporary folder keeps the final file name because an external-data file is referenced
    by name from inside the model. `exporter` and `opset` default to the entry's (`ZooEntry.exporter`, `.opset`).
    """
    start = time.perf_counter()
    exporter = exporter or _entry(name).exporter
    opset = opset if opset is not None else _entry(name).opset if exporter == _entry(name).exporter else 17
    size = size or default_size(name)
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
    return ExportResult(name, path, size, params, size_bytes, time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: export the named entries (all by default) and print one line per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"zoo entries (default: all): {', '.join(ZOO)}")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_DIR, help="output folder (default: %(default)s)")
    parser.add_argument(
        "--size", nargs=2, type=int, metavar=("H", "W"), help="input height, width (default: each entry's, 512 mostly)"
    )
    parser.add_argument("--opset", type=int, help="ONNX opset (default: 17, the dynamo exporter's own for its entries)")
    parser.add_argument("--exporter", choices=EXPORTERS, help="torch.onnx exporter (default: each entry's)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        for name in args.names or list(ZOO):
            r = export_model(name, args.out, tuple(args.size or ()) or None, args.opset, args.exporter, args.seed)
            print(
                f"{r.name:32s} {r.size[0]:4d}x{r.size[1]:<4d} {r.params / 1e6:7.2f} M params"
                f" {r.size_bytes / 2**20:8.1f} MiB {r.seconds:6.1f} s"
            )
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
