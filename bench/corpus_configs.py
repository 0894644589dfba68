"""Bench configs for the corpus (configs/zoo/<name>.yaml) on one GPU machine, where the carry is small.

    python bench/corpus_configs.py OUT_DIR NAME [NAME ...]

For each zoo config it writes two configs into OUT_DIR: `<name>.yaml`, the zoo config as a user wrote it
(its partition, flags, pre- and post-processing) for the H200/H100 only (`targets: [sm_90a]`) and without
llvm-cpu modules (`track_b.cpu: false`: the bundle is then checked on the GPU, at its first load against
its reference cases and by bench/zoo_bench.py's verify_engine, instead of on this CPU); and
`<name>.iree.yaml`, the same with `partition: iree` (IREE alone, the `<zoo>/iree_alone` row), and
`<name>.iree_no_vd.yaml`, IREE alone with :data:`NO_VD` (IREE 3.13's fp16 CUDA code under its default flags is
wrong on the GPU for a 1x1 16 -> 16 conv + residual and refused at load for MONAI UNet and PSPNet; with these
flags it verified there: docs/facts.md 26). Paths become absolute, so the configs build from anywhere.
bench/prepare_carry.sh corpus builds them.

    python bench/corpus_configs.py OUT_DIR NAME [NAME ...] --fp8

also writes `<name>.fp8.yaml` (issue 42): the bench config with `precision: fp8` and :data:`FP8_CALIBRATION`
(bench/prepare_fp8.sh builds it).
A NAME ending in `.yaml` is a config path (configs/unet.yaml), written as `<stem>.yaml` the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

# The corpus's fp8 builds calibrate on seeded random images (no data set here) of a model whose weights are
# random (models/zoo/export.py) or re-weighted (bench/reweight.py): most pixels' top two classes are close,
# so e4m3's 3-5% per convolution moves masks that a trained model on its own images would keep (docs/fp8.md
# "Random weights"). The default floor (99.5%) would refuse the build; the bench lowers it to measure the
# speed, and the build and bench/fp8_bench.py record the agreement measured. Not settings to serve with.
# Four images (three calibrate, one held out): the fp8 plan's CPU verification of a ResNet-34 U-Net at
# 512x512 runs the kernels' numpy references, minutes an image on two cores.
FP8_CALIBRATION = {"samples": 4, "agreement_floor": 80}


def bench_config(name: str) -> dict:
    """The bench form of a zoo config (or, for a NAME ending in .yaml, of that config): sm_90a only, no
    llvm-cpu modules, absolute paths."""
    path = Path(name).resolve() if name.endswith(".yaml") else ROOT / "configs" / "zoo" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"] = str((path.parent / raw["model"]).resolve())
    if "tuning" in raw:
        raw["tuning"] = str((path.parent / raw["tuning"]).resolve())
    raw.pop("output", None)
    raw["targets"] = ["sm_90a"]
    raw.setdefault("track_b", {})["cpu"] = False
    return raw


def fp8_config(cfg: dict) -> dict:
    """``cfg`` (a bench config) with ``precision: fp8`` and :data:`FP8_CALIBRATION`."""
    return {**cfg, "precision": "fp8", "calibration": dict(FP8_CALIBRATION)}


# Track B flags of the `no_vd` IREE-alone variant: no vector distribution, no tile-and-fuse matmuls.
NO_VD = [
    "--iree-codegen-llvmgpu-use-vector-distribution=false",
    "--iree-codegen-llvmgpu-use-tile-and-fuse-matmul=false",
]


def no_vd_config(cfg: dict) -> dict:
    """IREE alone with :data:`NO_VD` added to the config's CUDA flags."""
    track_b = dict(cfg.get("track_b") or {})
    track_b["cuda_flags"] = [*track_b.get("cuda_flags", []), *NO_VD]
    return {**cfg, "partition": "iree", "track_b": track_b}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(usage=__doc__.strip().splitlines()[2].strip())
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--fp8", action="store_true", help="also write <name>.fp8.yaml")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        cfg = bench_config(name)
        stem = Path(name).stem if name.endswith(".yaml") else name
        (args.out / f"{stem}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        (args.out / f"{stem}.iree.yaml").write_text(yaml.safe_dump({**cfg, "partition": "iree"}, sort_keys=False))
        (args.out / f"{stem}.iree_no_vd.yaml").write_text(yaml.safe_dump(no_vd_config(cfg), sort_keys=False))
        if args.fp8:
            (args.out / f"{stem}.fp8.yaml").write_text(yaml.safe_dump(fp8_config(cfg), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
