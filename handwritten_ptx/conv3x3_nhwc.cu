// 3x3 convolution, stride 1, padding 1, NHWC activations, KRSC weights, fused bias + ReLU.
//
//   y[n,h,w,k] = act(bias[k] + sum_{r,s,c} x[n,h+r-1,w+s-1,c] * w[k,r,s,c])
//
// Every entry but conv3x3_nhwc_f16_smallc (C <= 4, a direct convolution: see its section) is an
// implicit GEMM: M = N*H*W output pixels, N_gemm = K output channels, K_gemm = 9*C taps. Row m of
// A is output pixel m; its (r,s,c) column is the input pixel m + (r-1)*W + (s-1) at channel c, or
// zero when (h+r-1, w+s-1) falls outside the image. Row k of B is filter k, which KRSC stores
// contiguously (9*C values), so B is K-major ("col") as is.
//
// A k-tile of BK columns is taken one of two ways, and A and B always agree on it:
//   vector path (C, ldx multiple of the 16-byte vector, x and w 16-byte aligned): one tap (r,s)
//     and BK consecutive channels, so every 16-byte chunk is wholly inside or outside C and is
//     copied with cp.async (zero-filled when outside: src-size 0);
//   scalar path (anything else, e.g. C=12): BK consecutive flattened taps
//     k = (r*3+s)*C + c, element by element with bounds checks.
//
// Tile sizes are not set here: `dualtrack.kernels` passes them as -D macros, so the launch
// geometry and the code always agree. Compile with `python -m dualtrack.ptx`.
//
// No toolkit #include: NVRTC must build this with no toolkit headers (CI has none); the shared
// helpers come from dualtrack_device.cuh, which dualtrack.ptx hands NVRTC in memory. fp16 values are raw
// IEEE bits in `unsigned short`; conversions and tensor-core ops are inline PTX.

#if !defined(CONV_F16_BM) || !defined(CONV_F16_BN) || !defined(CONV_F16_BK) || \
    !defined(CONV_F16_WARPS_M) || !defined(CONV_F16_WARPS_N) || !defined(CONV_F16_STAGES) || \
    !defined(CONV_F16_MIN_BLOCKS) || !defined(CONV_F16_NARROW) || !defined(CONV_F16_SMALL) || \
    !defined(CONV_F16_WIDE) || \
    !defined(CONV_F32_BM) || !defined(CONV_F32_BN) || !defined(CONV_F32_BK) || \
    !defined(CONV_F32_TM) || !defined(CONV_F32_TN)
#error "tile sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// Output pixel m0+i of a block, decoded once: its row and column in the image. Rows past M get a
// position so far outside the image that every tap of the 3x3 window reads zero.
__device__ __forceinline__ void decode_rows(int* row_h, int* row_w, int rows, int m0, int M, int H, int W) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        const int m = m0 + i;
        if (m < M) {
            const int hw = m % (H * W);
            row_h[i] = hw / W;
            row_w[i] = hw % W;
        } else {
            row_h[i] = -4;
            row_w[i] = -4;
        }
    }
}

__device__ __forceinline__ bool inside(int h, int w, int H, int W) {
    return static_cast<unsigned>(h) < static_cast<unsigned>(H) && static_cast<unsigned>(w) < static_cast<unsigned>(W);
}

// ------------------------------------------------------------------------------------------------
// fp16: tensor cores (mma.sync m16n8k16), cp.async multi-stage pipeline, ldmatrix fragments.
// ------------------------------------------------------------------------------------------------

namespace f16conv {

// One tile configuration: BM output pixels x BN output channels per block, BK-deep k-tiles,
// WARPS_M x WARPS_N warps, STAGES shared-memory stages, registers capped so that MIN_BLOCKS
// blocks fit on one SM (__launch_bounds__). The compile-time sizes are enumerators:
// namespace-scope constexpr variables would be emitted as .global symbols in the PTX.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_>
struct Cfg : mma::Swizzled<BM_, BN_, BK_, WARPS_M_, WARPS_N_, STAGES_, MIN_BLOCKS_> {
    // The tiling and its swizzled shared-memory layout are dualtrack_device.cuh's (conv_nhwc.cu's
    // too); this kernel adds its epilogue and element-path layout.
    typedef mma::Swizzled<BM_, BN_, BK_, WARPS_M_, WARPS_N_, STAGES_, MIN_BLOCKS_> T;
    enum : int {
        SMEM_HALVES = T::PIPE > BM_ * T::BNP ? T::PIPE : BM_ * T::BNP,
        // Element paths (C not a multiple of 8, ...) use one stage plus, behind it, each row's
        // (h, w) as ints and, when C <= SEG_CMAX, the three input-row segments the tile's 3x3
        // windows read: 3 x (BM + 2) pixels x C channels, loaded once per block.
        ROWS_OFF = T::STAGE,           // halves
        SEG_OFF = T::STAGE + 4 * BM_,  // halves
        SEG_CMAX = (SMEM_HALVES - SEG_OFF) / (3 * (BM_ + 2)),
    };
    static_assert(SMEM_HALVES * 2 <= 48 * 1024, "static shared memory is capped at 48 KiB");
    static_assert(SEG_CMAX >= 3, "the first layer's C = 3 must take the segment path");
};

struct Problem {
    const f16* x;
    const f16* w;
    int H, W, C, K, ldx, M, Kg;
};

// Vector path: the copies a thread issues for one k-tile, with everything that does not change
// along k computed once. k-tiles are loaded in order: (tap r,s) outer, channel block cb inner.
template <class CF>
struct VecLoader {
    long long a_off[CF::A_CH];  // element offset of the thread's row pixel + its chunk's channels
    int a_h[CF::A_CH], a_w[CF::A_CH];
    long long b_off[CF::B_CH];
    bool b_ok[CF::B_CH];
    unsigned a_dst[CF::A_CH], b_dst[CF::B_CH];  // shared byte offsets within a stage
    int q8, cb, r, s;

    __device__ __forceinline__ void init(const Problem& p, int m0, int n0) {
        const int q = threadIdx.x % CF::CPR;
        q8 = q * 8;
#pragma unroll
        for (int i = 0; i < CF::A_CH; ++i) {
            const int row = threadIdx.x / CF::CPR + i * (CF::THREADS / CF::CPR);
            const int m = m0 + row;
            if (m < p.M) {
                const int hw = m % (p.H * p.W);
                a_h[i] = hw / p.W;
                a_w[i] = hw - a_h[i] * p.W;
            } else {  // so far outside the image that every tap reads zero
                a_h[i] = -4;
                a_w[i] = -4;
            }
            a_off[i] = static_cast<long long>(m) * p.ldx + q8;
            a_dst[i] = CF::at(row, q) * 2;
        }
#pragma unroll
        for (int i = 0; i < CF::B_CH; ++i) {
            const int row = threadIdx.x / CF::CPR + i * (CF::THREADS / CF::CPR);
            const int k = n0 + row;
            b_ok[i] = k < p.K;
            b_off[i] = static_cast<long long>(k) * p.Kg + q8;
            b_dst[i] = (CF::A_STAGE + CF::at(row, q)) * 2;
        }
        cb = 0;
        r = 0;
        s = 0;
    }

    // Copies the next k-tile into the stage at shared address `stage`, then advances.
    __device__ __forceinline__ void load(const Problem& p, unsigned stage, int cblocks) {
        const int c0 = cb * CF::BK;
        const bool c_ok = c0 + q8 < p.C;
        const long long da = static_cast<long long>((r - 1) * p.W + (s - 1)) * p.ldx + c0;
        const int db = (r * 3 + s) * p.C + c0;
#pragma unroll
        for (int i = 0; i < CF::A_CH; ++i) {
            const bool ok = c_ok && inside(a_h[i] + r - 1, a_w[i] + s - 1, p.H, p.W);
            const f16* src = ok ? p.x + (a_off[i] + da) : p.x;  // with src-size 0 nothing is read
            cp_async_16(stage + a_dst[i], src, ok ? 16u : 0u);
        }
#pragma unroll
        for (int i = 0; i < CF::B_CH; ++i) {
            const bool ok = c_ok && b_ok[i];
            const f16* src = ok ? p.w + (b_off[i] + db) : p.w;
            cp_async_16(stage + b_dst[i], src, ok ? 16u : 0u);
        }
        if (++cb == cblocks) {
            cb = 0;
            if (++s == 3) {
                s = 0;
                ++r;
            }
        }
    }
};

// Element path, k-tile kt = flattened taps [kt*BK, kt*BK + BK). Each thread owns one column.
// SEG: A comes from the block's three input-row segments in shared memory (small C), else from
// global memory element by element.
template <class CF, bool SEG>
__device__ __forceinline__ void load_tile_scalar(const Problem& p, const int* row_h, const int* row_w, const f16* seg,
                                                 f16* stage, int kt, int m0, int n0) {
    const int j = threadIdx.x % CF::BK;
    const int kg = kt * CF::BK + j;
    const bool k_ok = kg < p.Kg;
    const int rs = k_ok ? kg / p.C : 0;
    const int c = kg - rs * p.C;
    const int r = rs / 3, s = rs - 3 * (rs / 3);
    f16* a = stage;
    f16* b = stage + CF::A_STAGE;
    const int jq = j >> 3, je = j & 7;
#pragma unroll 4
    for (int i = 0; i < CF::BM * CF::BK / CF::THREADS; ++i) {
        const int row = threadIdx.x / CF::BK + i * (CF::THREADS / CF::BK);
        f16 v = 0;
        if (k_ok && inside(row_h[row] + r - 1, row_w[row] + s - 1, p.H, p.W)) {
            if (SEG)
                v = seg[(r * (CF::BM + 2) + row + s) * p.C + c];
            else
                v = p.x[static_cast<long long>(m0 + row + (r - 1) * p.W + (s - 1)) * p.ldx + c];
        }
        a[CF::at(row, jq) + je] = v;
    }
#pragma unroll 4
    for (int i = 0; i < CF::BN * CF::BK / CF::THREADS; ++i) {
        const int row = threadIdx.x / CF::BK + i * (CF::THREADS / CF::BK);
        const int k = n0 + row;
        f16 u = 0;
        if (k_ok && k < p.K) u = p.w[static_cast<long long>(k) * p.Kg + kg];
        b[CF::at(row, jq) + je] = u;
    }
}

template <class CF>
__device__ __forceinline__ void conv(const f16* __restrict__ x, const f16* __restrict__ w,
                                     const float* __restrict__ bias, f16* __restrict__ y, int N, int H, int W, int C,
                                     int K, int ldx, int ldy, int relu, f16* smem) {
    const int M = N * H * W;  // the launcher refuses M >= 2^31
    const int m0 = blockIdx.x * CF::BM;
    const int n0 = blockIdx.y * CF::BN;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wm = warp % CF::WARPS_M;
    const int wn = warp / CF::WARPS_M;
    const Problem p{x, w, H, W, C, K, ldx, M, 9 * C};
    const unsigned smem_base = smem_u32(smem);

    float acc[CF::MT][CF::NT][4];
    mma::clear<CF>(acc);

    const bool vec = C % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
    if (vec) {
        const int cblocks = (C + CF::BK - 1) / CF::BK;
        const int num_kt = 9 * cblocks;
        VecLoader<CF> ld;
        ld.init(p, m0, n0);
        // Prologue fills STAGES-1 stages; every iteration then commits exactly one group (possibly
        // empty), so "all but the newest STAGES-2 groups done" always means "tile kt has landed".
#pragma unroll
        for (int st = 0; st < CF::STAGES - 1; ++st) {
            if (st < num_kt) ld.load(p, smem_base + st * CF::STAGE * 2, cblocks);
            cp_async_commit();
        }
        int rd = 0, wr = CF::STAGES - 1;  // stage read this iteration / written by its prefetch
        for (int kt = 0; kt < num_kt; ++kt) {
            cp_async_wait<CF::STAGES - 2>();
            // Publishes tile kt to all warps, and tells everyone that stage wr, last read in
            // iteration kt-1, has been consumed.
            __syncthreads();
            if (kt + CF::STAGES - 1 < num_kt) ld.load(p, smem_base + wr * CF::STAGE * 2, cblocks);
            cp_async_commit();
            mma::stage<CF>(smem_base + rd * CF::STAGE * 2, acc, wm, wn, lane);
            rd = rd + 1 == CF::STAGES ? 0 : rd + 1;
            wr = wr + 1 == CF::STAGES ? 0 : wr + 1;
        }
        cp_async_wait<0>();
    } else {
        int* row_h = reinterpret_cast<int*>(smem + CF::ROWS_OFF);
        int* row_w = row_h + CF::BM;
        f16* seg = smem + CF::SEG_OFF;
        decode_rows(row_h, row_w, CF::BM, m0, M, H, W);
        const bool use_seg = C <= CF::SEG_CMAX;
        if (use_seg) {
            // Segment r holds pixels m0 + (r-1)*W - 1 + t, t in [0, BM+2): every input pixel the
            // tile's windows touch in input row h+r-1 (zero outside [0, M)).
            const int total = 3 * (CF::BM + 2) * C;
            for (int i = threadIdx.x; i < total; i += CF::THREADS) {
                const int pc = i / C;
                const int c = i - pc * C;
                const int r = pc / (CF::BM + 2);
                const int t = pc - r * (CF::BM + 2);
                const long long pix = static_cast<long long>(m0) + static_cast<long long>(r - 1) * W - 1 + t;
                seg[i] = (pix >= 0 && pix < M) ? x[pix * ldx + c] : static_cast<f16>(0);
            }
        }
        const int num_kt = (9 * C + CF::BK - 1) / CF::BK;
        for (int kt = 0; kt < num_kt; ++kt) {
            __syncthreads();
            if (use_seg)
                load_tile_scalar<CF, true>(p, row_h, row_w, seg, smem, kt, m0, n0);
            else
                load_tile_scalar<CF, false>(p, row_h, row_w, seg, smem, kt, m0, n0);
            __syncthreads();
            mma::stage<CF>(smem_base, acc, wm, wn, lane);
        }
    }
    __syncthreads();  // the epilogue tile reuses the pipeline's shared memory

    // Epilogue: bias + ReLU in fp32, round once to fp16, stage the BM x BN tile in shared memory
    // so that global stores are whole 16-byte chunks of consecutive channels.
    f16* tile = smem;
    mma::stage_epilogue<CF>(
        tile, acc, wm, wn, lane,
        [&](int col) { return (bias != nullptr && n0 + col < K) ? bias[n0 + col] : 0.f; },
        [&](float v) { return relu ? fmaxf(v, 0.f) : v; });
    __syncthreads();
    mma::store_epilogue<CF>(tile, m0, n0, M, K, ldy % 8 == 0 && aligned16(y),
                            [&](int m, int k) { return y + (static_cast<long long>(m) * ldy + k); });
}

typedef Cfg<CONV_F16_BM, CONV_F16_BN, CONV_F16_BK, CONV_F16_WARPS_M, CONV_F16_WARPS_N, CONV_F16_STAGES,
            CONV_F16_MIN_BLOCKS>
    Main;
// Shape-selected variants (dualtrack.kernels.Conv3x3Spec.variant); each macro is the list
// BM,BN,BK,WARPS_M,WARPS_N,STAGES,MIN_BLOCKS.
typedef Cfg<CONV_F16_NARROW> Narrow;  // K <= 32 output channels
typedef Cfg<CONV_F16_WIDE> Wide;      // K >= 128 and enough pixels to fill the GPU with wide tiles
typedef Cfg<CONV_F16_SMALL> Small;    // too few Main tiles to fill the GPU

}  // namespace f16conv

#define CONV_F16_ENTRY(NAME, CF)                                                                            \
    extern "C" __global__ void __launch_bounds__(CF::THREADS, CF::MIN_BLOCKS)                               \
    NAME(const f16* __restrict__ x, const f16* __restrict__ w, const float* __restrict__ bias,              \
         f16* __restrict__ y, int N, int H, int W, int C, int K, int ldx, int ldy, int relu) {              \
        __shared__ __align__(16) f16 smem[CF::SMEM_HALVES];                                                 \
        f16conv::conv<CF>(x, w, bias, y, N, H, W, C, K, ldx, ldy, relu, smem);                              \
    }

CONV_F16_ENTRY(conv3x3_nhwc_f16, f16conv::Main)
CONV_F16_ENTRY(conv3x3_nhwc_f16_narrow, f16conv::Narrow)
CONV_F16_ENTRY(conv3x3_nhwc_f16_wide, f16conv::Wide)
CONV_F16_ENTRY(conv3x3_nhwc_f16_small, f16conv::Small)

// Tuned entries (`dualtrack tune`, and builds that read a tuning file): CONV_F16_EXTRA_ENTRIES is
// a list of CONV_F16_TUNED(NAME, BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS). The tile list
// is variadic because its commas would split a plain macro argument; the typedef gives
// CONV_F16_ENTRY a comma-free name for it. The name encodes the tile
// (dualtrack.kernels.Conv3x3Spec.tuned_entry), so the launch geometry is read back from it.
#define CONV_F16_TUNED(NAME, ...)                         \
    namespace f16conv {                                   \
    typedef Cfg<__VA_ARGS__> NAME##_cfg;                  \
    }                                                     \
    CONV_F16_ENTRY(NAME, f16conv::NAME##_cfg)

#ifdef CONV_F16_EXTRA_ENTRIES
CONV_F16_EXTRA_ENTRIES
#endif

// ------------------------------------------------------------------------------------------------
// fp16 with few input channels (C <= CONV_F16_SMALLC_CMAX: the RGB first layer): a direct
// convolution on CUDA cores.
//
// With C <= 4 the implicit GEMM above reduces over 9*C <= 36 taps: a tensor-core k-tile is mostly
// padding, and its A tile is gathered element by element. The layer has little arithmetic (27*K
// FMAs a pixel for RGB) and much output (K fp16 a pixel), so it runs on CUDA cores instead:
//
// - one block per TH x TW output tile of one image (1-D grid: column tile fastest, then row tile,
//   then image). The block stages its input tile with the one-pixel halo in shared memory once, as
//   fp32, zero outside the image (the padding), one plane per channel; the weights as fp32
//   [tap][c][k] (row stride KMAX) and the bias as fp32 stay there too.
// - a unit of work is PX = 8 adjacent output pixels of one row x KV = 8 output channels, 64 fp32
//   accumulators in a thread's registers. Each weight read from shared memory feeds PX FMAs and
//   each input value up to 3*KV, so the reads stay well under the 128 bytes a clock an SM's shared
//   memory returns to registers. The first small-C entry computed one pixel a thread, one FMA per
//   weight read, and ran at about that limit, 0.29-0.45 ms at N=8, with 4- and 16-byte broadcast
//   reads alike (it was dropped in commit a720cd0).
// - a tile's TH*TW/PX pixel groups x ceil(K/KV) channel groups are its units, channel group
//   fastest; the block's threads (THREADS, fewer when there are fewer units:
//   dualtrack.kernels.Conv3x3Spec.launch) take them in turn. For K = 32 a warp computes one tile
//   row at a time: its eight pixel groups read eight different banks (a pad word after every PX
//   input columns), and each 16-byte store instruction writes eight whole 64-byte pixels.
// - epilogue: the accumulators start from the bias; ReLU and the one rounding to fp16 are one
//   cvt.rn[.relu].f16x2.f32 per channel pair; a 16-byte store per pixel when ldy % 8 == 0, y is
//   16-byte aligned and the chunk is inside K, element stores otherwise.
// ------------------------------------------------------------------------------------------------

#if !defined(CONV_F16_SMALLC) || !defined(CONV_F16_SMALLC_CMAX) || !defined(CONV_F16_SMALLC_KMAX)
#error "the small-C entry's tile and limits come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

// 16-byte shared-memory load from a shared-window address (see lds128 for why it is inline PTX).
__device__ __forceinline__ float4 lds128_at(unsigned addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// Two fp32 values rounded to fp16 and packed, lo in the low half (the lower address); with RELU,
// negative values become 0 (cvt's .relu, which keeps a NaN a NaN, as the numpy reference does).
template <bool RELU>
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned d;
    if (RELU)
        asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));  // a -> upper half, b -> lower
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

namespace smallc {

// The entry's tile: TH x TW output pixels a block of at most THREADS threads (a launch has
// min(THREADS, units), fewer for small K), registers capped so that MIN_BLOCKS blocks of THREADS
// fit on an SM; its limits C <= CMAX, K <= KMAX (dualtrack.kernels.SMALL_C_MAX, SMALL_C_K_MAX).
template <int TH_, int TW_, int THREADS_, int MIN_BLOCKS_>
struct Cfg {
    enum : int {
        TH = TH_,
        TW = TW_,
        THREADS = THREADS_,
        MIN_BLOCKS = MIN_BLOCKS_,
        CMAX = CONV_F16_SMALLC_CMAX,
        KMAX = CONV_F16_SMALLC_KMAX,
        PX = 8,                // adjacent output pixels of one row a unit computes
        KV = 8,                // output channels a unit computes: one 16-byte fp16 chunk a pixel
        GX = TW / PX,          // pixel groups across a tile row
        GROUPS = TH * GX,      // pixel groups of a tile
        HH = TH + 2,           // input tile with its one-pixel halo
        HW = TW + 2,
        // Input column j of a tile row is stored at j + j / PX: one pad word after every PX columns,
        // so that the pixel groups of a tile row start in different banks.
        PITCH = HW + (HW - 1) / PX,
        PLANE = HH * PITCH,     // one input channel of the tile, floats
        XS = CMAX * PLANE,      // the input tile, floats
        WS = 9 * CMAX * KMAX,   // the weights, floats: [tap][c][k], row stride KMAX
    };
    static_assert(TW % PX == 0, "a tile row is whole pixel groups");
    static_assert(GROUPS % 32 == 0 && THREADS % 32 == 0, "whole warps (the weight staging maps lanes to filters)");
    static_assert(KMAX % 32 == 0, "weights are staged 32 channels a warp");
    static_assert(KV == 8, "the 16-byte store packs 8 fp16 channels");
    static_assert(CMAX >= 1 && KMAX >= KV && KMAX % KV == 0, "limits");
    static_assert((XS + WS + KMAX) * 4 <= 48 * 1024, "static shared memory is capped at 48 KiB");
};

// One unit's outputs: PX pixels from `out` on (pixel stride ldy), the first npx of them inside
// the image; `full`: 16-byte stores, else the first kleft channels element by element.
template <class CF, bool RELU>
__device__ __forceinline__ void store_unit(const float (&acc)[CF::PX][CF::KV], f16* out, int ldy, int npx, bool full,
                                           int kleft) {
#pragma unroll
    for (int i = 0; i < CF::PX; ++i) {
        if (i >= npx) break;
        unsigned p[CF::KV / 2];
#pragma unroll
        for (int q = 0; q < CF::KV / 2; ++q) p[q] = pack_f16x2<RELU>(acc[i][2 * q], acc[i][2 * q + 1]);
        f16* dst = out + static_cast<long long>(i) * ldy;
        if (full) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(p[0], p[1], p[2], p[3]);
        } else {
#pragma unroll
            for (int e = 0; e < CF::KV; ++e)
                if (e < kleft) dst[e] = static_cast<f16>(p[e / 2] >> (16 * (e % 2)));
        }
    }
}

// The block's shared operands, in rounds whose global loads (PB input pixels, WB x KC weights and
// one bias value a thread) are all issued before their shared stores: a block waits for global
// memory once a round (one round in all when it has THREADS threads, i.e. for K > 8), not once
// a value. Input rows h0-1 .. h0+TH, columns w0-1 .. w0+TW: pixel p of the halo tile (consecutive
// threads, consecutive pixels) -> xs[c][row][col + col/PX], zero outside the image (the
// convolution's padding). Weights w[k][tap][c] (KRSC, 9*C values a filter) -> ws[(tap*C + c) * KMAX
// + k] for k < KP, zero past K; lane = k mod 32, so the shared stores are conflict-free (the
// strided global reads hit L1: every block of the launch reads the same 9*C*K values), warp =
// (tap*C + c) mod the block's warps. Bias -> bs[k], zero past K or without bias.
template <class CF, int C>
__device__ __forceinline__ void stage(const f16* __restrict__ x, const f16* __restrict__ w,
                                     const float* __restrict__ bias, int n, int h0, int w0, int H, int W, int K,
                                     int KP, int ldx, float* xs, float* ws, float* bs) {
    enum : int {
        NP = CF::HH * CF::HW,                                  // input pixels
        PB = (NP + CF::THREADS - 1) / CF::THREADS,             // pixels a thread loads a round
        WB = (9 * C + CF::THREADS / 32 - 1) / (CF::THREADS / 32),  // taps x channels a lane loads a round
        KC = CF::KMAX / 32,                                    // ... for each of KC groups of 32 filters
    };
    const int nt = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = nt >> 5;
    for (int round = 0; round * PB * nt < NP || round * WB * nwarps < 9 * C || round * nt < KP; ++round) {
        f16 xr[PB][C], wr[WB][KC];
        int xat[PB];  // the pixel's shared index in plane 0, -1 past the tile
#pragma unroll
        for (int b = 0; b < PB; ++b) {
            const int p = (round * PB + b) * nt + threadIdx.x;
            xat[b] = -1;
#pragma unroll
            for (int c = 0; c < C; ++c) xr[b][c] = 0;
            if (p < NP) {
                const int r = p / CF::HW, j = p - r * CF::HW;
                const int hh = h0 - 1 + r, ww = w0 - 1 + j;
                xat[b] = r * CF::PITCH + j + j / CF::PX;
                if (inside(hh, ww, H, W)) {
                    const f16* src = x + ((static_cast<long long>(n) * H + hh) * W + ww) * ldx;
#pragma unroll
                    for (int c = 0; c < C; ++c) xr[b][c] = src[c];
                }
            }
        }
#pragma unroll
        for (int q = 0; q < KC; ++q) {
            if (32 * q >= KP) break;  // uniform: the groups of 32 filters that K has
            const int k = lane + 32 * q;
#pragma unroll
            for (int b = 0; b < WB; ++b) {
                const int tc = (round * WB + b) * nwarps + warp;
                wr[b][q] = (tc < 9 * C && k < K) ? w[k * (9 * C) + tc] : static_cast<f16>(0);
            }
        }
        const int kb = round * nt + threadIdx.x;
        const float bv = (bias != nullptr && kb < K) ? bias[kb] : 0.f;
#pragma unroll
        for (int b = 0; b < PB; ++b)
            if (xat[b] >= 0) {
#pragma unroll
                for (int c = 0; c < C; ++c) xs[c * CF::PLANE + xat[b]] = f16_to_f32(xr[b][c]);
            }
#pragma unroll
        for (int q = 0; q < KC; ++q) {
            if (32 * q >= KP) break;
            const int k = lane + 32 * q;
#pragma unroll
            for (int b = 0; b < WB; ++b) {
                const int tc = (round * WB + b) * nwarps + warp;
                if (tc < 9 * C && k < KP) ws[tc * CF::KMAX + k] = f16_to_f32(wr[b][q]);
            }
        }
        if (kb < KP) bs[kb] = bv;
    }
}

// acc[i][k] += the 3x3xC window of the unit's output pixel i times filter k of its channel group.
// xt: the unit's first input column in the tile row above its output row; wt: the shared address
// of its channel group's weights at tap (0,0), channel 0.
template <class CF, int C>
__device__ __forceinline__ void accumulate(float (&acc)[CF::PX][CF::KV], const float* xt, unsigned wt) {
#pragma unroll 1
    for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float xv[CF::PX + 2];  // input columns 0 .. PX+1 of the window row: output pixel i reads i+s
#pragma unroll
            for (int j = 0; j < CF::PX + 2; ++j) xv[j] = xt[c * CF::PLANE + j + j / CF::PX];
#pragma unroll
            for (int s = 0; s < 3; ++s) {
                const unsigned wa = wt + (s * C + c) * CF::KMAX * 4;
                const float4 lo = lds128_at(wa), hi = lds128_at(wa + 16);
                const float wv[CF::KV] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int i = 0; i < CF::PX; ++i)
#pragma unroll
                    for (int k = 0; k < CF::KV; ++k) acc[i][k] = fmaf(xv[i + s], wv[k], acc[i][k]);
            }
        }
        xt += CF::PITCH;
        wt += 3 * C * CF::KMAX * 4;
    }
}

// Calls f.run<C>() for the runtime C in 1..C_: one instance per channel count, so that the loops
// over channels are unrolled over exactly C (no padding to CMAX). (Functors, not generic lambdas:
// NVRTC takes a lambda in device code only as an extended lambda, an nvcc option.)
template <int C_, class F>
__device__ __forceinline__ void with_channels(int C, const F& f) {
    if (C == C_)
        f.template run<C_>();
    else if constexpr (C_ > 1)
        with_channels<C_ - 1>(C, f);
}

template <class CF>
struct Stage {
    const f16* x;
    const f16* w;
    const float* bias;
    int n, h0, w0, H, W, K, KP, ldx;
    float* xs;
    float* ws;
    float* bs;
    template <int C>
    __device__ __forceinline__ void run() const {
        stage<CF, C>(x, w, bias, n, h0, w0, H, W, K, KP, ldx, xs, ws, bs);
    }
};

template <class CF>
struct Accumulate {
    float (&acc)[CF::PX][CF::KV];
    const float* xt;
    unsigned wt;
    template <int C>
    __device__ __forceinline__ void run() const {
        accumulate<CF, C>(acc, xt, wt);
    }
};

template <class CF>
__device__ __forceinline__ void conv(const f16* __restrict__ x, const f16* __restrict__ w,
                                     const float* __restrict__ bias, f16* __restrict__ y, int N, int H, int W, int C,
                                     int K, int ldx, int ldy, int relu, float* xs, float* ws, float* bs) {
    const int tiles_w = (W + CF::TW - 1) / CF::TW;
    const int tiles_h = (H + CF::TH - 1) / CF::TH;
    const int tw = blockIdx.x % tiles_w;
    const int th = (blockIdx.x / tiles_w) % tiles_h;
    const int n = blockIdx.x / tiles_w / tiles_h;
    if (n >= N) return;
    const int h0 = th * CF::TH, w0 = tw * CF::TW;
    const int KG = (K + CF::KV - 1) / CF::KV;  // channel groups
    const int KP = KG * CF::KV;                // K rounded up to whole groups

    with_channels<CF::CMAX>(C, Stage<CF>{x, w, bias, n, h0, w0, H, W, K, KP, ldx, xs, ws, bs});
    __syncthreads();

    const bool vec = ldy % 8 == 0 && aligned16(y);
    const unsigned ws_addr = smem_u32(ws), bs_addr = smem_u32(bs);
    for (int u = threadIdx.x; u < CF::GROUPS * KG; u += blockDim.x) {
        const int g = u / KG, cg = u - g * KG;  // pixel group, channel group
        const int ty = g / CF::GX, gx = g - ty * CF::GX;
        const int h = h0 + ty, wb = w0 + gx * CF::PX;
        if (h >= H || wb >= W) continue;  // past the image's bottom or right edge

        float acc[CF::PX][CF::KV];
        const float4 lo = lds128_at(bs_addr + cg * CF::KV * 4), hi = lds128_at(bs_addr + (cg * CF::KV + 4) * 4);
#pragma unroll
        for (int i = 0; i < CF::PX; ++i) {
            acc[i][0] = lo.x;
            acc[i][1] = lo.y;
            acc[i][2] = lo.z;
            acc[i][3] = lo.w;
            acc[i][4] = hi.x;
            acc[i][5] = hi.y;
            acc[i][6] = hi.z;
            acc[i][7] = hi.w;
        }
        // Output pixel wb+i reads input columns gx*PX + i + s of tile rows ty + r (r, s = 0..2).
        const float* xt = xs + ty * CF::PITCH + gx * (CF::PX + 1);
        const unsigned wt = ws_addr + cg * CF::KV * 4;
        with_channels<CF::CMAX>(C, Accumulate<CF>{acc, xt, wt});

        f16* out = y + ((static_cast<long long>(n) * H + h) * W + wb) * ldy + cg * CF::KV;
        const int npx = W - wb < CF::PX ? W - wb : CF::PX;
        const bool full = vec && cg * CF::KV + CF::KV <= K;
        if (relu)
            store_unit<CF, true>(acc, out, ldy, npx, full, K - cg * CF::KV);
        else
            store_unit<CF, false>(acc, out, ldy, npx, full, K - cg * CF::KV);
    }
}

typedef Cfg<CONV_F16_SMALLC> SmallC;  // CONV_F16_SMALLC is the list TH,TW,THREADS,MIN_BLOCKS

}  // namespace smallc

// C <= CMAX input channels, K <= KMAX output channels (dualtrack.kernels.Conv3x3Spec.smallc_supported;
// launch() refuses other shapes, and the kernel returns without writing rather than overrun its
// shared memory). 1-D grid of N * ceil(H/TH) * ceil(W/TW) blocks of min(THREADS, TH*TW/8 *
// ceil(K/8)) threads (whole warps). Any x, w, ldx; 16-byte stores where ldy and y allow them.
extern "C" __global__ void __launch_bounds__(smallc::SmallC::THREADS, smallc::SmallC::MIN_BLOCKS)
    conv3x3_nhwc_f16_smallc(const f16* __restrict__ x, const f16* __restrict__ w, const float* __restrict__ bias,
                            f16* __restrict__ y, int N, int H, int W, int C, int K, int ldx, int ldy, int relu) {
    typedef smallc::SmallC CF;
    __shared__ __align__(16) float xs[CF::XS];
    __shared__ __align__(16) float ws[CF::WS];
    __shared__ __align__(16) float bs[CF::KMAX];
    if (C < 1 || C > CF::CMAX || K < 1 || K > CF::KMAX || blockDim.x % 32 != 0) return;
    smallc::conv<CF>(x, w, bias, y, N, H, W, C, K, ldx, ldy, relu, xs, ws, bs);
}

// ------------------------------------------------------------------------------------------------
// fp32: CUDA cores, the register-tiled SIMT GEMM of dualtrack_device.cuh (simt::mainloop); this
// section brings its im2col loads.
// ------------------------------------------------------------------------------------------------

namespace f32conv {

typedef simt::Tiles<CONV_F32_BM, CONV_F32_BN, CONV_F32_BK, CONV_F32_TM, CONV_F32_TN> T;

static_assert(T::SMEM_BYTES + 2 * T::BM * 4 <= 48 * 1024, "static shared memory is capped at 48 KiB");

struct Problem {
    const float* x;
    const float* w;
    int H, W, C, K, ldx, Kg;
};

template <bool VEC>
__device__ __forceinline__ void load_tile(const Problem& p, const int* row_h, const int* row_w, simt::Stage<T>& st,
                                          int kt, int cblocks, int m0, int n0) {
    if constexpr (VEC) {
        const int rs = kt / cblocks;
        const int c = (kt - rs * cblocks) * T::BK + (threadIdx.x % T::CPR) * 4;
        const int r = rs / 3, s = rs - 3 * (rs / 3);
        const bool c_ok = c < p.C;
#pragma unroll
        for (int i = 0; i < T::A_VEC; ++i) {
            const int row = threadIdx.x / T::CPR + i * (T::THREADS / T::CPR);
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c_ok && inside(row_h[row] + r - 1, row_w[row] + s - 1, p.H, p.W))
                v = *reinterpret_cast<const float4*>(
                    p.x + (static_cast<long long>(m0 + row + (r - 1) * p.W + (s - 1)) * p.ldx + c));
            simt::put4(st.a, 4 * i, v);
        }
#pragma unroll
        for (int i = 0; i < T::B_VEC; ++i) {
            const int row = threadIdx.x / T::CPR + i * (T::THREADS / T::CPR);
            const int k = n0 + row;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c_ok && k < p.K)
                v = *reinterpret_cast<const float4*>(p.w + (static_cast<long long>(k) * p.Kg + rs * p.C + c));
            simt::put4(st.b, 4 * i, v);
        }
    } else {
        const int kg = kt * T::BK + threadIdx.x % T::BK;
        const bool k_ok = kg < p.Kg;
        const int rs = k_ok ? kg / p.C : 0;
        const int c = kg - rs * p.C;
        const int r = rs / 3, s = rs - 3 * (rs / 3);
#pragma unroll
        for (int i = 0; i < T::A_SCA; ++i) {
            const int row = threadIdx.x / T::BK + i * (T::THREADS / T::BK);
            float v = 0.f;
            if (k_ok && inside(row_h[row] + r - 1, row_w[row] + s - 1, p.H, p.W))
                v = p.x[static_cast<long long>(m0 + row + (r - 1) * p.W + (s - 1)) * p.ldx + c];
            st.a[i] = v;
        }
#pragma unroll
        for (int i = 0; i < T::B_SCA; ++i) {
            const int row = threadIdx.x / T::BK + i * (T::THREADS / T::BK);
            const int k = n0 + row;
            st.b[i] = (k_ok && k < p.K) ? p.w[static_cast<long long>(k) * p.Kg + kg] : 0.f;
        }
    }
}

// The GEMM over the 9*C taps: one tap (r,s) and BK channels a k-tile (VEC), else BK flattened taps.
template <bool VEC>
__device__ __forceinline__ void mainloop(const Problem& p, const int* row_h, const int* row_w, float* As, float* Bs,
                                         float (&acc)[T::TM][T::TN], int m0, int n0) {
    const int cblocks = (p.C + T::BK - 1) / T::BK;
    const int num_kt = VEC ? 9 * cblocks : (p.Kg + T::BK - 1) / T::BK;
    const auto load = [&](simt::Stage<T>& st, int kt) { load_tile<VEC>(p, row_h, row_w, st, kt, cblocks, m0, n0); };
    simt::mainloop<T, VEC>(load, num_kt, As, Bs, acc);
}

}  // namespace f32conv

extern "C" __global__ void __launch_bounds__(f32conv::T::THREADS)
conv3x3_nhwc_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                 float* __restrict__ y, int N, int H, int W, int C, int K, int ldx, int ldy, int relu) {
    using f32conv::T;
    __shared__ __align__(16) float As[2 * T::BK * T::BMP];
    __shared__ __align__(16) float Bs[2 * T::BK * T::BNP];
    __shared__ int row_h[T::BM];
    __shared__ int row_w[T::BM];

    const int M = N * H * W;
    const int m0 = blockIdx.x * T::BM;
    const int n0 = blockIdx.y * T::BN;
    const int tm0 = T::tm0();  // this thread's pixels: m0+tm0 .. +TM-1
    const int tn0 = T::tn0();  // this thread's channels: n0+tn0 .. +TN-1
    const f32conv::Problem p{x, w, H, W, C, K, ldx, 9 * C};

    decode_rows(row_h, row_w, T::BM, m0, M, H, W);
    __syncthreads();

    float acc[T::TM][T::TN];

    if (C % 4 == 0 && ldx % 4 == 0 && aligned16(x) && aligned16(w))
        f32conv::mainloop<true>(p, row_h, row_w, As, Bs, acc, m0, n0);
    else
        f32conv::mainloop<false>(p, row_h, row_w, As, Bs, acc, m0, n0);

    float bv[T::TN];
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int k = n0 + tn0 + j;
        bv[j] = (bias != nullptr && k < K) ? bias[k] : 0.f;
    }
    const bool vec_out = ldy % 4 == 0 && aligned16(y);
#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + tm0 + i;
        if (m >= M) break;
        float* dst = y + static_cast<long long>(m) * ldy;
#pragma unroll
        for (int j = 0; j < T::TN; j += 4) {
            const int k = n0 + tn0 + j;
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                v[e] = acc[i][j + e] + bv[j + e];
                if (relu) v[e] = fmaxf(v[e], 0.f);
            }
            if (vec_out && k + 4 <= K) {
                *reinterpret_cast<float4*>(dst + k) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (k + e < K) dst[k + e] = v[e];
            }
        }
    }
}
