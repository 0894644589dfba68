"""A small conv net in fp32 torch and its bundle with `window:` (64x64 windows, batches of 4), for the
sliding-window tests (tests/test_tiling.py on the CPU, tests/gpu/test_tiling_gpu.py on a GPU: there the
bundle is carried as DUALTRACK_TEST_WINDOW_BUNDLE, built by bench/prepare_carry.sh)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import torch

WINDOW = (64, 64)
MEAN, STD = (0.0, 0.0, 0.0), (0.229, 0.224, 0.225)  # mean 0: zero pixels pad as MONAI's cval 0 does


class SmallNet(torch.nn.Module):
    """Three classes from a few convolutions (a receptive field of 11 pixels)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 12, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(12, 12, 5, padding=2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(12, 12, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(12, 3, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def small_net() -> SmallNet:
    """The network, its weights seeded (the same every call)."""
    torch.manual_seed(7)
    return SmallNet().eval()


def build_window_bundle(root: Path, dest: Path, targets: Sequence[str] = ()) -> Path:
    """:func:`small_net` exported to ONNX (torch's exporter, fp32) and built with `window:` into ``dest``."""
    from dualtrack.compiler.build import build

    root.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        small_net(), torch.zeros(1, 3, *WINDOW), str(root / "net.onnx"), input_names=["x"], output_names=["logits"],
        opset_version=17, dynamo=False,
    )  # fmt: skip
    (root / "net.yaml").write_text(
        textwrap.dedent(f"""\
        model: net.onnx
        batch_sizes: [1, 4]
        targets: {list(targets)}
        preprocess: {{layout: NCHW, color: RGB, scale: 255, mean: {list(MEAN)}, std: {list(STD)}}}
        postprocess: {{output: logits, activation: softmax}}
        window: {{overlap: 0.25, blend: gaussian}}
        verify: {{samples: 1, seed: 5}}
        """)
    )
    build(root / "net.yaml", dest)
    return dest
