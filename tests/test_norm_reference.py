"""The group norm's semantics and numerics on the CPU, for shapes no zoo model has.

1. kernels.norm's numpy float64 reference (NormSpec.reference) against onnxruntime on fresh random
   inputs: InstanceNormalization, GroupNormalization opset 18 (one node, per-group scale and bias)
   and torch's decomposed form (Reshape, InstanceNormalization, Reshape, Mul, Add), C 1..36, G 1, 2,
   4, C, pictures from 1x1, batches 1 and 5. Tolerance 1e-4 abs and rel (float32 rounding only).
2. The statistics arithmetic of handwritten_ptx/norm_nhwc.cu (sums shifted by a thread's first
   value, rows merged by Chan's formula in a tree, the image's partials merged a team a group, each
   lane's in two alternating chains, as offsets from the group's first partial mean), emulated in
   float32 over the kernel's own chunking, against float64 on the cancellation case (mean 100, std
   0.01), where E[x^2] - E[x]^2 in float32 loses every digit (and so does onnxruntime's
   GroupNormalization-18: it is not the reference there). Tolerance: the variance within 1e-3
   relative, the mean within 1 float32 ulp of 100 (7.6e-6).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dualtrack import kernels

NORM = kernels.KERNELS["norm"]
RTOL, ATOL = 1e-4, 1e-4
F = np.float32


def run_ort(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], x: np.ndarray, opset: int) -> np.ndarray:
    graph = helper.make_graph(
        nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def tensor(name: str, v: np.ndarray) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(v), name)


SHAPES = [(n, c, h, w) for n, c, h, w in ((1, 1, 1, 1), (5, 3, 3, 5), (1, 20, 17, 9), (5, 36, 3, 5), (1, 8, 1, 1))]


@pytest.mark.parametrize(("n", "c", "h", "w"), SHAPES)
@pytest.mark.parametrize("g", [1, 2, 4, 0])
@pytest.mark.parametrize("form", ["instance", "group18", "decomposed"])
def test_reference_matches_onnxruntime(n: int, c: int, h: int, w: int, g: int, form: str) -> None:
    g = g or c
    if c % g or (form == "instance" and g != c):
        pytest.skip("C must be a multiple of G; InstanceNormalization is G = C")
    rng = np.random.default_rng()
    x = (3 * rng.standard_normal((n, c, h, w)) + 1).astype(F)
    eps = float(rng.choice([1e-5, 1e-3]))
    gamma, beta = (rng.standard_normal(c) * 0.5 + 1).astype(F), (rng.standard_normal(c) * 0.5).astype(F)
    if form == "instance":
        node = helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=eps)
        want = run_ort([node], [tensor("s", gamma), tensor("b", beta)], x, 17)
    elif form == "group18":
        gamma, beta = np.repeat(gamma[:g], c // g), np.repeat(beta[:g], c // g)  # one per group, as opset 18
        node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], epsilon=eps, num_groups=g)
        want = run_ort([node], [tensor("s", gamma[:: c // g]), tensor("b", beta[:: c // g])], x, 18)
    else:
        nodes = [
            helper.make_node("Reshape", ["x", "shape"], ["t0"]),
            helper.make_node("InstanceNormalization", ["t0", "ones", "zeros"], ["t1"], epsilon=eps),
            helper.make_node("Reshape", ["t1", "back"], ["t2"]),
            helper.make_node("Mul", ["t2", "s"], ["t3"]),
            helper.make_node("Add", ["t3", "b"], ["y"]),
        ]
        inits = [
            tensor("shape", np.array([0, g, -1], np.int64)), tensor("back", np.array([n, c, h, w], np.int64)),
            tensor("ones", np.ones(g, F)), tensor("zeros", np.zeros(g, F)),
            tensor("s", gamma.reshape(c, 1, 1)), tensor("b", beta.reshape(c, 1, 1)),
        ]  # fmt: skip
        want = run_ort(nodes, inits, x, 17)
    got = NORM.reference(x.transpose(0, 2, 3, 1), gamma, beta, kind="group", groups=g, eps=eps)
    # onnxruntime's float32 mean may miss the exact one by an ulp or two of |x|, which the normaliser
    # 1 / sqrt(var + eps) amplifies where a group's values nearly agree: a group of one value (var 0: seen
    # 2.0e-4 at eps 1e-5), or of two close ones (seen 1.5e-4). The bound follows the smallest group variance.
    groups = x.astype(np.float64).reshape(n, g, -1)
    least = float(groups.var(axis=2).min())
    atol = ATOL + 4 * np.finfo(F).eps * float(np.abs(x).max() * np.abs(gamma).max()) / np.sqrt(least + eps)
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2), want, rtol=RTOL, atol=atol)


# -- the kernel's statistics arithmetic, emulated in float32 -------------------------------------------


def chan(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Moments.add (norm_nhwc.cu) elementwise in float32: b merged into a, where b has values."""
    (n, mean, m2), (nb, mb, m2b) = a, b
    total = n + nb
    d = mb - mean
    f = np.where(nb > 0, nb / np.where(total > 0, total, F(1)), F(0)).astype(F)
    return (
        np.where(nb > 0, total, n).astype(F),
        np.where(nb > 0, mean + d * f, mean).astype(F),
        np.where(nb > 0, m2 + m2b + d * d * n * f, m2).astype(F),
    )


def chunk_partials(x: np.ndarray, p0: int, length: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """stats_tile of one chunk of an image (x: HW x C, float32): each row's shifted sums, then the tree."""
    c = x.shape[1]
    cnt = np.array([(length - r + rows - 1) // rows if r < length else 0 for r in range(rows)], F)
    shift = np.stack([x[p0 + r] if r < length else np.zeros(c, F) for r in range(rows)])
    s1, s2 = np.zeros((rows, c), F), np.zeros((rows, c), F)
    for r in range(min(rows, length)):
        d = x[p0 + r : p0 + length : rows] - shift[r]
        for v in d:  # in order, as the thread adds them
            s1[r] += v
            s2[r] = (s2[r] + v * v).astype(F)
    inv = np.where(cnt > 0, F(1) / np.maximum(cnt, F(1)), F(0))[:, None].astype(F)
    m = [np.repeat(cnt[:, None], c, 1), (shift + s1 * inv).astype(F), np.maximum(s2 - s1 * s1 * inv, F(0)).astype(F)]
    top = 1 << (rows - 1).bit_length()
    half = top // 2
    while half > 0:
        lo, hi = slice(0, rows - half), slice(half, rows)  # row r < half with r + half < rows
        merged = chan(tuple(a[lo] for a in m), tuple(a[hi] for a in m))
        for a, b in zip(m, merged, strict=True):
            a[lo] = b
        half //= 2
    return m[1][0], m[2][0]


def lane_chains(items: list[tuple], S: int, rounds: int) -> tuple[np.ndarray, ...]:
    """A team's merge of ``items`` (each (n, mean, m2) as float32 scalars): lane l takes items l, l + S,
    ... in order (in rounds of ``rounds``, two alternating chains, as finalize_image's unrolled loads;
    1: one chain, as group_partials), then the lanes meet pairwise."""
    lanes = []
    for lane in range(S):
        chains = [(np.zeros(1, F), np.zeros(1, F), np.zeros(1, F)) for _ in range(2)]
        mine = items[lane::S]
        whole = len(mine) // rounds * rounds if rounds > 1 else 0
        for u, item in enumerate(mine):
            if rounds > 1 and u == whole:
                chains[0] = chan(chains[0], chains[1])
            c = u % 2 if u < whole else 0
            chains[c] = chan(chains[c], tuple(np.array([v], F) for v in item))
        if rounds > 1 and whole == len(mine):
            chains[0] = chan(chains[0], chains[1])
        lanes.append(chains[0])
    while len(lanes) > 1:
        lanes = [chan(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
    return lanes[0]


def kernel_group_stats(x: np.ndarray, groups: int, sms: int = 132) -> tuple[np.ndarray, np.ndarray]:
    """mean, var of each group of one image (HW x C float32) as the kernel's arithmetic gives them: a
    block holds every channel here, so each chunk's channel summaries merge into a partial a group
    (group_partials: means as offsets from the group's first channel), which the last block merges
    (finalize_image: offsets from chunk 0's partial, rounds of 8)."""
    hw, c = x.shape
    ch = NORM.chunking(1, hw, 1, c, groups, sms, 1, itemsize=4)
    assert ch.tiles == 1
    rows = NORM.block_threads // min(c, NORM.block_threads)
    cg = c // groups
    S = NORM.merge_team(groups, cg)
    gpart = []  # per chunk: (mean[g], m2[g])
    for k in range(ch.chunks):
        length = min(ch.chunk, hw - k * ch.chunk)
        mean, m2 = chunk_partials(x, k * ch.chunk, length, rows)
        gm, gm2 = np.zeros(groups, F), np.zeros(groups, F)
        for g in range(groups):
            shift = mean[g * cg]
            items = [(F(length), mean[g * cg + j] - shift, m2[g * cg + j]) for j in range(cg)]
            _, m, q = lane_chains(items, S, 1)
            gm[g], gm2[g] = F(shift + m[0]), q[0]
        gpart.append((gm, gm2))
    S = NORM.merge_team(groups, ch.chunks)
    means, variances = np.zeros(groups), np.zeros(groups)
    for g in range(groups):
        shift = gpart[0][0][g]  # chunk 0's partial mean: the means merge as offsets from it
        items = [
            (F(min(ch.chunk, hw - k * ch.chunk) * cg), gpart[k][0][g] - shift, gpart[k][1][g]) for k in range(ch.chunks)
        ]
        n, mean, m2 = lane_chains(items, S, 8)
        means[g], variances[g] = F(shift + mean[0]), m2[0] / n[0]
    return means, variances


@pytest.mark.parametrize(("hw", "c", "groups"), [(4096, 8, 2), (777, 3, 1), (300, 36, 36)])
def test_the_kernels_statistics_arithmetic_survives_a_large_mean(hw: int, c: int, groups: int) -> None:
    rng = np.random.default_rng()
    x = (100 + 0.01 * rng.standard_normal((hw, c))).astype(F)
    mean, var = kernel_group_stats(x, groups)
    ref = x.astype(np.float64).reshape(hw, groups, c // groups)
    want_mean, want_var = ref.mean(axis=(0, 2)), ref.var(axis=(0, 2))
    # Two roundings of shift + offset (a group's partial of a chunk, then the image's merge): 2 ulps at 100.
    np.testing.assert_allclose(mean, want_mean, rtol=0, atol=2 * 7.63e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-3)
    naive = (x * x).reshape(hw, groups, -1).mean(axis=(0, 2), dtype=F) - x.reshape(hw, groups, -1).mean(
        axis=(0, 2), dtype=F
    ) ** 2
    assert np.abs(naive - want_var).max() > 10 * np.abs(var - want_var).max(), "the case must defeat E[x^2]-E[x]^2"
