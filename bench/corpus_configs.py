"""Bench configs for the corpus (configs/zoo/<name>.yaml) on one GPU machine, where the carry is small.

    python bench/corpus_configs.py OUT_DIR NAME [NAME ...]

For each zoo config it writes two configs into OUT_DIR: `<name>.yaml`, the zoo config as a user wrote it
(its partition, flags, pre- and post-processing) for the H200/H100 only (`targets: [sm_90a]`) and without
llvm-cpu modules (`track_b.cpu: false`: the bundle is then checked on the GPU, at its first load against
its reference cases and by bench/zoo_bench.py's verify_engine, instead of on this CPU); and
`<name>.iree.yaml`, the same with `partition: iree` (IREE alone, the `<zoo>/iree_alone` row). Paths
become absolute, so the configs build from anywhere. bench/prepare_carry.sh corpus builds them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def bench_config(name: str) -> dict:
    path = ROOT / "configs" / "zoo" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"] = str((path.parent / raw["model"]).resolve())
    raw.pop("output", None)
    raw["targets"] = ["sm_90a"]
    raw.setdefault("track_b", {})["cpu"] = False
    return raw


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:]:
        cfg = bench_config(name)
        (out / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        (out / f"{name}.iree.yaml").write_text(yaml.safe_dump({**cfg, "partition": "iree"}, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
