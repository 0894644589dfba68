// 3x3 convolution (stride 1, dilation d, padding d) and 1x1 convolution (a GEMM), NHWC fp16, fused bias,
// residual and activation, for Hopper (sm_90a): TMA (cp.async.bulk.tensor) loads into a
// multi-stage mbarrier pipeline, wgmma.mma_async with both operands in shared memory, fp32
// accumulators in registers.
//
//   3x3: y[n,h,w,k] = act(bias[k] + res[n,h,w,k] + sum_{r,s,c} x[n,h+(r-1)d,w+(s-1)d,c] * w[k,r,s,c])
//   (d = `dil`: 1 for a plain 3x3; DeepLab / PAN's dilated 3x3s keep the map's size with padding d)
//   1x1: y[m,k]     = act(bias[k] + res[m,k]     + sum_c x[m,c] * w[k,c]),  m = pixel of N*H*W
//
// `res` (null: none) is ResNet's residual Add: an NHWC tensor of the output's shape with its own
// channel stride ldr (even, 4-byte aligned: the epilogue reads channel pairs), added in fp32
// before the activation, so bias, residual and activation cost one rounding, as in conv_nhwc.cu.
// `act`, `p0`, `p1`: a row of the one activation table (dualtrack_activations.cuh), every row.
//
// Implicit GEMM: M = output pixels, N_gemm = K output channels, K_gemm = 9*C, walked tap-major
// (for each tap (r,s), the C input channels in BK-wide blocks: 9 * ceil(C/BK) k-blocks).
//
// 1x1 entries (suffix _1x1, PW): the plain GEMM M = N*H*W pixels x K by C, the same pipeline,
// consumers and epilogue with one tap. A CTA owns BM consecutive pixels [m0, m0+BM) of the
// flattened N*H*W (any M: TMA zero-fills the rows past M, the epilogue does not write them), and
// the input map is 2-D: (C, M) with pixel stride ldx, box (BK, BM) at (c0, m0); the weights are
// the (K, C) matrix, box (BK, BN) at (c0, n0). ceil(C/BK) k-blocks; past C both maps read zeros.
//
// Tiling. A CTA owns BM = 64*MT*WGS output pixels of ONE image, laid out as a TH x TW spatial tile
// (TW = 2^tw_log2 columns, TH = BM/TW rows; the host picks TW), times BN output channels.
//   * A (pixels x channels) for tap (r,s) and channel block c0 is ONE 4-D TMA box
//     (BK channels, TW columns, TH rows, 1 image) of the input tensor map (dims C, W, H, N; strides
//     ldx, W*ldx, H*W*ldx elements) at coordinates (c0, w0+(s-1)d, h0+(r-1)d, n). TMA writes zeros for
//     every element outside the tensor -- that IS the zero padding of the convolution (negative
//     coordinates included), and also the channel tail when C is not a multiple of BK and the
//     rows/columns of a tile that hang over the image edge. In shared memory the box is BM rows
//     of BK*2 bytes, row p = tile pixel (p / TW, p % TW): a plain K-major A tile.
//   * B for the same k-block is a 2-D TMA box (BK, BN) of the packed weights viewed as a
//     (K, 9*C) matrix at (tap*C + c0, n0): BN rows (output channels) of BK*2 bytes, K-major.
//     Past the end of a tap (c0+BK > C) it reads the next tap's weights, which multiply the zeros
//     TMA put into A's channel tail, so the sum is still right.
//   * Rows are BK*2 bytes = the swizzle span: BK = 64 -> 128-byte swizzle, BK = 32 (C = 32
//     layers) -> 64-byte, BK = 16 (C <= 16) -> 32-byte. TMA and wgmma agree on the layout when each
//     tile starts on a 1024-byte boundary (A tiles are multiples of 1024 bytes; a B tile of fewer
//     bytes, 16 channels x 16 rows of 32 bytes, is placed B_PITCH = 1024 bytes apart): both XOR the
//     16-byte chunk index (address bits 4-6, 4-5 or 4) with the 128-byte line index (bits 7-9, 7-8
//     or 7). The stage's transaction count is the boxes' bytes (TX_BYTES), not the padded layout.
//     The wgmma descriptor: start address >> 4, leading byte offset 1 (unused for swizzled
//     K-major), stride byte offset = 8 rows * row bytes (1024 or 512) between 8-row core-matrix
//     groups, base offset 0, swizzle code 1 (128B), 2 (64B) or 3 (32B). The k16 step inside a row adds
//     32 bytes to the start address (the hardware applies the swizzle after adding).
//
// Column copies (entries with the suffix _h<TW>, HALO_TW = TW, compiled in; dilation 1 only: the
// host launches a dilated 3x3 on the per-tap entries, and these ignore `dil`). The per-tap A box
// above reads every input pixel from L2 nine times, which bounds the layers with few channels
// (C = 32, 64) by L2 bandwidth. Instead, for each column shift s and channel block, one box of
// TH + 2 rows (BK, TW, TH+2, 1) at (c0, w0+s-1, h0-1, n) serves the three taps (r, s), r = 0..2:
// tap r's A operand is the same box from row r*TW on (row p + r*TW holds output pixel p's input).
// Rows are shifted by whole image rows only, so with TW a multiple of 8 every 8-row core group
// still starts on the swizzle repeat and the descriptor is the one above plus an offset. A
// stage then holds the copy and the three taps' B boxes; 3 * ceil(C/BK) stages per CTA instead
// of 9 * ceil(C/BK), and 3 * (TH+2)/TH instead of 9 A rows per output pixel.
//
// Warp roles (32*(4*WGS+1) threads: 288 for two consumer warpgroups, 160 for one): warps
// 4g..4g+3 = consumer warpgroup g, tile rows [64*MT*g, 64*MT*(g+1)); the last warp = producer
// (one lane issues all TMA). A consumer warpgroup issues, per k-block, BK/16 x MT
// wgmma.m64nBNk16 (A and B from shared memory by descriptor; transpose bits 0: both K-major).
// WGS = 1 halves the tile for layers with few pixels (the U-Net bottleneck at N=1 has 1024).
//
// Pipeline. STAGES stages of (A tile, B tile); full[s] (count 1: the producer's
// arrive.expect_tx of the stage's bytes; TMA's complete_tx finishes the phase) and empty[s]
// (count 4*WGS: lane 0 of every consumer warp). The producer waits empty[s] with parity phase^1
// (a fresh barrier's "previous phase" counts as complete, so the first round does not block),
// consumers wait full[s] with parity phase; phase flips when the stage index wraps. Consumers
// keep one wgmma group in flight: after committing k-block kb they wait_group 1, which retires
// kb-1, and only then release kb-1's stage. TMA writes and wgmma reads are both async-proxy
// accesses ordered by the mbarriers, and no thread writes a pipeline stage with ordinary
// stores, so no fence.proxy.async is needed in the main loop.
//
// Epilogue. After wait_group 0 and a barrier over all consumer threads (no wgmma still
// reads the pipeline's shared memory), each warpgroup stages its 64*MT x BN tile in shared memory
// and writes whole 16-byte chunks of consecutive channels to y at pixel*ldy + channel, so y may
// be a channel slice of a wider (concat) buffer. Pixels outside the image (past M) and channels
// >= K are not written. Two forms, by `act` (uniform, one branch):
//   none / ReLU without a residual: each thread adds the bias to its own accumulators (channel
//     pairs), applies ReLU, rounds to fp16 and stages fp16 rows (padded by 16 bytes: conflict-free);
//   every other row of the table, and any launch with a residual: the accumulators + bias are
//     staged as fp32 rows (padded by 32
//     bytes), then each 16-byte output chunk reads its 8 values, adds the residual (one 16-byte
//     read where ldr and the address allow), applies the activation with the switch outside its
//     8 values (activate8), rounds once. The fp32 rows may be larger than the pipeline: the
//     dynamic shared memory is the larger of the two (Cfg::SMEM_BYTES).
// The activation is inlined, every row (activate8): dt_activate's __noinline__ rows are calls,
// and any call makes ptxas serialize every wgmma of the kernel (C7509).
//
// Watchdog. Every mbarrier wait that does not succeed at once polls %globaltimer; after
// CONV_WGMMA_WATCHDOG_NS it records (what, block, thread, k-block, stage, parity) in `status`
// (int[8], device memory, zeroed by the host) and the thread leaves its loop, so a wrong
// transaction count or parity shows up as a report instead of a hang. Other threads see
// status[0] != 0 in their slow path and give up too. With a null `status` (what the engine
// passes) the thread traps instead: the launch fails with an error rather than hanging the GPU.
// The fast path is one try_wait, as without a watchdog; -DCONV_WGMMA_WATCHDOG_NS=0 compiles the
// slow path out (a plain spin), to measure what the watchdog costs.
//
// e4m3 rows (entries conv3x3_wgmma_e4m3_..., the conv_fp8 op; issue 42). x and w are OCP float8
// e4m3fn bytes (x dense NHWC from quantize_fp8.cu, w packed KRSC), everything else as above:
//   y = act(acc * dequant[k] + bias[k] + res),  acc = sum of the exact e4m3 products in fp32,
// dequant[k] = s_x * s_w[k] (fp32, K values; the extra parameter after bias). wgmma's e4m3 form is
// m64nNk32 with both operands K-major in shared memory: a k32 step is 32 bytes of a row, as fp16's
// k16, so the pipeline is the same with 1-byte elements: BK = 128 channels a 128-byte swizzled
// row (64: a 64-byte row), TMA maps of UINT8, ROW_BYTES / 32 instructions a k-block. No column
// copies. The epilogue's fp32 scale is applied to the (split-K summed) accumulators before the bias.
//
// Configurations are not set here: the host passes -DCONV_WGMMA_ENTRIES="CONV_WGMMA_ENTRY(BN,
// MT, WGS, BK, STAGES, MIN_BLOCKS) CONV_WGMMA_HALO_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, TW)
// CONV_WGMMA_1X1_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS) ..." (dualtrack.kernels:
// Conv3x3WgmmaSpec.configs), so the launch geometry and the code cannot disagree. Entry names:
// conv3x3_wgmma[_e4m3]_bn<BN>_mt<MT>_wg<WGS>_bk<BK>[_h<TW> | _1x1] (CONV_WGMMA_E4M3_ENTRY,
// CONV_WGMMA_E4M3_1X1_ENTRY: the e4m3 rows).
// Built for compute_90a only (wgmma is sm_90a-only): `make ptx` writes ptx/compute_90a/.
//
// No toolkit #include: NVRTC builds this with the in-memory dualtrack_activations.cuh only. fp16
// values are raw bits.

#if !defined(CONV_WGMMA_ENTRIES)
#error "configurations come from dualtrack.kernels (Conv3x3WgmmaSpec.defines): build with `make ptx`"
#endif

#ifndef CONV_WGMMA_WATCHDOG_NS
#define CONV_WGMMA_WATCHDOG_NS 2000000000ull  // 2 s: far above any legitimate wait
#endif

#include "dualtrack_activations.cuh"

typedef unsigned short f16;  // raw IEEE binary16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

// CUtensorMap as cuTensorMapEncodeTiled fills it: 128 opaque bytes, 64-byte aligned.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

namespace wg {

enum : int {
    ALIGN = 1024,  // 128-byte swizzle pattern repeat; TMA boxes and wgmma tiles start on it
};

// Watchdog report codes (status[1]).
enum : int { WAIT_FULL = 1, WAIT_EMPTY = 2 };

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- mbarrier ---------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}

__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Slow path of mbar_wait. Inlined: a call (even to a device function) makes ptxas serialize
// every wgmma of the kernel (C7509 "presence of Extern calls").
__device__ __forceinline__ bool mbar_wait_slow(u32 bar, u32 parity, int* status, int what, int kb, int stage) {
    const u64 t0 = globaltimer();
    for (;;) {
        if (mbar_try_wait(bar, parity)) return true;
        if (status != nullptr && ld_volatile(status) != 0) return false;  // someone else gave up
        if (globaltimer() - t0 > CONV_WGMMA_WATCHDOG_NS) {
            if (status == nullptr) asm volatile("trap;");
            int old;
            asm volatile("atom.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(status) : "memory");
            if (old == 0) {
                status[1] = what;
                status[2] = static_cast<int>(blockIdx.x);
                status[3] = static_cast<int>(threadIdx.x);
                status[4] = kb;
                status[5] = stage;
                status[6] = static_cast<int>(parity);
                asm volatile("membar.sys;" ::: "memory");
            }
            return false;
        }
    }
}

// Wait until the phase of `bar` with parity `parity` has completed. False: the watchdog fired.
__device__ __forceinline__ bool mbar_wait(u32 bar, u32 parity, int* status, int what, int kb, int stage) {
    if (mbar_try_wait(bar, parity)) return true;
#if CONV_WGMMA_WATCHDOG_NS == 0
    while (!mbar_try_wait(bar, parity)) {
    }
    return true;
#else
    return mbar_wait_slow(bar, parity, status, what, kb, stage);
#endif
}

// ---- TMA --------------------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// ---- wgmma ------------------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major swizzled tile whose rows are `row_bytes` (32, 64 or
// 128 = the swizzle span) long: start address >> 4 (bits 0-13), leading byte offset 1 (bits
// 16-29; unused for swizzled K-major), stride byte offset = 8 rows >> 4 (bits 32-45), base offset
// 0 (bits 49-51: tiles are 1024-aligned), swizzle mode (bits 62-63: 1 = 128B, 2 = 64B, 3 = 32B).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 row_bytes) {
    const u64 swizzle = row_bytes == 128 ? 1ull : row_bytes == 64 ? 2ull : 3ull;
    return static_cast<u64>((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (static_cast<u64>((8u * row_bytes) >> 4) << 32) |
           (swizzle << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma region.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define WG_REGS_8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WG_REGS_16 WG_REGS_8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_REGS_32 WG_REGS_16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS_64                                                                                                 \
    WG_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"                   \
               ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS_128                                                                                                \
    WG_REGS_64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"                   \
               ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"                   \
               ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"       \
               ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define WG_D8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D16(i) WG_D8(i), WG_D8(i + 8)
#define WG_D32(i) WG_D16(i), WG_D16(i + 16)
#define WG_D64(i) WG_D32(i), WG_D32(i + 32)
#define WG_D128(i) WG_D64(i), WG_D64(i + 64)

// D(64 x BN, fp32) += A(64 x 16, K-major smem) * B(16 x BN, K-major smem): scale-d = 1,
// scale-a = scale-b = 1, no transpose.
#define WG_MMA(NREG, BN_, DA, DB, SCALE, REGS, OPS)                                                       \
    __device__ __forceinline__ void mma(float (&d)[NREG], u64 da, u64 db) {                              \
        asm volatile("{\n"                                                                              \
                     ".reg .pred p;\n"                                                                  \
                     "setp.ne.b32 p, " SCALE ", 0;\n"                                                   \
                     "wgmma.mma_async.sync.aligned.m64n" #BN_ "k16.f32.f16.f16 {" REGS "}, " DA ", " DB  \
                     ", p, 1, 1, 0, 0;\n"                                                               \
                     "}\n"                                                                              \
                     : OPS                                                                               \
                     : "l"(da), "l"(db), "r"(1));                                                        \
    }

// D(64 x BN, fp32) += A(64 x 32, e4m3) * B(32 x BN, e4m3), both K-major in shared memory. The
// 8-bit forms take no transpose operands (K-major only).
#define WG_MMA_E4M3(NREG, BN_, DA, DB, SCALE, REGS, OPS)                                                  \
    __device__ __forceinline__ void mma_e4m3(float (&d)[NREG], u64 da, u64 db) {                         \
        asm volatile("{\n"                                                                              \
                     ".reg .pred p;\n"                                                                  \
                     "setp.ne.b32 p, " SCALE ", 0;\n"                                                   \
                     "wgmma.mma_async.sync.aligned.m64n" #BN_ "k32.f32.e4m3.e4m3 {" REGS "}, " DA ", " DB \
                     ", p, 1, 1;\n"                                                                     \
                     "}\n"                                                                              \
                     : OPS                                                                               \
                     : "l"(da), "l"(db), "r"(1));                                                        \
    }

// Operand numbers: the NREG accumulators come first, then the two descriptors and scale-d.
WG_MMA(8, 16, "%8", "%9", "%10", WG_REGS_8, WG_D8(0))
WG_MMA(16, 32, "%16", "%17", "%18", WG_REGS_16, WG_D16(0))
WG_MMA(32, 64, "%32", "%33", "%34", WG_REGS_32, WG_D32(0))
WG_MMA(64, 128, "%64", "%65", "%66", WG_REGS_64, WG_D64(0))
WG_MMA(128, 256, "%128", "%129", "%130", WG_REGS_128, WG_D128(0))
WG_MMA_E4M3(8, 16, "%8", "%9", "%10", WG_REGS_8, WG_D8(0))
WG_MMA_E4M3(16, 32, "%16", "%17", "%18", WG_REGS_16, WG_D16(0))
WG_MMA_E4M3(32, 64, "%32", "%33", "%34", WG_REGS_32, WG_D32(0))
WG_MMA_E4M3(64, 128, "%64", "%65", "%66", WG_REGS_64, WG_D64(0))
WG_MMA_E4M3(128, 256, "%128", "%129", "%130", WG_REGS_128, WG_D128(0))

// Split-K's partial sums: stored and read at L2 (not L1, which another SM's stores do not update).
__device__ __forceinline__ void st_cg(float* p, float v) {
    asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float f16_bits_to_f32(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    // cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower half.
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Named barrier with a compile-time id (a run-time id makes ptxas reserve all 16 barriers).
template <int ID, int THREADS_>
__device__ __forceinline__ void named_barrier() {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS_) : "memory");
}

// ---- the kernel body --------------------------------------------------------------------------

template <int BN_, int MT_, int WGS_, int BK_, int STAGES_, int HALO_TW_, bool PW_, bool E4M3_ = false>
struct Cfg {
    enum : int {
        BN = BN_,
        MT = MT_,        // m64 blocks per consumer warpgroup
        WGS = WGS_,      // consumer warpgroups (1 or 2)
        BK = BK_,        // channels per k-block = one swizzled row
        STAGES = STAGES_,
        HALO_TW = HALO_TW_,  // 0: one A box per tap; else the tile width of the column-copy scheme
        PW = PW_,            // 1x1 (a GEMM over the flattened pixels): one tap, 2-D input map
        E4M3 = E4M3_,        // one-byte e4m3 operands (k32 instructions) and the dequant scale
        CONSUMER_WARPS = 4 * WGS,
        THREADS = 32 * (CONSUMER_WARPS + 1),  // + the producer warp
        BM = WGS * 64 * MT,  // tile pixels
        ROW_BYTES = (E4M3 ? 1 : 2) * BK,
        K_STEPS = ROW_BYTES / 32,  // instructions a k-block: k16 (fp16) or k32 (e4m3), 32 bytes each
        // A box: TH x TW pixels per tap, or (TH + 2) x TW per column copy (2 * TW more rows).
        A_BYTES = (BM + (HALO_TW ? 2 * HALO_TW : 0)) * ROW_BYTES,
        B_BYTES = BN * ROW_BYTES,
        B_PITCH = (B_BYTES + ALIGN - 1) / ALIGN * ALIGN,  // a B tile's place: every tile 1024-aligned
        HALO_TW_LOG2 = HALO_TW == 8 ? 3 : HALO_TW == 16 ? 4 : 5,
        TAPS = HALO_TW ? 3 : 1,  // taps (k-blocks of weights) per stage
        STAGE_BYTES = A_BYTES + TAPS * B_PITCH,  // a stage's shared memory
        TX_BYTES = A_BYTES + TAPS * B_BYTES,     // the bytes its boxes bring: the mbarrier's count
        NREG = BN / 2,  // fp32 accumulators per thread per m64 block
        EPI_PITCH = BN + 8,  // staged fp16 output row, halves (+16 bytes: conflict-free)
        EPI_F32_PITCH = BN + 8,  // staged fp32 row, floats (+32 bytes: a half-warp's float2 rows apart)
        PIPE_BYTES = STAGES * STAGE_BYTES,
        EPI_F32_BYTES = BM * EPI_F32_PITCH * 4,
        // dynamic shared memory the host must pass: the pipeline, or the fp32 staging where larger
        SMEM_BYTES = (PIPE_BYTES > EPI_F32_BYTES ? PIPE_BYTES : EPI_F32_BYTES) + ALIGN,
    };
    static_assert(ROW_BYTES == 32 || ROW_BYTES == 64 || ROW_BYTES == 128,
                  "rows must be one 32-, 64- or 128-byte swizzle span");
    static_assert(!(E4M3 && HALO_TW), "the e4m3 rows have no column copies");
    static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128 || BN == 256, "wgmma N instantiated for 16..256");
    static_assert(MT == 1 || MT == 2, "one or two m64 blocks per warpgroup");
    static_assert(WGS == 1 || WGS == 2, "one or two consumer warpgroups");
    static_assert(A_BYTES % ALIGN == 0 && B_PITCH % ALIGN == 0, "tiles must stay 1024-byte aligned");
    static_assert(BM * EPI_PITCH * 2 + 16 <= PIPE_BYTES,
                  "epilogue staging (and split-K's flag after it) reuses the pipeline");
    static_assert(STAGES >= 2, "pipeline needs two stages or more");
    static_assert(HALO_TW == 0 || HALO_TW == 8 || HALO_TW == 16 || HALO_TW == 32,
                  "a tap's row shift (TW rows) must keep the 8-row core groups on the swizzle repeat");
    static_assert(HALO_TW == 0 || BM % HALO_TW == 0, "the tile is TH = BM / TW whole rows");
    static_assert(!(PW && HALO_TW), "a 1x1 entry has no column copies");
};

// Where a CTA's tile pixels are: a TH x TW spatial tile of image `img` (3x3), or the BM pixels
// from m0 of the flattened N*H*W = M (1x1).
struct Tile {
    int img, h0, w0, tw_log2, H, W;  // 3x3
    int m0, M;                        // 1x1
};

// The NHWC pixel index of tile pixel p (its address is index * ld + channel), -1 outside the
// image (a 3x3 tile's overhang) or past M (a 1x1 tile's).
template <bool PW>
__device__ __forceinline__ long long pixel_at(const Tile& t, int p) {
    if (PW) {
        const long long m = static_cast<long long>(t.m0) + p;
        return m < t.M ? m : -1;
    }
    const int h = t.h0 + (p >> t.tw_log2);
    const int w = t.w0 + (p & ((1 << t.tw_log2) - 1));
    return (h < t.H && w < t.W) ? (static_cast<long long>(t.img) * t.H + h) * t.W + w : -1;
}

// An accumulator as the epilogue adds to it: times the channel's dequant scale in an e4m3 row,
// as it is in an fp16 one (no multiply by 1 in the fp16 code).
template <class CF>
__device__ __forceinline__ float dequantized(float acc, float scale) {
    return CF::E4M3 ? acc * scale : acc;
}

// Bias and ReLU on the accumulators (no residual: a launch with one takes the fp32 staging), rounded
// to fp16 and staged in `tile` (this warpgroup's rows, EPI_PITCH apart). The bias once per column pair.
template <class CF>
__device__ __forceinline__ void stage_tile(const float (&acc)[CF::MT][CF::NREG], f16* tile, const float* __restrict__ bias,
                                           const float* __restrict__ dequant, int K, int n0, int lane, int wl, int relu) {
#pragma unroll
    for (int j = 0; j < CF::BN / 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        const int k = n0 + col;
        const float b0 = (bias != nullptr && k < K) ? bias[k] : 0.f;
        const float b1 = (bias != nullptr && k + 1 < K) ? bias[k + 1] : 0.f;
        const float d0 = (CF::E4M3 && k < K) ? dequant[k] : 1.f;
        const float d1 = (CF::E4M3 && k + 1 < K) ? dequant[k + 1] : 1.f;
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) {
            const int row = mt * 64 + 16 * wl + (lane >> 2);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float v0 = dequantized<CF>(acc[mt][4 * j + 2 * half], d0) + b0;
                float v1 = dequantized<CF>(acc[mt][4 * j + 2 * half + 1], d1) + b1;
                if (relu) {
                    v0 = fmaxf(v0, 0.f);
                    v1 = fmaxf(v1, 0.f);
                }
                *reinterpret_cast<u32*>(tile + (row + 8 * half) * CF::EPI_PITCH + col) = pack_f16x2(v0, v1);
            }
        }
    }
}

// The accumulators + bias as fp32 rows of `tile` (this warpgroup's, EPI_F32_PITCH apart): the
// general epilogue's staging (store_general reads it back).
template <class CF>
__device__ __forceinline__ void stage_tile_f32(const float (&acc)[CF::MT][CF::NREG], float* tile,
                                               const float* __restrict__ bias, const float* __restrict__ dequant,
                                               int K, int n0, int lane, int wl) {
#pragma unroll
    for (int j = 0; j < CF::BN / 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        const int k = n0 + col;
        const float b0 = (bias != nullptr && k < K) ? bias[k] : 0.f;
        const float b1 = (bias != nullptr && k + 1 < K) ? bias[k + 1] : 0.f;
        const float d0 = (CF::E4M3 && k < K) ? dequant[k] : 1.f;
        const float d1 = (CF::E4M3 && k + 1 < K) ? dequant[k + 1] : 1.f;
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) {
            const int row = mt * 64 + 16 * wl + (lane >> 2);
#pragma unroll
            for (int half = 0; half < 2; ++half)
                *reinterpret_cast<float2*>(tile + (row + 8 * half) * CF::EPI_F32_PITCH + col) =
                    make_float2(dequantized<CF>(acc[mt][4 * j + 2 * half], d0) + b0,
                                dequantized<CF>(acc[mt][4 * j + 2 * half + 1], d1) + b1);
        }
    }
}

// Every row of the activation table on 8 values, inlined, the switch outside the values (see the
// header: no calls in this kernel). tests/test_wgmma1x1.py checks that each row of
// dualtrack.contract.activations has its case here.
#define WG_ACT_CASE(ID, FN)                                   \
    case ID:                                                  \
        _Pragma("unroll") for (int i = 0; i < 8; ++i) v[i] = FN(v[i], p0, p1); \
        break;
__device__ __forceinline__ void activate8(float (&v)[8], int act, float p0, float p1) {
    switch (act) {
        WG_ACT_CASE(DT_ACT_RELU, dt_act_relu)
        WG_ACT_CASE(DT_ACT_CLIP, dt_act_clip)
        WG_ACT_CASE(DT_ACT_HARDSIGMOID, dt_act_hardsigmoid)
        WG_ACT_CASE(DT_ACT_HARDSWISH, dt_act_hardswish)
        WG_ACT_CASE(DT_ACT_SIGMOID, dt_act_sigmoid)
        WG_ACT_CASE(DT_ACT_SILU, dt_act_silu)
        WG_ACT_CASE(DT_ACT_LEAKYRELU, dt_act_leakyrelu)
        WG_ACT_CASE(DT_ACT_ELU, dt_act_elu)
        WG_ACT_CASE(DT_ACT_SELU, dt_act_selu)
        WG_ACT_CASE(DT_ACT_TANH, dt_act_tanh)
        WG_ACT_CASE(DT_ACT_SOFTPLUS, dt_act_softplus)
        WG_ACT_CASE(DT_ACT_MISH, dt_act_mish)
        WG_ACT_CASE(DT_ACT_GELU, dt_act_gelu)
        WG_ACT_CASE(DT_ACT_GELU_TANH, dt_act_gelu_tanh)
        WG_ACT_CASE(DT_ACT_SOFTSIGN, dt_act_softsign)
        WG_ACT_CASE(DT_ACT_CELU, dt_act_celu)
        default: break;  // DT_ACT_NONE
    }
}
#undef WG_ACT_CASE

// The general epilogue's stores: this warpgroup's staged fp32 rows (tile pixels from p_first),
// a 16-byte chunk of 8 channels at a time: + residual, activation, one rounding, 16-byte store
// (element by element at the K tail). `tid`: the thread within the warpgroup.
template <class CF>
__device__ __forceinline__ void store_general(const float* tile, const f16* __restrict__ res, f16* __restrict__ y,
                                              const Tile& t, int p_first, int K, int n0, int ldy, int ldr, int act,
                                              float p0, float p1, int tid) {
    constexpr int CHUNKS = CF::BN / 8;  // 16-byte output chunks per row
    for (int i = tid; i < CF::MT * 64 * CHUNKS; i += 128) {
        const int row = i / CHUNKS;
        const int q = i - row * CHUNKS;
        const long long pix = pixel_at<CF::PW>(t, p_first + row);
        const int k = n0 + 8 * q;
        if (pix < 0 || k >= K) continue;
        const int n = K - k < 8 ? K - k : 8;  // channels of this chunk
        const float4* src = reinterpret_cast<const float4*>(tile + row * CF::EPI_F32_PITCH + 8 * q);
        const float4 lo = src[0], hi = src[1];
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (res != nullptr) {
            const f16* r = res + pix * ldr + k;
            if (n == 8 && (reinterpret_cast<u64>(r) & 15) == 0) {
                const uint4 rv = *reinterpret_cast<const uint4*>(r);
                const u32 rw[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    v[2 * e] += f16_bits_to_f32(static_cast<f16>(rw[e] & 0xffffu));
                    v[2 * e + 1] += f16_bits_to_f32(static_cast<f16>(rw[e] >> 16));
                }
            } else {  // unrolled with a guard: a run-time index would put v in local memory
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < n) v[e] += f16_bits_to_f32(r[e]);
            }
        }
        activate8(v, act, p0, p1);
        f16* dst = y + pix * ldy + k;
        if (n == 8) {  // ldy % 8 == 0 and y 16-byte aligned (the host checks): an aligned chunk
            uint4 out;
            out.x = pack_f16x2(v[0], v[1]);
            out.y = pack_f16x2(v[2], v[3]);
            out.z = pack_f16x2(v[4], v[5]);
            out.w = pack_f16x2(v[6], v[7]);
            *reinterpret_cast<uint4*>(dst) = out;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < n) dst[e] = static_cast<f16>(pack_f16x2(v[e], 0.f) & 0xffffu);
        }
    }
}

template <class CF>
__device__ __forceinline__ void conv(const TensorMap* tmx, const TensorMap* tmw, const float* __restrict__ bias,
                                     const float* __restrict__ dequant, const f16* __restrict__ res,
                                     f16* __restrict__ y, int N, int H, int W, int C,
                                     int K, int ldy, int ldr, int act, float p0, float p1, float* __restrict__ ws,
                                     int tw_log2, int dil, int* status, unsigned char* dsmem, u64* bars) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;

    // Tile of this CTA: channel tile fastest, so the CTAs that share an input tile run together.
    // The column-copy scheme's tile width is part of its shared-memory layout: compiled in.
    const int n_tiles = (K + CF::BN - 1) / CF::BN;
    int t = static_cast<int>(blockIdx.x);
    const int nt = t % n_tiles;
    t /= n_tiles;
    const int n0 = nt * CF::BN;
    Tile tile_at = {0, 0, 0, 0, H, W, 0, N * H * W};  // the host keeps N*H*W < 2^31
    if (CF::PW) {
        tile_at.m0 = t * CF::BM;
    } else {
        if (CF::HALO_TW) tw_log2 = CF::HALO_TW_LOG2;
        const int TW = 1 << tw_log2;
        const int TH = CF::BM >> tw_log2;
        const int tiles_w = (W + TW - 1) >> tw_log2;
        const int tiles_h = (H + TH - 1) / TH;
        const int tw = t % tiles_w;
        t /= tiles_w;
        const int th = t % tiles_h;
        tile_at.img = t / tiles_h;
        tile_at.w0 = tw * TW;
        tile_at.h0 = th * TH;
        tile_at.tw_log2 = tw_log2;
    }
    const int img = tile_at.img, h0 = tile_at.h0, w0 = tile_at.w0, m0 = tile_at.m0;

    const u32 raw = smem_u32(dsmem);
    const u32 base = (raw + ALIGN - 1) & ~static_cast<u32>(ALIGN - 1);
    const u32 full0 = smem_u32(bars);                  // full[s]  at full0 + 8*s
    const u32 empty0 = full0 + 8 * CF::STAGES;         // empty[s] at empty0 + 8*s
    const int cblocks = (C + CF::BK - 1) / CF::BK;
    const int num_kb = CF::PW ? cblocks : (9 / CF::TAPS) * cblocks;  // k-blocks of the whole reduction
    // Split-K: split blockIdx.y of gridDim.y takes k-blocks [kb0, kb1) (the host leaves none empty).
    const int per_split = (num_kb + static_cast<int>(gridDim.y) - 1) / static_cast<int>(gridDim.y);
    const int kb0 = static_cast<int>(blockIdx.y) * per_split;
    const int kb1 = min(num_kb, kb0 + per_split);

    if (threadIdx.x == 0) {
        for (int s = 0; s < CF::STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, CF::CONSUMER_WARPS);
        }
        // Make the initialised barriers visible to the async proxy (TMA's complete_tx).
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == CF::CONSUMER_WARPS) {
        // ---- producer: one lane issues every TMA load ----
        if (lane != 0) return;
        tma_prefetch(tmx);
        tma_prefetch(tmw);
        int stage = 0;
        u32 phase = 0;
        if (CF::PW) {  // one tap: k-block kb is channels [kb*BK, kb*BK + BK) of pixels [m0, m0+BM)
            for (int kb = kb0; kb < kb1; ++kb) {
                const u32 empty = empty0 + 8 * stage;
                const u32 full = full0 + 8 * stage;
                if (!mbar_wait(empty, phase ^ 1u, status, WAIT_EMPTY, kb, stage)) return;
                mbar_arrive_expect_tx(full, CF::TX_BYTES);
                const u32 a_dst = base + stage * CF::STAGE_BYTES;
                tma_load_2d(a_dst, tmx, full, kb * CF::BK, m0);
                tma_load_2d(a_dst + CF::A_BYTES, tmw, full, kb * CF::BK, n0);
                if (++stage == CF::STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            return;
        }
        // Two nested loops, no division per k-block: with small tiles a k-block's math takes
        // about 100 ns and this one thread's issue rate is on the critical path.
        //   per-tap boxes:  outer = tap (r, s), inner = channel block (tap-major k-blocks);
        //   column copies:  outer = channel block, inner = column shift s (taps (0..2, s)).
        const int outer_n = CF::HALO_TW ? cblocks : 9;
        const int inner_n = CF::HALO_TW ? 3 : cblocks;
        // Without split-K (grid.y == 1) the two loops as written; a split starts inside them
        // (below). One loop with counters for both cost 20% on ResNet's 16x16x512 layers at N=1
        // (bench/wgmma/ab.py on the H200).
        if (gridDim.y == 1) {
            int kb = 0;
            for (int o = 0; o < outer_n; ++o) {
                const int r = o / 3;  // per-tap boxes only
                for (int i = 0; i < inner_n; ++i, ++kb) {
                    const u32 empty = empty0 + 8 * stage;
                    const u32 full = full0 + 8 * stage;
                    if (!mbar_wait(empty, phase ^ 1u, status, WAIT_EMPTY, kb, stage)) return;
                    mbar_arrive_expect_tx(full, CF::TX_BYTES);
                    const u32 a_dst = base + stage * CF::STAGE_BYTES;
                    if (CF::HALO_TW) {
                        const int c0 = o * CF::BK;
                        tma_load_4d(a_dst, tmx, full, c0, w0 + i - 1, h0 - 1, img);
#pragma unroll
                        for (int rr = 0; rr < 3; ++rr)
                            tma_load_2d(a_dst + CF::A_BYTES + rr * CF::B_PITCH, tmw, full, (3 * rr + i) * C + c0, n0);
                    } else {
                        const int s = o - 3 * r;
                        const int c0 = i * CF::BK;
                        tma_load_4d(a_dst, tmx, full, c0, w0 + (s - 1) * dil, h0 + (r - 1) * dil, img);
                        tma_load_2d(a_dst + CF::A_BYTES, tmw, full, o * C + c0, n0);
                    }
                    if (++stage == CF::STAGES) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
            return;
        }
        // A split (split-K) starts inside them: one division per CTA, then counters.
        int o = kb0 / inner_n;
        int i = kb0 - o * inner_n;
        int r = o / 3, s = o - 3 * (o / 3);  // per-tap boxes only: tap (r, s) = outer index o
        for (int kb = kb0; kb < kb1; ++kb) {
            {
                const u32 empty = empty0 + 8 * stage;
                const u32 full = full0 + 8 * stage;
                if (!mbar_wait(empty, phase ^ 1u, status, WAIT_EMPTY, kb, stage)) return;
                mbar_arrive_expect_tx(full, CF::TX_BYTES);
                const u32 a_dst = base + stage * CF::STAGE_BYTES;
                if (CF::HALO_TW) {
                    // Column copy s = i of channel block o: rows h0-1 .. h0+TH, columns
                    // w0+s-1 .. +TW-1, and the weights of its three taps (r, s), r = 0..2.
                    const int c0 = o * CF::BK;
                    tma_load_4d(a_dst, tmx, full, c0, w0 + i - 1, h0 - 1, img);
#pragma unroll
                    for (int rr = 0; rr < 3; ++rr)
                        tma_load_2d(a_dst + CF::A_BYTES + rr * CF::B_PITCH, tmw, full, (3 * rr + i) * C + c0, n0);
                } else {
                    const int c0 = i * CF::BK;
                    tma_load_4d(a_dst, tmx, full, c0, w0 + (s - 1) * dil, h0 + (r - 1) * dil, img);
                    tma_load_2d(a_dst + CF::A_BYTES, tmw, full, o * C + c0, n0);
                }
                if (++stage == CF::STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            if (++i == inner_n) {
                i = 0;
                ++o;
                if (++s == 3) {
                    s = 0;
                    ++r;
                }
            }
        }
        return;
    }

    // ---- consumers: warpgroup g computes tile rows [g*64*MT, (g+1)*64*MT) x BN channels ----
    const int g = warp >> 2;
    float acc[CF::MT][CF::NREG];
#pragma unroll
    for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
        for (int i = 0; i < CF::NREG; ++i) acc[mt][i] = 0.f;

    // Descriptors of stage 0's tiles; other stages and k16 steps add (byte offset >> 4) to the
    // start-address field (no carry out of it: shared addresses are < 2^18).
    const u64 desc_a0 = smem_desc(base + g * CF::MT * 64 * CF::ROW_BYTES, CF::ROW_BYTES);
    const u64 desc_b0 = smem_desc(base + CF::A_BYTES, CF::ROW_BYTES);

    bool ok = true;
    int stage = 0, prev = 0;
    u32 phase = 0;
    for (int kb = kb0; kb < kb1; ++kb) {
        if (!mbar_wait(full0 + 8 * stage, phase, status, WAIT_FULL, kb, stage)) {
            ok = false;
            break;
        }
        const u64 so = static_cast<u64>((stage * CF::STAGE_BYTES) >> 4);
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) fence_regs(acc[mt]);
        wgmma_fence();
        // Tap r of a column copy reads the copy from row r*TW on: output pixel p's input for
        // that tap is copy row p + r*TW. TW is a multiple of 8, so every 8-row core group still
        // starts on the swizzle repeat (base offset 0).
#pragma unroll
        for (int r = 0; r < CF::TAPS; ++r) {
#pragma unroll
            for (int k = 0; k < CF::K_STEPS; ++k) {
#pragma unroll
                for (int mt = 0; mt < CF::MT; ++mt) {
                    const u64 da = desc_a0 + so +
                                   static_cast<u64>(((mt * 64 + r * CF::HALO_TW) * CF::ROW_BYTES + k * 32) >> 4);
                    const u64 db = desc_b0 + so + static_cast<u64>((r * CF::B_PITCH + k * 32) >> 4);
                    if (CF::E4M3)
                        mma_e4m3(acc[mt], da, db);
                    else
                        mma(acc[mt], da, db);
                }
            }
        }
        wgmma_commit();
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) fence_regs(acc[mt]);
        wgmma_wait<1>();  // k-block kb-1 has retired: its stage may be refilled
        if (kb > kb0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
        prev = stage;
        if (++stage == CF::STAGES) {
            stage = 0;
            phase ^= 1u;
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < CF::MT; ++mt) fence_regs(acc[mt]);

    // Every consumer is past its last wgmma: the pipeline's shared memory can be reused.
    named_barrier<1, 32 * CF::CONSUMER_WARPS>();
    if (!ok) return;

    if (gridDim.y > 1) {
        // ---- split-K: every split stores its fp32 partial sums in ws; the last split of the
        // tile to arrive (a counter per tile, after the partials) adds them all up, in split
        // order (the same sum whichever arrives last), resets the counter and runs the epilogue.
        constexpr int CT = 32 * CF::CONSUMER_WARPS;  // consumer threads: the partial's stride
        constexpr int PER_CTA = CF::MT * CF::NREG * CT;
        const long long tile = blockIdx.x;
        int* counter = reinterpret_cast<int*>(ws + static_cast<long long>(gridDim.x) * gridDim.y * PER_CTA) + tile;
        float* mine = ws + (tile * gridDim.y + blockIdx.y) * PER_CTA + threadIdx.x;
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
            for (int i = 0; i < CF::NREG; ++i) st_cg(mine + (mt * CF::NREG + i) * CT, acc[mt][i]);
        __threadfence();
        named_barrier<1, CT>();
        // The flag lives past the epilogue's staging rows (static_assert in Cfg).
        volatile int* last = reinterpret_cast<volatile int*>(dsmem + (base - raw) + CF::STAGES * CF::STAGE_BYTES - 16);
        if (threadIdx.x == 0) {
            const int arrived = atomicAdd(counter, 1);
            *last = arrived == static_cast<int>(gridDim.y) - 1;
            if (arrived == static_cast<int>(gridDim.y) - 1) *counter = 0;  // every split has arrived
        }
        named_barrier<1, CT>();
        if (!*last) return;
        __threadfence();
        const float* all = ws + tile * gridDim.y * PER_CTA + threadIdx.x;
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
            for (int i = 0; i < CF::NREG; ++i) acc[mt][i] = 0.f;
        for (int sp = 0; sp < static_cast<int>(gridDim.y); ++sp) {
#pragma unroll
            for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
                for (int i = 0; i < CF::NREG; ++i) acc[mt][i] += ld_cg(all + sp * PER_CTA + (mt * CF::NREG + i) * CT);
        }
        named_barrier<1, CT>();  // every thread has read the flag before the staging rows are written
    }

    // ---- epilogue: bias + residual + activation, staged per warpgroup, 16-byte stores ----
    const int wl = warp & 3;  // warp within the warpgroup: accumulator rows 16*wl .. +15
    const int tid = threadIdx.x & 127;
    const int p_first = g * CF::MT * 64;  // this warpgroup's first tile pixel
    unsigned char* staging = dsmem + (base - raw);
    // Every row of the table but none / ReLU, and any launch with a residual: fp32 staging, then the
    // residual read as 16-byte chunks of consecutive channels and one rounding. stage_tile's residual
    // reads (4 bytes at each accumulator's pixel, 16 of a warp's 32-byte sectors) bounded FCN's 1x1
    // expand layers (128 -> 512 .. 512 -> 2048 + residual, 0.2-0.9 TB/s; conv_layers-a9d05e6-fcn-wgmma).
    if (act > DT_ACT_RELU || res != nullptr) {
        float* rows = reinterpret_cast<float*>(staging) + g * (CF::MT * 64 * CF::EPI_F32_PITCH);
        stage_tile_f32<CF>(acc, rows, bias, dequant, K, n0, lane, wl);
        if (g == 0)
            named_barrier<2, 128>();
        else
            named_barrier<3, 128>();
        store_general<CF>(rows, res, y, tile_at, p_first, K, n0, ldy, ldr, act, p0, p1, tid);
        return;
    }
    const int relu = act == DT_ACT_RELU;
    f16* tile = reinterpret_cast<f16*>(staging) + g * (CF::MT * 64 * CF::EPI_PITCH);
    stage_tile<CF>(acc, tile, bias, dequant, K, n0, lane, wl, relu);
    if (g == 0)
        named_barrier<2, 128>();
    else
        named_barrier<3, 128>();

    constexpr int CHUNKS = CF::BN / 8;  // 16-byte chunks per staged row
    for (int i = tid; i < CF::MT * 64 * CHUNKS; i += 128) {
        const int row = i / CHUNKS;
        const int q = i - row * CHUNKS;
        const long long pix = pixel_at<CF::PW>(tile_at, p_first + row);
        const int k = n0 + 8 * q;
        if (pix < 0 || k >= K) continue;
        f16* dst = y + pix * ldy + k;
        const f16* src = tile + row * CF::EPI_PITCH + 8 * q;
        if (k + 8 <= K) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < K - k; ++e) dst[e] = src[e];
        }
    }
}

}  // namespace wg

// One entry per configuration. Parameters (cuLaunchKernel order): tensor map of x, tensor map of
// w, bias (fp32, may be null), res (fp16, may be null), y, N, H, W, C, K, ldy, ldr, act, p0, p1,
// tw_log2, ws (fp32 split-K workspace, null unless gridDim.y > 1), status (int[8] or null).
// Split-K: gridDim.y = splits (each of the ceil(k-blocks / splits) k-blocks, none empty); ws holds
// tiles * splits * BM * BN floats, then tiles int counters, zero before the first launch (the
// last split of a tile resets its counter); launches that share ws must not overlap.
// Grid: (N * ceil(H/TH) * ceil(W/TW) * ceil(K/BN), splits, 1), for a 1x1 entry (suffix _1x1)
// (ceil(N*H*W / BM) * ceil(K/BN), splits, 1); block: 32*(4*WGS+1); dynamic shared memory:
// max(STAGES * STAGE_BYTES, BM * (BN + 8) * 4) + 1024 bytes, STAGE_BYTES = BM * BK * 2 + B_PITCH, or
// for a column-copy entry (name suffix _h<TW>; tw_log2 must be log2(TW)) (BM + 2*TW) * BK * 2 + 3 * B_PITCH,
// B_PITCH = BN * BK * 2 rounded up to 1024 bytes.
#define CONV_WGMMA_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS) \
    CONV_WGMMA_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, 0, false, )
#define CONV_WGMMA_HALO_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, TW) \
    CONV_WGMMA_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, TW, false, _h##TW)
#define CONV_WGMMA_1X1_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS) \
    CONV_WGMMA_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, 0, true, _1x1)
#define CONV_WGMMA_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, HALO_TW, PW, SUFFIX)                         \
    extern "C" __global__ void __launch_bounds__(32 * (4 * (WGS) + 1), MIN_BLOCKS)                          \
        conv3x3_wgmma_bn##BN##_mt##MT##_wg##WGS##_bk##BK##SUFFIX(                                           \
            const __grid_constant__ TensorMap tmx, const __grid_constant__ TensorMap tmw,                    \
            const float* __restrict__ bias, const f16* __restrict__ res, f16* __restrict__ y, int N, int H,   \
            int W, int C, int K, int ldy, int ldr, int act, float p0, float p1, int tw_log2, int dil,        \
            float* ws, int* status) {                                                                       \
        extern __shared__ __align__(1024) unsigned char dsmem[];                                            \
        __shared__ u64 bars[2 * (STAGES)];                                                                  \
        wg::conv<wg::Cfg<BN, MT, WGS, BK, STAGES, HALO_TW, PW>>(&tmx, &tmw, bias, nullptr, res, y, N, H, W, C, K, \
                                                                ldy, ldr, act, p0, p1, ws, tw_log2, dil, status,  \
                                                                dsmem, bars);                                            \
    }

// The e4m3 rows: the parameters above with `dequant` (fp32, K values) after `bias`; x and w are
// e4m3 bytes (UINT8 tensor maps). Dynamic shared memory as above with STAGE_BYTES = (BM + BN) * BK.
#define CONV_WGMMA_E4M3_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS) \
    CONV_WGMMA_E4M3_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, false, )
#define CONV_WGMMA_E4M3_1X1_ENTRY(BN, MT, WGS, BK, STAGES, MIN_BLOCKS) \
    CONV_WGMMA_E4M3_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, true, _1x1)
#define CONV_WGMMA_E4M3_KERNEL(BN, MT, WGS, BK, STAGES, MIN_BLOCKS, PW, SUFFIX)                              \
    extern "C" __global__ void __launch_bounds__(32 * (4 * (WGS) + 1), MIN_BLOCKS)                          \
        conv3x3_wgmma_e4m3_bn##BN##_mt##MT##_wg##WGS##_bk##BK##SUFFIX(                                      \
            const __grid_constant__ TensorMap tmx, const __grid_constant__ TensorMap tmw,                    \
            const float* __restrict__ bias, const float* __restrict__ dequant, const f16* __restrict__ res,  \
            f16* __restrict__ y, int N, int H, int W, int C, int K, int ldy, int ldr, int act, float p0,    \
            float p1, int tw_log2, int dil, float* ws, int* status) {                                       \
        extern __shared__ __align__(1024) unsigned char dsmem[];                                            \
        __shared__ u64 bars[2 * (STAGES)];                                                                  \
        wg::conv<wg::Cfg<BN, MT, WGS, BK, STAGES, 0, PW, true>>(&tmx, &tmw, bias, dequant, res, y, N, H, W, C, \
                                                                K, ldy, ldr, act, p0, p1, ws, tw_log2, dil,     \
                                                                status, dsmem, bars);                                   \
    }

CONV_WGMMA_ENTRIES
