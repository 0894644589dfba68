"""`dualtrack build` of a tiny MobileNetV3-like network (tests/mobile_net.py) in fp16 with its body
on Track A: the mobile kernels' calls (depthwise, SE, HardSwish, bilinear and nearest Resize, and
the fp32 islands the fp16 conversion makes around pooling and Resize) verify on the CPU against
onnxruntime (the segment through IREE llvm-cpu, and the calls by their numpy references), and the
bundle ships the kernels' PTX. The GPU side: tests/gpu/test_mobile_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mobile_net import write_mobile_project

from dualtrack.compiler.build import build
from dualtrack.contract.bundle import Bundle


@pytest.fixture(scope="module")
def mobile_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mobile")
    build(write_mobile_project(root), root / "out")  # raises when verification fails
    return root / "out"


def test_mobile_body_runs_on_the_mobile_kernels_and_verifies(mobile_bundle: Path) -> None:
    report = json.loads((mobile_bundle / "verify.json").read_text())
    assert report["passed"] is True and report["precision"] == "fp16"
    names = [c["name"] for c in report["checks"]]
    assert any(n.startswith("seg1_A[numpy kernels]") for n in names)
    assert any(n.startswith("seg1_A[llvm-cpu]") for n in names)
    plan = Bundle.open(mobile_bundle).manifest.plan
    assert [s.track for s in plan.segments] == ["B", "A", "B"]
    calls = plan.segments[1].calls
    ops = {c.op for c in calls}
    assert {"dwconv", "gap", "fc", "eltwise", "resize", "conv"} <= ops  # the dense 1x1s: the general conv
    # the fp16 conversion's Cast -> GlobalAveragePool -> Cast is one fp16 gap call
    se_pool = next(c for c in calls if "body/b2/se/pool" in c.nodes)
    assert se_pool.op == "gap" and len(se_pool.nodes) == 3
    casts = [n for n in plan.segments[1].nodes if "_cast" in n]  # onnxconverter-common's names
    assert len(casts) >= 4  # around both SE pools and both Resizes: each inside a gap or resize call
    assert all(any(n in c.nodes and c.op in ("gap", "resize") for c in calls) for n in casts)


def test_bundle_ships_the_mobile_kernels(mobile_bundle: Path) -> None:
    manifest = json.loads((mobile_bundle / "manifest.json").read_text())
    text = json.dumps(manifest)
    for stem in ("dwconv_nhwc", "gap_nhwc", "fc_nhwc", "eltwise_nhwc", "resize_nhwc"):
        assert stem in text
    ptx = list((mobile_bundle / "track_a").rglob("*.ptx"))
    assert {p.stem for p in ptx} >= {"dwconv_nhwc", "gap_nhwc", "fc_nhwc", "eltwise_nhwc", "resize_nhwc"}
