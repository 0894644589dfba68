"""A test network whose ``body/`` nodes run on Track A and the rest on Track B, written as a project
(model + rules config) and built and verified on the CPU: the config the network tests share
(test_conv_family, test_depth_to_space, test_group_merge, mobile_net's GPU bundle)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

CONFIG = """\
model: {name}.onnx
precision: {precision}
batch_sizes: [{batch_sizes}]
targets: [{targets}]
partition:
  mode: rules
  track_a:
    name_prefixes: [body/]
verify:
  samples: 1
"""


def write_body_project(
    root: Path,
    model: onnx.ModelProto,
    name: str,
    *,
    precision: str = "fp32",
    batch_sizes: tuple[int, ...] = (1,),
    targets: tuple[str, ...] = ("sm_80",),
) -> Path:
    """``model`` as ``root/<name>.onnx`` and its config ``root/<name>.yaml`` (returned)."""
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / f"{name}.onnx"))
    cfg = root / f"{name}.yaml"
    cfg.write_text(
        CONFIG.format(
            name=name, precision=precision, batch_sizes=", ".join(map(str, batch_sizes)), targets=", ".join(targets)
        )
    )
    return cfg


def build_body_net(root: Path, model: onnx.ModelProto, name: str, **config: Any) -> tuple[Path, dict[str, Any]]:
    """:func:`write_body_project` in ``root``, built into ``root/out`` (the build raises when
    verification fails); the bundle's path and its verify.json."""
    from dualtrack.compiler.build import build

    out = root / "out"
    build(write_body_project(root, model, name, **config), out)
    return out, json.loads((out / "verify.json").read_text())
