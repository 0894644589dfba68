// 2x2 transposed convolution, stride 2, no padding, group 1 (ONNX ConvTranspose, the U-Net
// decoder's up-sampling), NHWC activations, packed weights, fused bias.
//
//   y[n,2h+i,2w+j,k] = bias[k] + sum_c x[n,h,w,c] * Wonnx[c,k,i,j]
//
// The weights come packed as wp (4K, C) in the activation dtype, wp[(i*2+j)*K + k, c] =
// Wonnx[c,k,i,j] (`dualtrack.kernels.pack_convt_weights`), which makes the op a plain GEMM:
// M = N*H*W input pixels, N_gemm = 4K, K_gemm = C. Row m of A is input pixel m (C channels at
// x + m*ldx); row n' = t*K + k of B is wp's row n' (C contiguous values), so B is K-major ("col")
// as is, like the conv's KRSC weights with one tap instead of nine.
//
// Each block computes BM pixels x BN consecutive GEMM columns n = t*K + k, which may span taps
// (the decoder's first up-convolution, K = 32, fills a 64-wide tile with two taps instead of half
// a tile with one), and stores column n to output pixel (2h+i, 2w+j), t = i*2+j, channel k. The
// grid is 1-D, the column tile fastest (block_tile), so the blocks that read one tile of x run
// together. Output pixel of input pixel m = (n*H + h)*W + w: row 2*(n*H+h)+i of the (N*2H) x 2W
// image, column 2w+j, i.e. (2*(m/W) + i)*2W + 2*(m%W) + j.
//
// A k-tile is BK consecutive input channels. Vector path (C, ldx multiple of 8 fp16 / 4 fp32,
// x and w 16-byte aligned): 16-byte copies (cp.async for fp16), zero-filled past C and past M.
// Scalar path otherwise: element loads with bounds checks.
//
// Tile sizes are not set here: `dualtrack.kernels` passes them as -D macros, so the launch
// geometry and the code always agree. Compile with `python -m dualtrack.ptx`.
//
// No toolkit #include (see conv3x3_nhwc.cu): fp16 values are raw IEEE bits in `unsigned short`;
// conversions and tensor-core ops are inline PTX. The fp16 mainloop is conv3x3_nhwc.cu's with the
// im2col addressing removed; the fp32 GEMM (simt::mainloop) and the helpers are
// dualtrack_device.cuh's.

#if !defined(CONVT_F16_BM) || !defined(CONVT_F16_BN) || !defined(CONVT_F16_BK) || \
    !defined(CONVT_F16_WARPS_M) || !defined(CONVT_F16_WARPS_N) || !defined(CONVT_F16_STAGES) || \
    !defined(CONVT_F32_BM) || !defined(CONVT_F32_BN) || !defined(CONVT_F32_BK) || \
    !defined(CONVT_F32_TM) || !defined(CONVT_F32_TN)
#error "tile sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// Element offset of output pixel (2h+i, 2w+j) for input pixel m = (n*H + h)*W + w: 64-bit, since
// the output has 4x the input's pixels.
__device__ __forceinline__ long long out_pixel(int m, int W, int i, int j) {
    const int r = m / W;  // n*H + h
    const int w = m - r * W;
    return (2ll * r + i) * (2ll * W) + 2 * w + j;
}

// ------------------------------------------------------------------------------------------------
// fp16: tensor cores (mma.sync m16n8k16), cp.async multi-stage pipeline, ldmatrix fragments.
// ------------------------------------------------------------------------------------------------

namespace f16convt {

// The tile (mma::Tiles) and its shared memory: A and B rows padded by 16 bytes so the 8 row
// addresses of one ldmatrix phase hit 8 distinct 16-byte bank groups (conflict-free fragment loads).
struct Cfg : mma::Tiles<CONVT_F16_BM, CONVT_F16_BN, CONVT_F16_BK, CONVT_F16_WARPS_M, CONVT_F16_WARPS_N,
                        CONVT_F16_STAGES> {
    enum : int {
        BKP = BK + 8,
        A_STAGE = BM * BKP,  // halves
        STAGE = (BM + BN) * BKP,
        SMEM_HALVES = (STAGES * STAGE > BM * BNP) ? STAGES * STAGE : BM * BNP,
    };
    static_assert(SMEM_HALVES * 2 <= 48 * 1024, "static shared memory is capped at 48 KiB");

    static __device__ __forceinline__ int at(int row, int q) { return row * BKP + q * 8; }  // halves
};

struct Problem {
    const f16* x;
    const f16* w;  // wp: row n = t*K + k (tap t, output channel k)
    int C, NG, ldx, M;  // NG = 4K GEMM columns
};

// Vector path, k-tile kt = channels [kt*BK, kt*BK + BK): one cp.async group's worth of copies.
__device__ __forceinline__ void load_tile_vec(const Problem& p, f16* stage, int kt, int m0, int n0) {
    const int q8 = (threadIdx.x % Cfg::CPR) * 8;
    const int c = kt * Cfg::BK + q8;
    const bool c_ok = c < p.C;  // C % 8 == 0: a chunk is wholly inside or outside
    f16* a = stage;
    f16* b = stage + Cfg::A_STAGE;
#pragma unroll
    for (int i = 0; i < Cfg::BM * Cfg::CPR / Cfg::THREADS; ++i) {
        const int row = threadIdx.x / Cfg::CPR + i * (Cfg::THREADS / Cfg::CPR);
        const bool ok = c_ok && m0 + row < p.M;
        const f16* src = p.x;  // any valid address: with src-size 0 nothing is read
        if (ok) src = p.x + (static_cast<long long>(m0 + row) * p.ldx + c);
        cp_async_16(smem_u32(a + row * Cfg::BKP + q8), src, ok ? 16u : 0u);
    }
#pragma unroll
    for (int i = 0; i < Cfg::BN * Cfg::CPR / Cfg::THREADS; ++i) {
        const int row = threadIdx.x / Cfg::CPR + i * (Cfg::THREADS / Cfg::CPR);
        const int k = n0 + row;
        const bool ok = c_ok && k < p.NG;
        const f16* src = p.w;
        if (ok) src = p.w + (static_cast<long long>(k) * p.C + c);
        cp_async_16(smem_u32(b + row * Cfg::BKP + q8), src, ok ? 16u : 0u);
    }
}

// Scalar path, same k-tile, element by element. Each thread owns one column (channel).
__device__ __forceinline__ void load_tile_scalar(const Problem& p, f16* stage, int kt, int m0, int n0) {
    const int j = threadIdx.x % Cfg::BK;
    const int c = kt * Cfg::BK + j;
    const bool c_ok = c < p.C;
    f16* a = stage;
    f16* b = stage + Cfg::A_STAGE;
#pragma unroll 4
    for (int i = 0; i < Cfg::BM * Cfg::BK / Cfg::THREADS; ++i) {
        const int row = threadIdx.x / Cfg::BK + i * (Cfg::THREADS / Cfg::BK);
        const int m = m0 + row;
        a[row * Cfg::BKP + j] = (c_ok && m < p.M) ? p.x[static_cast<long long>(m) * p.ldx + c] : f16(0);
    }
#pragma unroll 4
    for (int i = 0; i < Cfg::BN * Cfg::BK / Cfg::THREADS; ++i) {
        const int row = threadIdx.x / Cfg::BK + i * (Cfg::THREADS / Cfg::BK);
        const int k = n0 + row;
        b[row * Cfg::BKP + j] = (c_ok && k < p.NG) ? p.w[static_cast<long long>(k) * p.C + c] : f16(0);
    }
}

}  // namespace f16convt

// This block's (pixel tile start m0, GEMM column tile start n0) from its 1-D index: column tile
// fastest, so the blocks that read one tile of x run together (x comes from DRAM once).
__device__ __forceinline__ void block_tile(int bm, int bn, int NG, int* m0, int* n0) {
    const long long b = blockIdx.x;
    const int n_tiles = (NG + bn - 1) / bn;
    *n0 = static_cast<int>(b % n_tiles) * bn;
    *m0 = static_cast<int>(b / n_tiles) * bm;
}

// Where GEMM column n = t*K + k of input pixel m lands: y + (output pixel) * ldy + k.
template <typename T>
__device__ __forceinline__ T* out_at(T* y, int m, int W, int n, int K, int ldy) {
    const int t = n / K;
    return y + (out_pixel(m, W, t >> 1, t & 1) * ldy + (n - t * K));
}

extern "C" __global__ void __launch_bounds__(f16convt::Cfg::THREADS)
convt2x2_nhwc_f16(const f16* __restrict__ x, const f16* __restrict__ w, const float* __restrict__ bias,
                  f16* __restrict__ y, int N, int H, int W, int C, int K, int ldx, int ldy) {
    using namespace f16convt;
    __shared__ __align__(16) f16 smem[Cfg::SMEM_HALVES];

    const int M = N * H * W;  // the launcher refuses M >= 2^31
    const int NG = 4 * K;
    int m0, n0;
    block_tile(Cfg::BM, Cfg::BN, NG, &m0, &n0);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wm = warp % Cfg::WARPS_M;
    const int wn = warp / Cfg::WARPS_M;
    const Problem p{x, w, C, NG, ldx, M};

    float acc[Cfg::MT][Cfg::NT][4];
    mma::clear<Cfg>(acc);

    const int num_kt = (C + Cfg::BK - 1) / Cfg::BK;
    // With C % 8 == 0, every row of w is 16-byte aligned if w is.
    const bool vec = C % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
    if (vec) {
        // Prologue fills STAGES-1 stages; every iteration then commits exactly one group (possibly
        // empty), so "all but the newest STAGES-2 groups done" always means "tile kt has landed".
#pragma unroll
        for (int st = 0; st < Cfg::STAGES - 1; ++st) {
            if (st < num_kt) load_tile_vec(p, smem + st * Cfg::STAGE, st, m0, n0);
            cp_async_commit();
        }
        for (int kt = 0; kt < num_kt; ++kt) {
            cp_async_wait<Cfg::STAGES - 2>();
            // Publishes tile kt to all warps, and tells everyone that stage (kt-1)%STAGES, which
            // the prefetch below overwrites, has been consumed.
            __syncthreads();
            const int pf = kt + Cfg::STAGES - 1;
            if (pf < num_kt) load_tile_vec(p, smem + (pf % Cfg::STAGES) * Cfg::STAGE, pf, m0, n0);
            cp_async_commit();
            mma::stage<Cfg>(smem_u32(smem + (kt % Cfg::STAGES) * Cfg::STAGE), acc, wm, wn, lane);
        }
        cp_async_wait<0>();
    } else {
        for (int kt = 0; kt < num_kt; ++kt) {
            __syncthreads();
            load_tile_scalar(p, smem, kt, m0, n0);
            __syncthreads();
            mma::stage<Cfg>(smem_u32(smem), acc, wm, wn, lane);
        }
    }
    __syncthreads();  // the epilogue tile reuses the pipeline's shared memory

    // Epilogue: bias in fp32, round once to fp16, stage the BM x BN tile in shared memory so that
    // global stores are whole 16-byte chunks of consecutive channels.
    f16* tile = smem;
    mma::stage_epilogue<Cfg>(
        tile, acc, wm, wn, lane,
        [&](int col) { return (bias != nullptr && n0 + col < NG) ? bias[(n0 + col) % K] : 0.f; },  // channel n % K
        [](float v) { return v; });
    __syncthreads();
    // A chunk of 8 columns stays within one tap when K % 8 == 0: one 16-byte store where allowed.
    mma::store_epilogue<Cfg>(tile, m0, n0, M, NG, K % 8 == 0 && ldy % 8 == 0 && aligned16(y),
                             [&](int m, int n) { return out_at(y, m, W, n, K, ldy); });
}

// ------------------------------------------------------------------------------------------------
// fp32: CUDA cores, the register-tiled SIMT GEMM of dualtrack_device.cuh (simt::mainloop); this
// section brings its loads and the scattering epilogue.
// ------------------------------------------------------------------------------------------------

namespace f32convt {

typedef simt::Tiles<CONVT_F32_BM, CONVT_F32_BN, CONVT_F32_BK, CONVT_F32_TM, CONVT_F32_TN> T;

static_assert(T::SMEM_BYTES <= 48 * 1024, "static shared memory is capped at 48 KiB");

struct Problem {
    const float* x;
    const float* w;  // wp: row n = t*K + k
    int C, NG, ldx, M;  // NG = 4K GEMM columns
};

// Rows first, first + STEP, ... (N of them) of a row-major matrix (`rows` rows, row stride ld),
// columns c .. c+3 (VEC: one float4 a row into dst[4*i ..]) or column c (dst[i]); zero past the
// matrix. A and B of this GEMM are both such matrices: x (M x C) and wp (4K x C).
template <bool VEC, int N, int STEP, int LEN>
__device__ __forceinline__ void load_rows(float (&dst)[LEN], const float* src, int ld, int rows, int first, int c,
                                          bool c_ok) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int row = first + i * STEP;
        const bool ok = c_ok && row < rows;
        if constexpr (VEC) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (ok) v = *reinterpret_cast<const float4*>(src + (static_cast<long long>(row) * ld + c));
            simt::put4(dst, 4 * i, v);
        } else {
            dst[i] = ok ? src[static_cast<long long>(row) * ld + c] : 0.f;
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void load_tile(const Problem& p, simt::Stage<T>& st, int kt, int m0, int n0) {
    if constexpr (VEC) {
        const int c = kt * T::BK + (threadIdx.x % T::CPR) * 4;
        const bool c_ok = c < p.C;  // C % 4 == 0: a float4 is wholly inside or outside
        const int row = threadIdx.x / T::CPR;
        load_rows<true, T::A_VEC, T::THREADS / T::CPR>(st.a, p.x, p.ldx, p.M, m0 + row, c, c_ok);
        load_rows<true, T::B_VEC, T::THREADS / T::CPR>(st.b, p.w, p.C, p.NG, n0 + row, c, c_ok);
    } else {
        const int c = kt * T::BK + threadIdx.x % T::BK;
        const bool c_ok = c < p.C;
        const int row = threadIdx.x / T::BK;
        load_rows<false, T::A_SCA, T::THREADS / T::BK>(st.a, p.x, p.ldx, p.M, m0 + row, c, c_ok);
        load_rows<false, T::B_SCA, T::THREADS / T::BK>(st.b, p.w, p.C, p.NG, n0 + row, c, c_ok);
    }
}

// The GEMM over the C input channels, BK of them a k-tile.
template <bool VEC>
__device__ __forceinline__ void mainloop(const Problem& p, float* As, float* Bs, float (&acc)[T::TM][T::TN], int m0,
                                         int n0) {
    const int num_kt = (p.C + T::BK - 1) / T::BK;
    const auto load = [&](simt::Stage<T>& st, int kt) { load_tile<VEC>(p, st, kt, m0, n0); };
    simt::mainloop<T, VEC>(load, num_kt, As, Bs, acc);
}

}  // namespace f32convt

extern "C" __global__ void __launch_bounds__(f32convt::T::THREADS)
convt2x2_nhwc_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                  float* __restrict__ y, int N, int H, int W, int C, int K, int ldx, int ldy) {
    using f32convt::T;
    __shared__ __align__(16) float As[2 * T::BK * T::BMP];
    __shared__ __align__(16) float Bs[2 * T::BK * T::BNP];

    const int M = N * H * W;
    const int NG = 4 * K;
    int m0, n0;
    block_tile(T::BM, T::BN, NG, &m0, &n0);
    const int tm0 = T::tm0();  // this thread's pixels: m0+tm0 .. +TM-1
    const int tn0 = T::tn0();  // this thread's columns: n0+tn0 .. +TN-1
    const f32convt::Problem p{x, w, C, NG, ldx, M};

    float acc[T::TM][T::TN];

    // With C % 4 == 0, every row of w is 16-byte aligned if w is.
    if (C % 4 == 0 && ldx % 4 == 0 && aligned16(x) && aligned16(w))
        f32convt::mainloop<true>(p, As, Bs, acc, m0, n0);
    else
        f32convt::mainloop<false>(p, As, Bs, acc, m0, n0);

    float bv[T::TN];
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int n = n0 + tn0 + j;
        bv[j] = (bias != nullptr && n < NG) ? bias[n % K] : 0.f;
    }
    // 4 columns stay within one tap when K % 4 == 0: one 16-byte store where allowed.
    const bool vec_out = K % 4 == 0 && ldy % 4 == 0 && aligned16(y);
#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + tm0 + i;
        if (m >= M) break;
#pragma unroll
        for (int j = 0; j < T::TN; j += 4) {
            const int n = n0 + tn0 + j;
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = acc[i][j + e] + bv[j + e];
            if (vec_out && n + 4 <= NG) {
                *reinterpret_cast<float4*>(out_at(y, m, W, n, K, ldy)) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n + e < NG) *out_at(y, m, W, n + e, K, ldy) = v[e];
            }
        }
    }
}
