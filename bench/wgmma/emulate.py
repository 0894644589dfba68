"""numpy emulation of conv3x3_wgmma.cu's data movement, to prove its index math on a CPU.

The emulator runs every CTA of a small problem the way the kernel does, step by step, using the
kernel's own integer formulas (mirrored from the .cu; conv_plan.py holds the shared ones):

- the tile decode of blockIdx.x, the producer's TMA coordinates per (tap, channel block), the
  stage/phase bookkeeping and the expect_tx byte count;
- TMA tiled loads as the PTX ISA and the driver documentation describe them: the box is written
  to shared memory row-major (innermost dimension first), every element outside the tensor is 0,
  and the 16-byte chunks are permuted by the swizzle (XOR of address bits 4-6 with bits 7-9 for
  128 B, bits 4-5 with 7-8 for 64 B) of the absolute shared address;
- wgmma operand reads through the kernel's 64-bit descriptors, decoded field by field: K-major
  swizzled layout, rows of an 8-row core-matrix group `swizzle span` bytes apart, groups SBO
  apart, the swizzle applied to the absolute address after adding the k offset;
- the accumulator fragment layout of wgmma m64nNk16 (PTX ISA figure "WGMMA .m64nNk16 register
  fragment layout for accumulator matrix D") and the kernel's epilogue mapping of it to the
  staging tile and to y (pixel*ldy + channel, masks, 16-byte chunks).

What it cannot prove: that the hardware behaves as the documents say. It proves the kernel's
arithmetic is consistent with the documented semantics.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import conv_plan as cp
import numpy as np

MASK64 = (1 << 64) - 1

# Deliberate bugs, to test that check.py's probes catch and describe them (--emulate only):
# "desc-swizzle" (64B mode in 128B descriptors), "tap-shift" (column coordinate off by one),
# "fragment" (accumulator rows +8 swapped), "bias" (bias of the wrong channel), "halo-shift" (a
# column copy's tap r read from row r*(TW-1): a row shift not on the swizzle repeat).
BUG = ""


def swizzle(addr: np.ndarray | int, span: int) -> np.ndarray | int:
    """Physical shared address of logical address ``addr`` under a ``span``-byte swizzle."""
    if span == 128:
        return addr ^ (((addr >> 7) & 7) << 4)
    if span == 64:
        return addr ^ (((addr >> 7) & 3) << 4)
    if span == 32:
        return addr ^ (((addr >> 7) & 1) << 4)
    if span == 0:
        return addr
    raise ValueError(f"no {span}-byte swizzle")


class Memory:
    """A flat fp16 memory (uint16 words) addressed in bytes, for global or shared memory."""

    def __init__(self, nbytes: int, base: int = 0) -> None:
        self.base = base
        self.words = np.zeros(nbytes // 2, np.uint16)

    def index(self, addr: np.ndarray | int) -> np.ndarray | int:
        off = np.asarray(addr) - self.base
        if np.any(off % 2) or np.any(off < 0) or np.any(off >= 2 * self.words.size):
            raise IndexError("address outside the emulated memory")
        return off // 2


def tma_load(smem: Memory, dst: int, spec: cp.TensorMapSpec, gmem: Memory, coords: tuple[int, ...]) -> int:
    """cp.async.bulk.tensor (tile mode) of ``spec``'s box at ``coords`` into smem at ``dst``.
    Returns the bytes the transaction counts (the whole box, out-of-bound parts included)."""
    align = {128: 1024, 64: 512, 32: 256}[spec.swizzle_bytes]
    assert dst % align == 0, f"TMA destination {dst:#x} not aligned to the {spec.swizzle_bytes}B pattern"
    grids = np.meshgrid(*[np.arange(b) for b in spec.box], indexing="ij")  # i0, i1, ...
    inside = np.ones(grids[0].shape, bool)
    elem = np.zeros(grids[0].shape, np.int64)
    for d, (g, c) in enumerate(zip(grids, coords, strict=True)):
        pos = g + c
        inside &= (pos >= 0) & (pos < spec.dims[d])
        step = 1 if d == 0 else spec.strides[d - 1] // cp.ELEM
        elem += pos * step
    values = np.zeros(grids[0].shape, np.uint16)
    src = spec.address + 2 * elem[inside]
    values[inside] = gmem.words[gmem.index(src)]
    # Linear position in the box, innermost dimension fastest.
    lin = np.zeros(grids[0].shape, np.int64)
    for d in reversed(range(len(spec.box))):
        lin = lin * spec.box[d] + grids[d]
    phys = swizzle(dst + 2 * lin, spec.swizzle_bytes)
    smem.words[smem.index(phys)] = values
    return spec.box_bytes


def wgmma_operand(smem: Memory, desc: int, rows: int) -> np.ndarray:
    """rows x 16 fp16 values a wgmma reads for a K-major swizzled operand through ``desc``."""
    d = cp.decode_desc(desc)
    assert d.base_offset == 0
    span = d.swizzle_bytes
    m = np.arange(rows)[:, None]
    kk = np.arange(16)[None, :]
    addr = d.start + (m // 8) * d.sbo + (m % 8) * span + 2 * kk
    return smem.words[smem.index(swizzle(addr, span))].view(np.float16)


def hw_fragments(D: np.ndarray) -> np.ndarray:
    """Accumulator registers of the 128 threads of a warpgroup for a 64 x N fp32 tile D:
    thread T, register 4j+2h+e holds D[16*(T//32) + (T%32)//4 + 8h, 8j + 2*(T%4) + e]."""
    n = D.shape[1]
    regs = np.zeros((128, n // 2), np.float32)
    for T in range(128):
        warp, lane = divmod(T, 32)
        for j in range(n // 8):
            for h in range(2):
                for e in range(2):
                    hh = 1 - h if BUG == "fragment" else h
                    regs[T, 4 * j + 2 * h + e] = D[16 * warp + lane // 4 + 8 * hh, 8 * j + 2 * (lane % 4) + e]
    return regs


@dataclass
class Problem:
    N: int
    H: int
    W: int
    C: int
    K: int
    ldx: int
    ldy: int
    relu: bool = True


def run(
    cfg: cp.Config,
    prob: Problem,
    x: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None,
    *,
    x_off: int = 0,
    y_off: int = 0,
    y: np.ndarray | None = None,
) -> np.ndarray:
    """Emulate one launch. x: (N,H,W,ldx) fp16 whose channels [x_off, x_off+C) are the input,
    w: (K,3,3,C) fp16, bias (K,) fp32 or None. Writes channels [y_off, y_off+K) of y (N,H,W,ldy),
    a new NaN-filled array when None, and returns it."""
    N, H, W, C, K = prob.N, prob.H, prob.W, prob.C, prob.K
    gx_base, gw_base = 0x10000, 0x8000000  # 16-byte aligned "device addresses"
    gx = Memory(x.nbytes, gx_base)
    gx.words[:] = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
    gw = Memory(w.nbytes, gw_base)
    gw.words[:] = np.ascontiguousarray(w).reshape(-1).view(np.uint16)
    if y is None:
        y = np.full((N, H, W, prob.ldy), np.nan, np.float16)
    assert y.shape == (N, H, W, prob.ldy) and y.flags.c_contiguous
    yf = y.reshape(-1)

    geo = cp.launch(cfg, N, H, W, K)
    tmx = cp.input_map(cfg, gx_base + 2 * x_off, N, H, W, C, prob.ldx, geo.tw_log2)
    tmw = cp.weight_map(cfg, gw_base, K, C)
    TW = 1 << geo.tw_log2
    raw = 0x50  # where the dynamic shared memory starts (after static barriers), as on the GPU
    base = (raw + cp.ALIGN - 1) & ~(cp.ALIGN - 1)
    smem = Memory(cfg.smem_bytes, raw)
    cblocks = -(-C // cfg.bk)
    row = cfg.row_bytes

    for block in range(geo.tiles):
        img, h0, w0, n0 = cp.decode_tile(cfg, block, H, W, K, geo.tw_log2)
        acc = np.zeros((cfg.wgs, cfg.mt, 64, cfg.bn), np.float32)  # [warpgroup][m-block]: 64 x BN tiles
        desc_a0 = [cp.smem_desc(base + g * cfg.mt * 64 * row, row) for g in range(cfg.wgs)]
        desc_b0 = cp.smem_desc(base + cfg.a_bytes, row)
        if BUG == "desc-swizzle" and row == 128:
            desc_a0 = [(d & ~(3 << 62)) | (2 << 62) for d in desc_a0]
        stage = 0
        num_kb = (9 // cfg.taps_per_stage) * cblocks
        dw = 0 if BUG == "tap-shift" else 1
        for kb in range(num_kb):
            # producer (the waits are modelled in pipeline_model below), the kernel's decode of kb
            a_dst = base + stage * cfg.stage_bytes
            if cfg.halo_tw:
                cb, s = divmod(kb, 3)
                c0 = cb * cfg.bk
                got = tma_load(smem, a_dst, tmx, gx, (c0, w0 + s - dw, h0 - 1, img))
                for r in range(3):
                    got += tma_load(smem, a_dst + cfg.a_bytes + r * cfg.b_pitch, tmw, gw, ((3 * r + s) * C + c0, n0))
            else:
                tap, cb = divmod(kb, cblocks)
                r, s = divmod(tap, 3)
                c0 = cb * cfg.bk
                got = tma_load(smem, a_dst, tmx, gx, (c0, w0 + s - dw, h0 + r - 1, img))
                got += tma_load(smem, a_dst + cfg.a_bytes, tmw, gw, (tap * C + c0, n0))
            assert got == cfg.tx_bytes, "expect_tx would not match the bytes TMA delivers"
            # consumers: tap r of a column copy reads the copy from row r * TW on
            so = (stage * cfg.stage_bytes) >> 4
            shift = cfg.halo_tw - 1 if BUG == "halo-shift" else cfg.halo_tw
            for g in range(cfg.wgs):
                for r in range(cfg.taps_per_stage):
                    for k in range(cfg.bk // 16):
                        for mt in range(cfg.mt):
                            da = (desc_a0[g] + so + (((mt * 64 + r * shift) * row + k * 32) >> 4)) & MASK64
                            db = (desc_b0 + so + ((r * cfg.b_pitch + k * 32) >> 4)) & MASK64
                            A = wgmma_operand(smem, da, 64).astype(np.float32)
                            B = wgmma_operand(smem, db, cfg.bn).astype(np.float32)
                            acc[g, mt] += A @ B.T
            stage = 0 if stage + 1 == cfg.stages else stage + 1

        # epilogue, per warpgroup, as the kernel: registers -> padded staging tile -> y
        pitch = cfg.bn + 8
        for g in range(cfg.wgs):
            regs = [hw_fragments(acc[g, mt]) for mt in range(cfg.mt)]
            tile = np.zeros((cfg.mt * 64) * pitch, np.float16)
            for T in range(128):
                wl, lane = divmod(T, 32)
                for j in range(cfg.bn // 8):
                    col = 8 * j + 2 * (lane & 3)
                    k = n0 + col
                    if BUG == "bias":
                        k += 1
                    b0 = bias[k] if (bias is not None and k < K) else 0.0
                    b1 = bias[k + 1] if (bias is not None and k + 1 < K) else 0.0
                    for mt in range(cfg.mt):
                        rr = mt * 64 + 16 * wl + (lane >> 2)
                        for half in range(2):
                            v0 = np.float32(regs[mt][T, 4 * j + 2 * half] + b0)
                            v1 = np.float32(regs[mt][T, 4 * j + 2 * half + 1] + b1)
                            if prob.relu:
                                v0, v1 = max(v0, np.float32(0)), max(v1, np.float32(0))
                            tile[(rr + 8 * half) * pitch + col] = np.float16(v0)
                            tile[(rr + 8 * half) * pitch + col + 1] = np.float16(v1)
            chunks = cfg.bn // 8
            for i in range(cfg.mt * 64 * chunks):
                rr, q = divmod(i, chunks)
                p = g * cfg.mt * 64 + rr
                h = h0 + (p >> geo.tw_log2)
                ww = w0 + (p & (TW - 1))
                k = n0 + 8 * q
                if h >= H or ww >= W or k >= K:
                    continue
                dst = ((img * H + h) * W + ww) * prob.ldy + y_off + k
                n = 8 if k + 8 <= K else K - k
                assert n < 8 or dst % 8 == 0, "a 16-byte store would be misaligned (y_off, ldy)"
                yf[dst : dst + n] = tile[rr * pitch + 8 * q : rr * pitch + 8 * q + n]
    return y


def reference(prob: Problem, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, x_off: int = 0) -> np.ndarray:
    """float64 conv of x[..., x_off:x_off+C] (N,H,W,K)."""
    xs = x[..., x_off : x_off + prob.C].astype(np.float64)
    xp = np.pad(xs, ((0, 0), (1, 1), (1, 1), (0, 0)))
    out = np.zeros((prob.N, prob.H, prob.W, prob.K))
    for r in range(3):
        for s in range(3):
            out += xp[:, r : r + prob.H, s : s + prob.W, :] @ w[:, r, s, :].astype(np.float64).T
    if bias is not None:
        out += bias
    return np.maximum(out, 0) if prob.relu else out


# ---- mbarrier pipeline model ------------------------------------------------------------------


class MBarrier:
    """PTX mbarrier phase semantics: a phase completes when `count` arrivals (and the expected
    transaction bytes) are in; try_wait.parity(q) is true iff the phase with parity q that
    precedes the current one has completed, i.e. q != current phase parity."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pending = count
        self.tx = 0
        self.phase = 0

    def arrive(self, expect_tx: int = 0) -> None:
        self.tx += expect_tx
        self.pending -= 1
        self._maybe_complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        assert self.pending >= 0 and self.tx >= 0, "over-arrival or too many transaction bytes"
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:
        return parity != (self.phase & 1)


def pipeline_model(stages: int, num_kb: int, seed: int = 0, steps: int = 200000, *, warps: int = 8,
                   producer_flip: int = 1, release_lag: int = 1) -> None:  # fmt: skip
    """Run the kernel's producer / ``warps`` consumer warps protocol under a random schedule (TMA bytes
    landing late, warps advancing unevenly) and check: no deadlock; every consumer warp reads the
    k-block it expects from each stage; the producer never overwrites a stage a warp still reads.
    ``producer_flip`` / ``release_lag`` exist to show that the model catches a wrong parity or an
    early release (the tests mutate them)."""
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(warps) for _ in range(stages)]
    content = [-1] * stages  # k-block currently in each stage (-1: none)
    in_flight: list[tuple[int, int]] = []  # (stage, kb) TMA transfers not yet landed
    readers: list[set[int]] = [set() for _ in range(stages)]  # warps still reading a stage

    prod = {"kb": 0, "stage": 0, "phase": 0}
    cons = [{"kb": 0, "stage": 0, "phase": 0, "prev": None, "holding": []} for _ in range(warps)]

    def producer_step() -> bool:
        if prod["kb"] >= num_kb:
            return False
        st = prod["stage"]
        if not empty[st].try_wait(prod["phase"] ^ producer_flip):
            return False
        assert not readers[st], f"producer refills stage {st} while warps {readers[st]} read it"
        full[st].arrive(expect_tx=2)  # two TMA loads of one byte each in the model
        content[st] = -1
        in_flight.append((st, prod["kb"]))
        prod["kb"] += 1
        prod["stage"] = 0 if st + 1 == stages else st + 1
        prod["phase"] ^= 1 if st + 1 == stages else 0
        return True

    def land_step() -> bool:
        if not in_flight:
            return False
        i = rng.randrange(len(in_flight))
        st, kb = in_flight[i]
        if any(s == st for s, _ in in_flight[:i]):  # one stage's loads land in issue order
            return False
        in_flight.pop(i)
        content[st] = kb
        full[st].complete_tx(1)
        full[st].complete_tx(1)
        return True

    def consumer_step(wi: int) -> bool:
        c = cons[wi]
        if c["kb"] < num_kb:
            st = c["stage"]
            if not full[st].try_wait(c["phase"]):
                return False
            assert content[st] == c["kb"], f"warp {wi} expected k-block {c['kb']} in stage {st}, found {content[st]}"
            readers[st].add(wi)  # wgmma of this k-block in flight
            c["holding"].append(st)
            if release_lag == 0:
                empty[st].arrive()  # the bug release_lag=0 models: release before the wgmma retired
            # wait_group 1: everything but the newest group has retired
            while len(c["holding"]) > 1:
                done = c["holding"].pop(0)
                readers[done].discard(wi)
                if release_lag == 1:
                    empty[done].arrive()  # lane 0 of this warp releases kb-1's stage
            c["kb"] += 1
            c["stage"] = 0 if st + 1 == stages else st + 1
            c["phase"] ^= 1 if st + 1 == stages else 0
            return True
        if c["holding"]:  # wait_group 0 at the end (the last stage is not released)
            readers[c["holding"].pop()].discard(wi)
            return True
        return False

    for _ in range(steps):
        actors = [producer_step, land_step] + [lambda i=i: consumer_step(i) for i in range(warps)]
        rng.shuffle(actors)
        if not any(a() for a in actors):
            break
    assert prod["kb"] == num_kb, f"deadlock: producer stopped at k-block {prod['kb']} of {num_kb}"
    for wi, c in enumerate(cons):
        assert c["kb"] == num_kb, f"deadlock: warp {wi} stopped at k-block {c['kb']} of {num_kb}"
