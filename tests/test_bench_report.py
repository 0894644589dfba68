"""bench/bench.py's pure parts: the plan's channel slices, layer bytes, the Track A breakdown's
totals and the printed tables, on made-up numbers (no GPU, no torch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from dualtrack.contract.plan import KernelCall, Segment, TensorSpec

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dualtrack_bench", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _t(name: str, h: int, c: int) -> TensorSpec:
    return TensorSpec(name, (1, h, h, c), "float16", "NHWC")


def _segment() -> Segment:
    """One U-Net level: conv, pool, conv, up, concat [up, skip] (and a concat of that concat, to
    check that nested slices add up)."""
    calls = (
        KernelCall("conv3x3", ("x",), ("skip",), ("e/conv.weight", "e/conv.bias"), (("relu", 1),), ("e/conv",)),
        KernelCall("maxpool2x2", ("skip",), ("pool",), nodes=("e/pool",)),
        KernelCall("conv3x3", ("pool",), ("mid",), ("m/conv.weight",), nodes=("m/conv",)),
        KernelCall("convt2x2", ("mid",), ("up",), ("d/up.weight", "d/up.bias"), nodes=("d/up",)),
        KernelCall("concat", ("up", "skip"), ("cat",), nodes=("d/concat",)),
        KernelCall("concat", ("extra", "cat"), ("cat2",), nodes=("d/concat2",)),
    )
    tensors = (_t("skip", 8, 4), _t("pool", 4, 4), _t("mid", 4, 16), _t("up", 8, 6), _t("cat", 8, 10))
    return Segment(
        index=1,
        track="A",
        nodes=(),
        inputs=(_t("x", 8, 3), _t("extra", 8, 2)),
        outputs=(_t("cat2", 8, 12),),
        onnx="",
        calls=calls,
        tensors=tensors,
    )


def test_channel_slices_follow_concats_as_the_engine_lays_them_out(bench: ModuleType) -> None:
    s = bench.channel_slices(_segment())
    assert s["x"] == ("x", 0) and s["pool"] == ("pool", 0) and s["mid"] == ("mid", 0)
    assert s["cat2"] == ("cat2", 0) and s["extra"] == ("cat2", 0)
    assert s["cat"] == ("cat2", 2)  # after `extra` (2 channels)
    assert s["up"] == ("cat2", 2)
    assert s["skip"] == ("cat2", 2 + 6)  # after `extra` and `up`


def test_layer_label_names_weights_then_node(bench: ModuleType) -> None:
    calls = {c.op: c for c in _segment().calls}
    assert bench.layer_label(calls["convt2x2"]) == "d/up"
    assert bench.layer_label(calls["maxpool2x2"]) == "e/pool"
    assert bench.layer_label(KernelCall("maxpool2x2", ("a",), ("b",))) == "b"


def test_layer_bytes_counts_each_tensor_once(bench: ModuleType) -> None:
    assert bench.layer_bytes("maxpool2x2", 2, 8, 6, 4, 4, 2) == (2 * 8 * 6 * 4 + 2 * 4 * 3 * 4) * 2
    x, w, y = 2 * 4 * 3 * 16, 4 * 16 * 8 + 8, 2 * 8 * 6 * 8
    assert bench.layer_bytes("convt2x2", 2, 4, 3, 16, 8, 2) == (x + w + y) * 2
    with pytest.raises(ValueError, match="not 'conv3x3'"):
        bench.layer_bytes("conv3x3", 1, 1, 1, 1, 1, 2)


def _calls() -> list[dict]:
    return [
        {"segment": "seg1_A", "op": "copy", "name": "in x", "kernel": "DtoD", "ms": 0.004},
        {"segment": "seg1_A", "op": "conv3x3", "name": "enc1/conv1", "kernel": "k", "ms": 0.030},
        {"segment": "seg1_A", "op": "maxpool2x2", "name": "enc1/pool", "kernel": "p", "ms": 0.010},
        {"segment": "seg1_A", "op": "conv3x3", "name": "dec1/conv2", "kernel": "k", "ms": 0.060},
        {"segment": "seg1_A", "op": "convt2x2", "name": "dec1/up", "kernel": "u", "ms": 0.020},
    ]


def test_summarize_breakdown_sums_by_op_and_takes_the_gap(bench: ModuleType) -> None:
    s = bench.summarize_breakdown(_calls(), 0.150)
    assert s["kernel_sum_ms"] == pytest.approx(0.124)
    assert s["by_op_ms"] == {"conv3x3": 0.09, "convt2x2": 0.02, "maxpool2x2": 0.01, "copy": 0.004}
    assert list(s["by_op_ms"]) == ["conv3x3", "convt2x2", "maxpool2x2", "copy"]  # largest first
    assert s["graph_ms"] == 0.15 and s["gap_ms"] == pytest.approx(0.026)


def test_breakdown_lines_two_per_batch_slowest_first(bench: ModuleType) -> None:
    bd = {str(b): {**bench.summarize_breakdown(_calls(), 0.150), "calls": _calls()} for b in (8, 1)}
    lines = bench.breakdown_lines(bd, top=3)
    assert len(lines) == 1 + 2 * 2
    assert lines[1].startswith("N=1: sum 0.124 ms (conv3x3 0.090, convt2x2 0.020, maxpool2x2 0.010, copy 0.004)")
    assert lines[1].endswith("graph 0.150 ms, gap 0.026 ms (17%)")
    assert lines[2] == "  top: dec1/conv2 60.0 us, enc1/conv1 30.0 us, dec1/up 20.0 us"
    assert lines[3].startswith("N=8:")
    assert bench.breakdown_lines({}) == []


def _conv_row(layer: str, batch: int, ratio: float, *, op: bool = True) -> dict:
    row = {
        "layer": layer, "segment": "seg1_A", "batch": batch, "N": batch, "H": 64, "W": 64, "C": 32, "K": 32,
        "impl": "wgmma", "entry": "conv3x3_wgmma_x", "ours_ms": 0.01, "ours_tflops": 50.0,
        "cudnn_ms": 0.01 * ratio, "cudnn_tflops": 50.0 / ratio, "ratio": ratio,
        "meets_target": ratio >= 0.7, "rel_l2_vs_cudnn": 1e-4, "launch_bound_warning": False,
    }  # fmt: skip
    return {"op": "conv3x3", **row} if op else row


def _memory_row(op: str, layer: str, batch: int) -> dict:
    return {
        "op": op, "layer": layer, "segment": "seg1_A", "batch": batch, "N": batch, "H": 64, "W": 64, "C": 32,
        "K": 32 if op == "maxpool2x2" else 16, "ldx": 64, "ldy": 32, "entry": f"{op}_f16", "bytes": 1 << 20,
        "ours_ms": 0.004, "ours_gbps": 262.1, "torch_ms": 0.006, "torch_gbps": 174.8, "ratio": 1.5,
        "rel_l2_vs_torch": 0.0, "launch_bound_warning": op == "convt2x2",
    }  # fmt: skip


def test_print_table_counts_the_target_over_conv3x3_rows_only(bench: ModuleType, capsys) -> None:
    layers = [
        _conv_row("enc1/conv1", 1, 0.5),
        _conv_row("enc1/conv2", 1, 1.2, op=False),  # a row written before the "op" key: a conv
        _memory_row("maxpool2x2", "enc1/pool", 1),
        _memory_row("convt2x2", "dec1/up", 1),
    ]
    bd = {"1": {**bench.summarize_breakdown(_calls(), 0.150), "calls": _calls()}}
    bench.print_table([], layers, bd)
    out = capsys.readouterr().out
    assert "1 of 2 layer/batch pairs meet the target" in out
    assert "sum N=1: ours 0.020 ms, cuDNN 0.017 ms" in out  # the conv rows alone
    assert "sum N=1: ours 0.008 ms, torch 0.012 ms" in out
    pool = next(line for line in out.splitlines() if line.startswith("enc1/pool"))
    assert pool.split()[4:10] == ["64/32", "4.0", "262", "6.0", "175", "1.50"]
    assert next(line for line in out.splitlines() if line.startswith("dec1/up")).endswith("LAUNCH-BOUND")
    assert out.rstrip().splitlines()[-3].startswith("Track A: its calls one by one")


def test_memory_layer_lines_empty_without_memory_rows(bench: ModuleType) -> None:
    assert bench.memory_layer_lines([_conv_row("enc1/conv1", 1, 0.9)]) == []
