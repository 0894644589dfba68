"""Write a copy of a build config whose Track A takes every node the mobile kernels accept
(``lower_mobile.supports``), by name, as hand-written rules (they replace the config's
``partition``): a MobileNetV3-style export (the zoo's LR-ASPP) with its depthwise convolutions, SE
blocks, activations, adds and Resizes on Track A and its dense convolutions on Track B, to set
against the plan ``partition: auto`` chooses.

    python bench/mobile_track_a.py configs/zoo/tv_lraspp_mobilenet_v3_large.yaml -o /tmp/lraspp_a.yaml \\
        [--targets sm_90a] [--batch-sizes 1 8] [--output build/lraspp_a]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from dualtrack.compiler import config, frontend, lower_mobile, partition


def supported_nodes(cfg_path: Path) -> list[str]:
    """The names of the nodes of the config's processed model that a mobile kernel takes."""
    cfg, fe = frontend.load(config.load_config(cfg_path))
    model = partition.name_nodes(fe.model)
    facts = lower_mobile.Facts(model, partition.batch_checked_specs(model, (1, *cfg.batch_sizes)))
    return [
        n.name for n in model.graph.node if lower_mobile.claims(n, facts) and lower_mobile.supports(n, facts) is None
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True, help="the config to write")
    ap.add_argument("--targets", nargs="+")
    ap.add_argument("--batch-sizes", nargs="+", type=int)
    ap.add_argument("--output", help="the bundle directory the new config names")
    args = ap.parse_args()
    raw = yaml.safe_load(args.config.read_text())
    names = supported_nodes(args.config)
    for key in ("model", "output"):  # paths are relative to the config, and the copy may live elsewhere
        if raw.get(key):
            raw[key] = str((args.config.parent / raw[key]).resolve())
    if raw.get("output"):
        raw["output"] += "_track_a"  # never over the original config's bundle
    raw["partition"] = {"track_a": {"name_prefixes": names}}
    for key, value in (("targets", args.targets), ("batch_sizes", args.batch_sizes), ("output", args.output)):
        if value:
            raw[key] = value
    args.out.write_text(yaml.safe_dump(raw, sort_keys=False))
    print(f"{args.out}: {len(names)} nodes on Track A")


if __name__ == "__main__":
    main()
