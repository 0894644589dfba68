"""The attention kernel (handwritten_ptx/attention.cu) on a real GPU against onnxruntime in fp32 on the
same fp16-exact values: the graphs of tests/attention_cases.py (1/2/3/4/8 heads, d 16/32/64/128,
Lq != Lk with tails past the 64-row tiles, a head bias, a causal mask, the scale after the product,
as a Div, on Q, on Q and K; K handed over transposed, which the element-wise load path reads), at
batch 3, with the operands 16-byte aligned (the vector path) and one element off (every load
element-wise); and torch's exports of a SegFormer-style block, whose operands are NHWC images, and of
nn.MultiheadAttention. The
output is poisoned (NaN) first, so an element the kernel does not write fails. The launches are
kernels.attention's (AttentionSpec.prepare_inputs: what the runtime launches).

Tolerance: rel-L2 2e-3 and max |diff| 2e-2 against the fp32 answer. The kernel rounds each
probability to fp16 before the product with V (as flash attention does; 2^-12 relative on average)
and the output once (2^-11 at most): together ~5e-4 rel-L2 on unit-variance values; the outputs
are convex combinations of V's rows (|o| < 5), where an fp16 ulp is at most 4e-3."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from attention_cases import Case, attention_graph, exported_fp16, feeds, track_a_array
from gpu_ptx import checked_in_entries
from onnx import TensorProto, numpy_helper

from dualtrack import kernels
from dualtrack.compiler import attention_patterns, lower_mobile, partition
from dualtrack.compiler.config import Tolerance
from dualtrack.compiler.verify import compare
from dualtrack.contract.plan import KernelCall
from dualtrack.runtime.engine import Engine

ATTN = kernels.KERNELS["attention"]
TOL = Tolerance(rel_l2=2e-3, max_abs=2e-2, mismatch=0)

CASES = [
    Case(1, 32, 37, 53, flat=True),
    Case(1, 64, 20, 20, "div", "causal"),
    Case(3, 32, 70, 19, "scores", "head"),
    Case(3, 64, 65, 130, "q", "none", kt=True),
    Case(8, 32, 33, 64, "qk", "causal"),
    Case(8, 64, 1, 77, "div", "head"),
    Case(3, 16, 9, 200, "scores", "causal", kt=True),
    Case(2, 128, 17, 31, "q", "head"),
    Case(4, 64, 1000, 333, "div", "head"),
    Case(2, 128, 130, 257, "q", "causal"),
]


@dataclass
class Dev:
    """A device tensor as a spec reads it (kernels.base.DeviceTensor), possibly one element off alignment."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    channel_stride: int


@pytest.fixture(scope="module")
def mods(engine: Engine):
    with checked_in_entries(engine, ("attention",)) as found:
        yield found


def upload(engine: Engine, x: np.ndarray, off: int, keep: list) -> Dev:
    """``x`` (fp16) on the device, ``off`` elements into its buffer (1: not 16-byte aligned)."""
    flat = np.zeros(x.size + 8, np.float16)
    flat[off : off + x.size] = x.reshape(-1)
    d = engine.backend.from_host(flat)
    keep.append(d)
    return Dev(d.ptr + 2 * off, x.shape, np.dtype(np.float16), x.shape[-1])


def launch(engine: Engine, mods, call: KernelCall, inputs: list[np.ndarray], out_shape, weights: dict, off: int):
    keep: list = []
    ins = [upload(engine, x.astype(np.float16), off, keep) for x in inputs]
    y = engine.backend.from_host(np.full(out_shape, np.nan, np.float16))
    packed = ATTN.pack_weights(call, weights)
    w = [engine.backend.from_host(packed[name]) for name in call.weights]
    p = ATTN.prepare_inputs(call, ins, Dev(y.ptr, y.shape, y.dtype, y.shape[-1]), w, None)  # type: ignore[arg-type]
    mods[p.entry].launch(p.config.grid, p.config.block, p.config.shared_bytes, engine.backend.stream, p.args)
    return engine.backend.to_host(y).astype(np.float32)


@pytest.mark.parametrize("off", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_attention_kernel_matches_onnxruntime(engine, mods, case: Case, off: int) -> None:
    model = attention_graph(case)
    facts = lower_mobile.Facts(model, partition.infer_specs(model))
    call = next(iter(attention_patterns.find_attention(facts, set()).found.values())).call
    x = feeds(case, n=3, seed=int(np.random.default_rng().integers(1 << 30)))
    sess = ort.InferenceSession(
        attention_graph(case, TensorProto.FLOAT).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (want,) = sess.run(None, x)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    got = launch(engine, mods, call, [x[t] for t in call.inputs], want.shape, weights, off)
    result = compare(f"attention {case.id()} off {off}", want, got, TOL)
    assert result.passed, result


@pytest.mark.parametrize("name", ["sra", "mha", "mha_seq_first"])
def test_exported_attention_read_through_its_views(engine, mods, tmp_path: Path, name: str) -> None:
    """SegFormer-style: Q from a 1x1 conv, K and V from one strided conv, NHWC images read through their
    views; torch's nn.MultiheadAttention (batch_first and not): its sequence-first projections moved onto
    batch-major tensors by the front end, Q, K, V read out of the fused projection, the output written in
    the (N, L, E) rows the out-projection reads."""
    model = exported_fp16(tmp_path, name, dynamo=False)
    facts = lower_mobile.Facts(model, partition.infer_specs(model))
    call = next(iter(attention_patterns.find_attention(facts, set()).found.values())).call
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    for t in dict.fromkeys([*call.inputs, *call.outputs]):
        probe.graph.output.append(inferred[t])
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    shape = partition.infer_specs(model)[model.graph.input[0].name][0]
    x = np.random.default_rng().standard_normal((3, *shape[1:])).astype(np.float32)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {model.graph.input[0].name: x}), strict=True))
    roots = [track_a_array(outs[t]).astype(np.float32) for t in call.inputs]
    want = ATTN.run_reference(call, roots, {}).astype(np.float32)  # the numpy reference, checked against ORT on the CPU
    got = launch(engine, mods, call, roots, want.shape, {}, 0)
    result = compare(f"attention {name}", want, got, TOL)
    assert result.passed, result


THROUGHPUT = [  # name, batch, heads, Lq, Lk, d: the segmenters' attentions at 512x512, N=8
    ("segformer_b0_stage1", 8, 1, 16384, 256, 32),
    ("segformer_b0_stage4", 8, 8, 256, 256, 32),
    ("unetr_vit_b16", 8, 12, 1024, 1024, 64),
]


@pytest.mark.parametrize(("name", "n", "heads", "lq", "lk", "d"), THROUGHPUT)
def test_attention_throughput_on_segmenter_shapes(engine, mods, name, n, heads, lq, lk, d) -> None:
    """Times 20 launches on token tensors (N, L, heads*d) and prints TFLOP/s (4·N·h·Lq·Lk·d FLOPs a
    launch): what the cost model's row for the kernel should be (run with -s). Image 0 is checked
    against the float32 reference at this test's tolerance."""
    from dualtrack.kernels.attention import AttentionGeometry, OperandView
    from dualtrack.runtime.driver import Event

    c = heads * d
    views = (
        OperandView(0, lq * c, d, c, 1), OperandView(0, lk * c, d, c, 1),
        OperandView(0, lk * c, d, c, 1), OperandView(0, lq * c, d, c, 1),
    )  # fmt: skip
    geom = AttentionGeometry(heads, d, lq, lk, d**-0.5, views, (lq, c))
    call = KernelCall("attention", ("q", "k", "v"), ("o",), (), geom.attrs(), (name,))
    rng = np.random.default_rng()
    x = [rng.standard_normal((n, length, c)).astype(np.float16) for length in (lq, lk, lk)]
    keep: list = []
    ins = [upload(engine, a, 0, keep) for a in x]
    y = engine.backend.from_host(np.full((n, lq, c), np.nan, np.float16))
    p = ATTN.prepare_inputs(call, ins, Dev(y.ptr, y.shape, y.dtype, c), [], None)  # type: ignore[arg-type]
    stream, fn = engine.backend.stream, mods[p.entry]
    for _ in range(3):
        fn.launch(p.config.grid, p.config.block, p.config.shared_bytes, stream, p.args)
    start, end = Event(engine.backend.ctx), Event(engine.backend.ctx)
    start.record(stream)
    for _ in range(20):
        fn.launch(p.config.grid, p.config.block, p.config.shared_bytes, stream, p.args)
    end.record(stream)
    ms = start.elapsed_ms(end) / 20
    tflops = 4.0 * n * heads * lq * lk * d / (ms * 1e9)
    print(f"\nattention {name}: N={n} heads={heads} Lq={lq} Lk={lk} d={d}: {ms * 1e3:.1f} us, {tflops:.1f} TFLOP/s")
    got = engine.backend.to_host(y)[:1].astype(np.float32)
    heads_of = [a[:1].astype(np.float32).reshape(1, -1, heads, d).transpose(0, 2, 1, 3) for a in x]
    want = kernels.attention.reference(*heads_of, d**-0.5).transpose(0, 2, 1, 3).reshape(1, lq, c)
    result = compare(f"attention {name}", want, got, TOL)
    assert result.passed, result
