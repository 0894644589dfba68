"""Networks nobody tuned dualtrack for, built as a user would: where does the default plan still switch tracks?

    python bench/breadth.py [--size 64] [--out DIR] [NAME ...]     # all of them by default

Each network (segmentation-models-pytorch and timm encoders, MONAI, torchvision, and three small custom nets of
op families the corpus lacks: InstanceNorm/GroupNorm + reflect/replicate padding + ELU/Mish, every activation
with dilated and grouped convolutions and squeeze-excitation, a channel shuffle) is exported by the zoo's own
export code (models/zoo/export.py: torch.onnx.export's defaults, opset 17, random weights with measured
batch-norm statistics) at a small size, then built for the CPU with a config that names only the model
(`partition: auto`, fp16) and verified against onnxruntime by the build. One line a network: its segments
(B A B is the whole body on Track A) and build time, or the first line of its error; `partition.json` in each
bundle says why every Track B node is there. Not the corpus (configs/zoo, benchmarked on the GPU): a probe of
breadth, whose findings become mechanisms and tests. The last run's table is in docs/partition.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "pipeline"))
sys.path.insert(0, str(ROOT / "bench"))

from zoo_bench import load_zoo  # noqa: E402  (models/zoo/export.py as a module)


def networks(zoo) -> dict[str, Callable]:
    """Name -> constructor. Imported here: torch and the model libraries are the zoo extra's."""
    import monai.networks.nets as mn
    import segmentation_models_pytorch as smp
    import torch
    import torchvision
    from torch import nn

    class InstanceNormUNet(nn.Module):
        """InstanceNorm + LeakyReLU with reflect and zero padding, GroupNorm + ELU with replicate padding, a
        ConvTranspose with output_padding, BatchNorm + Mish: issue 38's "network nobody showed us"."""

        def __init__(self, c: int = 16) -> None:
            super().__init__()

            def block(i: int, o: int, pad: nn.Module) -> nn.Module:
                return nn.Sequential(pad, nn.Conv2d(i, o, 3), nn.InstanceNorm2d(o, affine=True), nn.LeakyReLU(0.1))

            self.e1, self.e2 = block(3, c, nn.ReflectionPad2d(1)), block(c, 2 * c, nn.ZeroPad2d(1))
            self.mid = nn.Sequential(
                nn.ReplicationPad2d(1), nn.Conv2d(2 * c, 2 * c, 3), nn.GroupNorm(4, 2 * c), nn.ELU()
            )
            self.up = nn.ConvTranspose2d(2 * c, c, 3, stride=2, padding=1, output_padding=1)
            self.head = nn.Sequential(
                nn.Conv2d(2 * c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Mish(), nn.Conv2d(c, 4, 1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.e1(x)
            return self.head(torch.cat([a, self.up(self.mid(self.e2(nn.functional.max_pool2d(a, 2))))], 1))

    class ActivationNet(nn.Module):
        """SELU, Softplus, HardSwish, HardSigmoid, PReLU, ReLU6, Tanh and tanh-GELU after dilated and grouped
        3x3 convolutions with residual adds, squeeze-excitation gating, a bilinear align_corners upsample."""

        def __init__(self, c: int = 24) -> None:
            super().__init__()
            acts = [nn.SELU(), nn.Softplus(), nn.Hardswish(), nn.Hardsigmoid(), nn.PReLU(c), nn.ReLU6(), nn.Tanh(),
                    nn.GELU(approximate="tanh")]  # fmt: skip
            shapes = zip(acts, (1, 2, 3, 1, 2, 1, 4, 1), (1, 3, 1, 24, 2, 1, 1, 6), strict=True)
            self.stem = nn.Conv2d(3, c, 5, padding=2)
            self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=d, dilation=d, groups=g), a)
                                        for a, d, g in shapes)  # fmt: skip
            self.se = nn.Sequential(
                nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 8, 1), nn.ReLU(), nn.Conv2d(8, c, 1), nn.Sigmoid()
            )
            self.head = nn.Conv2d(c, 5, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for layer in self.layers:
                x = x + layer(x)
            return nn.functional.interpolate(
                self.head(x * self.se(x)), scale_factor=2, mode="bilinear", align_corners=True
            )

    class ShuffleNet(nn.Module):
        """A grouped 1x1 conv, ShuffleNet's channel shuffle, Hardtanh, AveragePool with ceil_mode, nearest x4."""

        def __init__(self, c: int = 24) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.BatchNorm2d(c), nn.Hardtanh(-2, 2))
            self.group = nn.Conv2d(c, c, 1, groups=3)
            self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
            self.pool = nn.AvgPool2d(3, 2, ceil_mode=True, count_include_pad=False)
            self.head = nn.Conv2d(c, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            n, c, h, w = x.shape
            y = self.group(x).reshape(n, 3, c // 3, h, w).transpose(1, 2).reshape(n, c, h, w)
            y = self.pool(torch.relu(self.dw(y)) + x)
            return nn.functional.interpolate(self.head(y), scale_factor=4, mode="nearest")

    def tv(name: str) -> nn.Module:
        net = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=3)
        return zoo.OutTensor(net)

    def smp_net(arch: str, encoder: str, **kw: object) -> Callable[[], nn.Module]:
        return lambda: getattr(smp, arch)(encoder, encoder_weights=None, classes=3, **kw)

    feats = (16, 16, 32, 64, 128, 16)
    return {
        "custom_instancenorm_unet": InstanceNormUNet,
        "custom_activations": ActivationNet,
        "custom_shuffle": ShuffleNet,
        "smp_deeplabv3plus_resnet18": smp_net("DeepLabV3Plus", "resnet18"),
        "smp_unet_efficientnet_b0": smp_net("Unet", "efficientnet-b0"),
        "smp_unet_scse_resnet18": smp_net("Unet", "resnet18", decoder_attention_type="scse"),
        "smp_unet_densenet121": smp_net("Unet", "densenet121"),
        "smp_unet_tu_regnety_002": smp_net("Unet", "tu-regnety_002"),
        "smp_unet_tu_resnest14d": smp_net("Unet", "tu-resnest14d"),
        "smp_unet_tu_hrnet_w18_small": smp_net("Unet", "tu-hrnet_w18_small"),
        "smp_unet_tu_mobilenetv3_small": smp_net("Unet", "tu-mobilenetv3_small_100"),
        "smp_unet_tu_ghostnet": smp_net("Unet", "tu-ghostnet_100"),
        "smp_unet_tu_convnextv2_atto": smp_net("Unet", "tu-convnextv2_atto"),
        "smp_unet_tu_skresnet18": smp_net("Unet", "tu-skresnet18"),
        "smp_unet_tu_res2net50_26w_4s": smp_net("Unet", "tu-res2net50_26w_4s"),
        "smp_unet_tu_rexnet_100": smp_net("Unet", "tu-rexnet_100"),
        "smp_unet_tu_dla34": smp_net("Unet", "tu-dla34"),
        "smp_unet_tu_cspresnet50": smp_net("Unet", "tu-cspresnet50"),
        "smp_unet_tu_ese_vovnet19b_dw": smp_net("Unet", "tu-ese_vovnet19b_dw"),
        "smp_fpn_tu_tf_efficientnet_lite0": smp_net("FPN", "tu-tf_efficientnet_lite0"),
        "smp_unet_tu_mobileone_s0": smp_net("Unet", "tu-mobileone_s0"),
        "smp_unet_tu_poolformerv2_s12": smp_net("Unet", "tu-poolformerv2_s12"),
        "smp_unet_tu_hgnetv2_b0": smp_net("Unet", "tu-hgnetv2_b0"),
        "smp_unet_tu_fastvit_t8": smp_net("Unet", "tu-fastvit_t8"),
        "smp_unet_tu_mobilevitv2_050": smp_net("Unet", "tu-mobilevitv2_050"),
        "smp_unet_tu_edgenext_xx_small": smp_net("Unet", "tu-edgenext_xx_small"),
        "smp_unet_tu_repvgg_a0": smp_net("Unet", "tu-repvgg_a0"),
        "smp_unet_tu_repghostnet_050": smp_net("Unet", "tu-repghostnet_050"),
        "smp_unet_tu_repvit_m0_9": smp_net("Unet", "tu-repvit_m0_9"),
        "smp_unet_tu_ghostnetv2_100": smp_net("Unet", "tu-ghostnetv2_100"),
        "smp_unet_tu_efficientvit_b0": smp_net("Unet", "tu-efficientvit_b0"),
        "smp_unet_tu_inception_next_tiny": smp_net("Unet", "tu-inception_next_tiny"),
        "smp_unet_tu_starnet_s1": smp_net("Unet", "tu-starnet_s1"),
        "smp_unet_tu_eca_resnet33ts": smp_net("Unet", "tu-eca_resnet33ts"),
        "smp_unet_tu_gcresnet33ts": smp_net("Unet", "tu-gcresnet33ts"),
        "smp_unet_tu_resnetv2_50x1_bit": smp_net("Unet", "tu-resnetv2_50x1_bit"),
        "smp_unet_tu_mixnet_s": smp_net("Unet", "tu-mixnet_s"),
        "smp_unet_tu_eca_nfnet_l0": smp_net("Unet", "tu-eca_nfnet_l0"),
        "smp_unet_tu_dpn68": smp_net("Unet", "tu-dpn68"),
        "smp_unet_tu_xception41": smp_net("Unet", "tu-xception41"),
        "smp_unet_tu_fasternet_t0": smp_net("Unet", "tu-fasternet_t0"),
        "smp_unet_tu_rdnet_tiny": smp_net("Unet", "tu-rdnet_tiny"),
        "smp_unet_tu_mambaout_femto": smp_net("Unet", "tu-mambaout_femto"),
        "smp_unet_tu_efficientformerv2_s0": smp_net("Unet", "tu-efficientformerv2_s0"),
        "smp_linknet_efficientnet_b0": smp_net("Linknet", "efficientnet-b0"),
        "tv_deeplabv3_mobilenet_v3": lambda: tv("deeplabv3_mobilenet_v3_large"),
        "monai_basicunet": lambda: mn.BasicUNet(spatial_dims=2, in_channels=3, out_channels=3, features=feats),
        "monai_basicunetplusplus": lambda: mn.BasicUNetPlusPlus(
            spatial_dims=2, in_channels=3, out_channels=3, features=feats
        ),
        "monai_flexibleunet_efficientnet_b0": lambda: mn.FlexibleUNet(
            3, 3, "efficientnet-b0", pretrained=False, spatial_dims=2
        ),
        "monai_highresnet": lambda: mn.HighResNet(spatial_dims=2, in_channels=3, out_channels=3),
        "monai_mednext": lambda: mn.MedNeXt(
            spatial_dims=2,
            in_channels=3,
            out_channels=3,
            init_filters=16,
            blocks_down=(1, 1, 1),
            blocks_bottleneck=1,
            blocks_up=(1, 1, 1),
        ),
        "monai_segresnetds": lambda: mn.SegResNetDS(spatial_dims=2, in_channels=3, out_channels=3, init_filters=16),
    }


def probe(zoo, name: str, build_net: Callable, size: int, out: Path) -> str:
    """Export ``name`` at ``size`` and build it for the CPU; its one line."""
    from dualtrack.compiler.build import build

    t0 = time.perf_counter()
    zoo.ZOO[name] = zoo.ZooEntry(name, build_net, name, multiple=32, min_size=32, size=size)
    try:
        exported = zoo.export_model(name, out / "onnx", (size, size))
        config = out / f"{name}.yaml"
        config.write_text(f"model: {exported.path}\nbatch_sizes: [1]\nprecision: fp16\n")
        result = build(config, out / "bundles" / name, cpu_only=True, force=True)
        tracks = "".join(s.track for s in result.plan.segments)
        return f"{name}: {len(tracks)} segments ({tracks}), {time.perf_counter() - t0:.0f} s"
    except Exception as e:  # a probe reports every failure as one line and goes on (the traceback beside it)
        (out / f"{name}.err").write_text(traceback.format_exc())
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"{name}: FAILED {type(e).__name__}: {first}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="networks to probe (default: all)")
    ap.add_argument("--size", type=int, default=64, help="the square side exported")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "breadth", help="exports, configs and bundles")
    args = ap.parse_args(argv)
    zoo = load_zoo()
    nets = networks(zoo)
    unknown = [n for n in args.names if n not in nets]
    if unknown:
        print(f"unknown network(s) {', '.join(unknown)}; choose from {', '.join(nets)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names or list(nets):
        line = probe(zoo, name, nets[name], args.size, args.out)
        failed += "FAILED" in line
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
