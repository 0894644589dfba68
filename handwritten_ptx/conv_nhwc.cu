// General 2-D convolution (any group count) with a fused epilogue, NHWC activations, KRSC weights:
//
//   y[n,p,q,k] = act(bias[k] + res[n,p,q,k]
//                    + sum_{r,s,c} x[n, p*sh - pt + r*dh, q*sw - pl + s*dw, c] * w[k,r,s,c])
//
// Groups: gridDim.z = G and C, K are the channels of ONE group (the tensors hold G*C and G*K,
// their pixel strides ldx, ldy, ldr say so). Group g = blockIdx.z is the same convolution on
// channel slices: x + g*C, filters w + g*K*R*S*C (KRSC of ONNX's (G*K, C, R, S) weights is
// group-major), bias, res and y + g*K. Every path below reads its pointers' alignment at run time,
// so an odd per-group width (ResNeXt's 4, g=3 of odd channels) takes the scalar paths by itself.
//
// Split-K (the fp16 tile entries): a conv whose output tiles leave the GPU idle while its reduction
// is deep (PAN's 7x7 512 -> 1 on 8x8 pixels: one block, 784 k-tiles in a row) runs its k-tiles in
// `splits` slices, gridDim.z = G * splits; each block leaves fp32 sums in the workspace `ws`, and
// conv_nhwc_f16_splitk adds the slices in order, then bias, residual, activation, one rounding.
//
// for any R x S kernel, strides sh/sw, dilations dh/dw and top/left padding pt/pl (the bottom and
// right padding only set the output size P x Q, which the caller passes); taps outside the image
// read zero. `res` (null: none) is a second NHWC tensor of the output's shape with its own channel
// stride ldr (ResNet's residual Add, added before the activation); `bias` is fp32 or null; `act`,
// `p0`, `p1` are dt_activate's (dualtrack_activations.cuh, from dualtrack.contract.activations),
// applied in the epilogue only. Accumulation, bias, residual
// and activation are fp32, rounded once to the output dtype.
//
// fp16 entries are an implicit GEMM on the tensor cores: M = N*P*Q output pixels, N_gemm = K,
// K_gemm = R*S*C. Row m of A is output pixel m; its (r,s,c) column is input pixel
// (n, h0 + r*dh, w0 + s*dw) at channel c, where (h0, w0) = (p*sh - pt, q*sw - pl). Since the
// flattened input pixel of a tap is that of (h0, w0) plus r*dh*W + s*dw, each thread keeps its
// rows' (h0, w0) and offsets in registers and adds one per-tap delta. Row k of B is filter k,
// which KRSC stores contiguously (R*S*C values), so B is K-major ("col") as is.
//
// A k-tile of BK columns is taken one of two ways, and A and B always agree on it:
//   vector path (C, ldx multiple of 8, x and w 16-byte aligned): one tap (r,s) and BK consecutive
//     channels, 16-byte cp.async copies through a STAGES-deep pipeline, zero-filled (src-size 0)
//     outside the image and past C;
//   scalar path (anything else: C % 8 != 0 where the stem entries below do not fit, odd slices): BK consecutive flattened taps
//     k = (r*S + s)*C + c, element by element with bounds checks, gathered into registers one
//     k-tile ahead (the loads of tile kt+1 fly during tile kt's MMAs), one shared stage.
// Epilogue: the fp32 tile (accumulators + bias) goes through shared memory in passes of up to 64
// channels, so the residual is read and y written as 16-byte chunks of consecutive channels
// (element by element where ldr/ldy, the pointers or the last K % 8 channels do not allow it).
//
// The fp32 entry is the same GEMM on CUDA cores (SIMT, register-tiled, element loads).
//
// The fp16 tile and its swizzled shared-memory layout (mma::Swizzled, mma::stage) are conv3x3's,
// the fp32 GEMM (simt::mainloop) conv3x3's and convt2x2's, all from dualtrack_device.cuh.
//
// Tile sizes are not set here: `dualtrack.kernels` (ConvGeneralSpec) passes them as -D macros, so
// the launch geometry and the code always agree. Compile with `python -m dualtrack.ptx`. No
// toolkit #include: the helpers come from the in-memory headers (see conv3x3_nhwc.cu).

#if !defined(CONVG_F16_MAIN) || !defined(CONVG_F16_NARROW) || !defined(CONVG_F16_WIDE) || \
    !defined(CONVG_F16_SMALL) || !defined(CONVG_F16_GATHER) || !defined(CONVG_DIRECT_THREADS) || \
    !defined(CONVG_DIRECT_K) || !defined(CONVG_DIRECT_W) || !defined(CONVG_F32_BM) || !defined(CONVG_F32_BN) || !defined(CONVG_F32_BK) || \
    !defined(CONVG_F32_TM) || !defined(CONVG_F32_TN) || !defined(CONVG_STEM) || !defined(CONVG_STEM_NARROW) || \
    !defined(CONVG_SPLITK_THREADS)
#error "tile sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

namespace convg {

struct Problem {
    int N, H, W, C, K, P, Q, R, S, sh, sw, pt, pl, dh, dw, ldx, ldy, ldr, act;
    float p0, p1;  // act's parameters
    int splits;  // split-K slices of the reduction (1: none); gridDim.z = groups * splits
    int M;   // N*P*Q output pixels (the launcher refuses M >= 2^31)
    int Kg;  // R*S*C
};

// blockIdx.z = split * G + group: the group this block computes (its channel slices), the slice of
// the reduction it sums (split-K, 0 of 1 without), and G.
struct Layer {
    int group, split, groups;
};

__device__ __forceinline__ Layer layer_of(const Problem& p) {
    const int G = static_cast<int>(gridDim.z) / p.splits;
    const int z = static_cast<int>(blockIdx.z);
    return {z % G, z / G, G};
}

// Group l.group's element offsets into x, w and the K-channel tensors (bias, res, y).
struct GroupOffsets {
    long long x, w, k;
};

__device__ __forceinline__ GroupOffsets group_offsets(const Problem& p, const Layer& l) {
    const long long g = l.group;
    return {g * p.C, g * p.K * p.Kg, g * p.K};
}

// Split-K: slice `split` of `splits` takes k-tiles [begin, end) of `total`, ceil(total / splits)
// a slice (the host picks counts that leave none empty; an empty one still writes its zeros).
struct KtRange {
    int begin, end;
};

__device__ __forceinline__ KtRange kt_range(int total, int splits, int split) {
    const int per = (total + splits - 1) / splits;
    const int begin = min(total, split * per);
    return {begin, min(total, begin + per)};
}

// A nullable pointer moved to its group's slice (null stays null).
template <typename T>
__device__ __forceinline__ T* shifted(T* ptr, long long off) {
    return ptr != nullptr ? ptr + off : nullptr;
}

__device__ __forceinline__ bool inside(int h, int w, const Problem& p) {
    return static_cast<unsigned>(h) < static_cast<unsigned>(p.H) && static_cast<unsigned>(w) < static_cast<unsigned>(p.W);
}

// Where output pixel m's (0,0) tap reads: input row h0, column w0 and the flat input pixel
// (n*H + h0)*W + w0. Rows past M get a row so far above the image that every tap reads zero.
struct Origin {
    int h, w, pix;
};

__device__ __forceinline__ Origin origin(const Problem& p, int m) {
    if (m >= p.M) return {-(1 << 29), 0, 0};
    const int pq = p.P * p.Q;
    const int n = m / pq;
    const int rem = m - n * pq;
    const int op = rem / p.Q;
    const int oq = rem - op * p.Q;
    const int h = op * p.sh - p.pt, w = oq * p.sw - p.pl;
    return {h, w, (n * p.H + h) * p.W + w};
}

// Column kg of the scalar path's flattened taps: channel c of tap (r,s), which reads rows
// (h0 + hh, w0 + ww), i.e. flat input pixel + dpix.
struct Tap {
    bool ok;  // kg < R*S*C
    int c, hh, ww, dpix;
};

__device__ __forceinline__ Tap tap_of(const Problem& p, int kg) {
    Tap t;
    t.ok = kg < p.Kg;
    const int rs = t.ok ? kg / p.C : 0;
    t.c = t.ok ? kg - rs * p.C : 0;
    const int r = rs / p.S, s = rs - r * p.S;
    t.hh = r * p.dh;
    t.ww = s * p.dw;
    t.dpix = t.hh * p.W + t.ww;
    return t;
}

// One element of A for the scalar paths: row (h0, w0, pix) at column tap t.
template <typename T>
__device__ __forceinline__ T gather(const T* x, const Problem& p, int h0, int w0, int pix, const Tap& t) {
    if (t.ok && inside(h0 + t.hh, w0 + t.ww, p)) return x[static_cast<long long>(pix + t.dpix) * p.ldx + t.c];
    return static_cast<T>(0);
}

// ------------------------------------------------------------------------------------------------
// fp16: tensor cores (mma.sync m16n8k16), cp.async multi-stage pipeline, ldmatrix fragments.
// ------------------------------------------------------------------------------------------------

// Shared memory of a tile: the pipeline, the scalar path (one stage, then each row's h0, w0, pix
// as ints) and the epilogue (fp32 rows of EPN channels padded by 8 floats, conflict-free float2
// stores) reuse one buffer.
template <class CF>
struct Smem {
    enum : int {
        EPN = CF::BN < 64 ? CF::BN : 64,
        EPP = EPN + 8,
        EPI = CF::BM * EPP * 4,
        SCALAR = CF::STAGE * 2 + 3 * CF::BM * 4,
        PIPE = CF::PIPE * 2,
        BYTES = PIPE > EPI ? (PIPE > SCALAR ? PIPE : SCALAR) : (EPI > SCALAR ? EPI : SCALAR),
    };
    static_assert(BYTES <= 48 * 1024, "static shared memory is capped at 48 KiB");
    static_assert(CF::BN % EPN == 0 && EPN % 8 == 0, "epilogue passes");
};

// Vector path: the copies a thread issues for one k-tile, with everything that does not change
// along k computed once. k-tiles are loaded in order: tap r, then s, then channel block cb.
template <class CF>
struct VecLoader {
    long long a_off[CF::A_CH];  // element offset of the row's (0,0) tap pixel + its chunk's channels
    int a_h[CF::A_CH], a_w[CF::A_CH];
    long long b_off[CF::B_CH];
    bool b_ok[CF::B_CH];
    unsigned a_dst[CF::A_CH], b_dst[CF::B_CH];  // shared byte offsets within a stage
    int q8, cb, r, s;

    // Starts at k-tile kt0 (a split's first; k-tiles run tap r, then s, then channel block).
    __device__ __forceinline__ void init(const Problem& p, int m0, int n0, int kt0, int cblocks) {
        const int q = threadIdx.x % CF::CPR;
        q8 = q * 8;
#pragma unroll
        for (int i = 0; i < CF::A_CH; ++i) {
            const int row = threadIdx.x / CF::CPR + i * (CF::THREADS / CF::CPR);
            const Origin o = origin(p, m0 + row);
            a_h[i] = o.h;
            a_w[i] = o.w;
            a_off[i] = static_cast<long long>(o.pix) * p.ldx + q8;
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
        cb = kt0 % cblocks;
        const int rs = kt0 / cblocks;
        r = rs / p.S;
        s = rs - r * p.S;
    }

    // Copies the next k-tile into the stage at shared address `stage`, then advances.
    __device__ __forceinline__ void load(const f16* x, const f16* w, const Problem& p, unsigned stage, int cblocks) {
        const int c0 = cb * CF::BK;
        const bool c_ok = c0 + q8 < p.C;
        const int hh = r * p.dh, ww = s * p.dw;
        const long long da = static_cast<long long>(hh * p.W + ww) * p.ldx + c0;
        const int db = (r * p.S + s) * p.C + c0;
#pragma unroll
        for (int i = 0; i < CF::A_CH; ++i) {
            const bool ok = c_ok && inside(a_h[i] + hh, a_w[i] + ww, p);
            const f16* src = ok ? x + (a_off[i] + da) : x;  // with src-size 0 nothing is read
            cp_async_16(stage + a_dst[i], src, ok ? 16u : 0u);
        }
#pragma unroll
        for (int i = 0; i < CF::B_CH; ++i) {
            const bool ok = c_ok && b_ok[i];
            const f16* src = ok ? w + (b_off[i] + db) : w;
            cp_async_16(stage + b_dst[i], src, ok ? 16u : 0u);
        }
        if (++cb == cblocks) {
            cb = 0;
            if (++s == p.S) {
                s = 0;
                ++r;
            }
        }
    }
};

// Scalar path, k-tile kt = flattened taps [kt*BK, kt*BK + BK); each thread owns one column. A
// thread first fetches all its elements of a k-tile into registers (every load in flight at once,
// two halves a register), then puts them into the stage: the conv fetches tile kt+1 before it
// multiplies tile kt, so the gathers' latency hides behind the MMAs.
template <class CF>
struct ScalarLoader {
    enum : int {
        ROWS = CF::THREADS / CF::BK,             // rows apart of a thread's consecutive elements
        A_EL = CF::BM * CF::BK / CF::THREADS,    // A elements a thread owns per k-tile
        B_EL = CF::BN * CF::BK / CF::THREADS,
    };
    static_assert(A_EL % 2 == 0 && B_EL % 2 == 0, "elements are kept in pairs");
    unsigned a[A_EL / 2], b[B_EL / 2];

    // Gathers this thread's elements of k-tile kt: into the registers (DIRECT false; put() stores
    // them later), or straight into `stage` (DIRECT true: nothing held, for the other entries).
    template <bool DIRECT>
    __device__ __forceinline__ void fetch(const f16* x, const f16* w, const Problem& p, const int* row_h,
                                          const int* row_w, const int* row_pix, int kt, int n0, f16* stage) {
        const int j = threadIdx.x % CF::BK, jq = j >> 3, je = j & 7;
        const int kg = kt * CF::BK + j;
        const Tap t = tap_of(p, kg);
        const int row0 = threadIdx.x / CF::BK;
        // DIRECT keeps few loads in flight (registers stay with the vector path); else all of them.
#pragma unroll(DIRECT ? 2 : A_EL / 2)
        for (int i = 0; i < A_EL; i += 2) {
            const int r0 = row0 + i * ROWS, r1 = r0 + ROWS;
            const f16 lo = gather(x, p, row_h[r0], row_w[r0], row_pix[r0], t);
            const f16 hi = gather(x, p, row_h[r1], row_w[r1], row_pix[r1], t);
            if constexpr (DIRECT) {
                stage[CF::at(r0, jq) + je] = lo;
                stage[CF::at(r1, jq) + je] = hi;
            } else {
                a[i / 2] = lo | (static_cast<unsigned>(hi) << 16);
            }
        }
#pragma unroll(DIRECT ? 2 : B_EL / 2)
        for (int i = 0; i < B_EL; i += 2) {
            const int k0 = n0 + row0 + i * ROWS, k1 = k0 + ROWS;
            const f16 lo = (t.ok && k0 < p.K) ? w[static_cast<long long>(k0) * p.Kg + kg] : f16(0);
            const f16 hi = (t.ok && k1 < p.K) ? w[static_cast<long long>(k1) * p.Kg + kg] : f16(0);
            if constexpr (DIRECT) {
                stage[CF::A_STAGE + CF::at(row0 + i * ROWS, jq) + je] = lo;
                stage[CF::A_STAGE + CF::at(row0 + i * ROWS + ROWS, jq) + je] = hi;
            } else {
                b[i / 2] = lo | (static_cast<unsigned>(hi) << 16);
            }
        }
    }

    __device__ __forceinline__ void put(f16* stage) const {
        const int j = threadIdx.x % CF::BK, jq = j >> 3, je = j & 7;
        const int row0 = threadIdx.x / CF::BK;
        f16* as = stage;
        f16* bs = stage + CF::A_STAGE;
#pragma unroll
        for (int i = 0; i < A_EL; i += 2) {
            const int r0 = row0 + i * ROWS;
            as[CF::at(r0, jq) + je] = static_cast<f16>(a[i / 2] & 0xffffu);
            as[CF::at(r0 + ROWS, jq) + je] = static_cast<f16>(a[i / 2] >> 16);
        }
#pragma unroll
        for (int i = 0; i < B_EL; i += 2) {
            const int r0 = row0 + i * ROWS;
            bs[CF::at(r0, jq) + je] = static_cast<f16>(b[i / 2] & 0xffffu);
            bs[CF::at(r0 + ROWS, jq) + je] = static_cast<f16>(b[i / 2] >> 16);
        }
    }
};

// bias, residual, activation, one rounding; y and res through 16-byte chunks where they allow.
// `part` (split-K; null: none): the tile's fp32 sums go there instead, pixel m at part + m * ldp,
// with neither bias (the caller passes none) nor residual nor activation: conv_nhwc_f16_splitk adds
// the slices and applies those.
template <class CF>
__device__ __forceinline__ void epilogue(float (&acc)[CF::MT][CF::NT][4], const float* bias, const f16* res, f16* y,
                                         float* part, int ldp, const Problem& p, int m0, int n0, int wm, int wn,
                                         int lane, unsigned char* smem) {
    typedef Smem<CF> SM;
    enum : int { CHUNKS = SM::EPN / 8 };
    float* tile = reinterpret_cast<float*>(smem);
    const bool vec_y = p.ldy % 8 == 0 && aligned16(y);
    const bool vec_r = res != nullptr && p.ldr % 8 == 0 && aligned16(res);
    const bool vec_p = part != nullptr && ldp % 4 == 0 && aligned16(part);
#pragma unroll
    for (int pass = 0; pass < CF::BN / SM::EPN; ++pass) {
#pragma unroll
        for (int nt = 0; nt < CF::NT; ++nt) {
            const int col = wn * CF::WN + nt * 8 + (lane & 3) * 2;
            const int local = col - pass * SM::EPN;
            if (local < 0 || local >= SM::EPN) continue;
            const int k = n0 + col;
            const float b0 = (bias != nullptr && k < p.K) ? bias[k] : 0.f;
            const float b1 = (bias != nullptr && k + 1 < p.K) ? bias[k + 1] : 0.f;
#pragma unroll
            for (int mt = 0; mt < CF::MT; ++mt) {
                const int row = wm * CF::WM + mt * 16 + (lane >> 2);
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<float2*>(tile + (row + 8 * half) * SM::EPP + local) =
                        make_float2(acc[mt][nt][2 * half] + b0, acc[mt][nt][2 * half + 1] + b1);
            }
        }
        __syncthreads();
        for (int u = threadIdx.x; u < CF::BM * CHUNKS; u += CF::THREADS) {
            const int row = u / CHUNKS;
            const int q8 = (u - row * CHUNKS) * 8;
            const int m = m0 + row;
            const int k = n0 + pass * SM::EPN + q8;
            if (m >= p.M || k >= p.K) continue;
            const bool full = k + 8 <= p.K;
            float v[8];
            const float* src = tile + row * SM::EPP + q8;
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = src[e];
            if (part != nullptr) {
                float* pp = part + (static_cast<long long>(m) * ldp + k);
                if (vec_p && full) {
                    *reinterpret_cast<float4*>(pp) = make_float4(v[0], v[1], v[2], v[3]);
                    *reinterpret_cast<float4*>(pp + 4) = make_float4(v[4], v[5], v[6], v[7]);
                } else {
                    for (int e = 0; e < 8 && k + e < p.K; ++e) pp[e] = v[e];
                }
                continue;
            }
            if (res != nullptr) {
                const f16* rp = res + (static_cast<long long>(m) * p.ldr + k);
                if (vec_r && full) {
                    const uint4 rv = *reinterpret_cast<const uint4*>(rp);
                    const unsigned rw[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        v[2 * e] += f16_to_f32(static_cast<f16>(rw[e] & 0xffffu));
                        v[2 * e + 1] += f16_to_f32(static_cast<f16>(rw[e] >> 16));
                    }
                } else {
                    for (int e = 0; e < 8 && k + e < p.K; ++e) v[e] += f16_to_f32(rp[e]);
                }
            }
            dt_activate_n(v, p.act, p.p0, p.p1);
            f16* dst = y + (static_cast<long long>(m) * p.ldy + k);
            if (vec_y && full) {
                uint4 out;
                out.x = static_cast<unsigned>(f32_to_f16(v[0])) | (static_cast<unsigned>(f32_to_f16(v[1])) << 16);
                out.y = static_cast<unsigned>(f32_to_f16(v[2])) | (static_cast<unsigned>(f32_to_f16(v[3])) << 16);
                out.z = static_cast<unsigned>(f32_to_f16(v[4])) | (static_cast<unsigned>(f32_to_f16(v[5])) << 16);
                out.w = static_cast<unsigned>(f32_to_f16(v[6])) | (static_cast<unsigned>(f32_to_f16(v[7])) << 16);
                *reinterpret_cast<uint4*>(dst) = out;
            } else {
                for (int e = 0; e < 8 && k + e < p.K; ++e) dst[e] = f32_to_f16(v[e]);
            }
        }
        __syncthreads();  // the next pass overwrites the tile
    }
}

// The vector path's main loop (16-byte cp.async copies, STAGES-deep pipeline) over split `split`'s k-tiles.
template <class CF>
__device__ __forceinline__ void vector_mainloop(const f16* __restrict__ x, const f16* __restrict__ w, const Problem& p,
                                                int split, int m0, int n0, unsigned smem_base,
                                                float (&acc)[CF::MT][CF::NT][4], int wm, int wn, int lane) {
    const int cblocks = (p.C + CF::BK - 1) / CF::BK;
    const KtRange kr = kt_range(p.R * p.S * cblocks, p.splits, split);
    const int num_kt = kr.end - kr.begin;
    VecLoader<CF> ld;
    ld.init(p, m0, n0, kr.begin, cblocks);
    // Prologue fills STAGES-1 stages; every iteration then commits exactly one group (possibly
    // empty), so "all but the newest STAGES-2 groups done" always means "tile kt has landed".
#pragma unroll
    for (int st = 0; st < CF::STAGES - 1; ++st) {
        if (st < num_kt) ld.load(x, w, p, smem_base + st * CF::STAGE * 2, cblocks);
        cp_async_commit();
    }
    int rd = 0, wr = CF::STAGES - 1;  // stage read this iteration / written by its prefetch
    for (int kt = 0; kt < num_kt; ++kt) {
        cp_async_wait<CF::STAGES - 2>();
        // Publishes tile kt to all warps, and tells everyone that stage wr, last read in
        // iteration kt-1, has been consumed.
        __syncthreads();
        if (kt + CF::STAGES - 1 < num_kt) ld.load(x, w, p, smem_base + wr * CF::STAGE * 2, cblocks);
        cp_async_commit();
        mma::stage<CF>(smem_base + rd * CF::STAGE * 2, acc, wm, wn, lane);
        rd = rd + 1 == CF::STAGES ? 0 : rd + 1;
        wr = wr + 1 == CF::STAGES ? 0 : wr + 1;
    }
    cp_async_wait<0>();
}

// GATHER: the entry for inputs the vector path cannot take (C % 8 != 0; the RGB stems go to the
// stem entries, conv_stem.cuh, wherever their shared memory fits): the scalar
// path with the next k-tile's gathers in flight during this tile's MMAs. The other entries keep
// the vector path and, for the odd launch it refuses (an unaligned pointer or channel stride),
// the scalar path one k-tile at a time (no registers held across the MMAs, so the vector path
// keeps its register budget).
//
// Split-K (p.splits > 1): the block sums split `split`'s k-tiles only and leaves its fp32 tile in
// `part` (epilogue); both paths number their own k-tiles and take the same share of them.
template <class CF, bool GATHER>
__device__ __forceinline__ void conv_f16(const f16* __restrict__ x, const f16* __restrict__ w,
                                         const float* __restrict__ bias, const f16* __restrict__ res,
                                         f16* __restrict__ y, float* __restrict__ part, int ldp, int split,
                                         const Problem& p, unsigned char* smem) {
    const int m0 = blockIdx.x * CF::BM;
    const int n0 = blockIdx.y * CF::BN;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wm = warp % CF::WARPS_M;
    const int wn = warp / CF::WARPS_M;
    const unsigned smem_base = smem_u32(smem);

    float acc[CF::MT][CF::NT][4];
    mma::clear<CF>(acc);

    bool done = false;
    if constexpr (!GATHER) {
        if (p.C % 8 == 0 && p.ldx % 8 == 0 && aligned16(x) && aligned16(w)) {
            vector_mainloop<CF>(x, w, p, split, m0, n0, smem_base, acc, wm, wn, lane);
            done = true;
        }
    }
    if (!done) {
        int* row_h = reinterpret_cast<int*>(smem + CF::STAGE * 2);
        int* row_w = row_h + CF::BM;
        int* row_pix = row_w + CF::BM;
        for (int i = threadIdx.x; i < CF::BM; i += CF::THREADS) {
            const Origin o = origin(p, m0 + i);
            row_h[i] = o.h;
            row_w[i] = o.w;
            row_pix[i] = o.pix;
        }
        f16* stage = reinterpret_cast<f16*>(smem);
        const KtRange kr = kt_range((p.Kg + CF::BK - 1) / CF::BK, p.splits, split);
        ScalarLoader<CF> ld;
        __syncthreads();  // the rows are decoded
        if constexpr (GATHER) ld.template fetch<false>(x, w, p, row_h, row_w, row_pix, kr.begin, n0, stage);
        for (int kt = kr.begin; kt < kr.end; ++kt) {
            __syncthreads();  // the previous k-tile has been read
            if constexpr (GATHER) {
                ld.put(stage);
            } else {
                ld.template fetch<true>(x, w, p, row_h, row_w, row_pix, kt, n0, stage);
            }
            __syncthreads();
            if constexpr (GATHER) {
                if (kt + 1 < kr.end) ld.template fetch<false>(x, w, p, row_h, row_w, row_pix, kt + 1, n0, stage);
            }
            mma::stage<CF>(smem_base, acc, wm, wn, lane);
        }
    }
    __syncthreads();  // the epilogue tile reuses the pipeline's shared memory
    epilogue<CF>(acc, bias, res, y, part, ldp, p, m0, n0, wm, wn, lane, smem);
}

// ------------------------------------------------------------------------------------------------
// fp16, few output channels (K <= CONVG_DIRECT_K: a segmentation head's classes): a GEMM tile would
// leave most of its N columns empty, so this is a direct convolution on CUDA cores. A thread per
// output pixel keeps all K sums in registers; the block's filters (K*R*S*C <= CONVG_DIRECT_W)
// sit in shared memory as fp32, read as float4; the input comes as 16-byte chunks where C and
// ldx allow (else element by element). Same epilogue math as the tiles: fp32, one rounding.
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void direct_taps(const float (&v)[8], const float* wt, int Kg, int K,
                                            float (&acc)[CONVG_DIRECT_K]) {
#pragma unroll
    for (int k = 0; k < CONVG_DIRECT_K; ++k) {
        if (k < K) {
            const float4 w0 = lds128(wt + k * Kg), w1 = lds128(wt + k * Kg + 4);
            acc[k] += v[0] * w0.x + v[1] * w0.y + v[2] * w0.z + v[3] * w0.w + v[4] * w1.x + v[5] * w1.y +
                      v[6] * w1.z + v[7] * w1.w;
        }
    }
}

__device__ __forceinline__ void conv_direct(const f16* __restrict__ x, const f16* __restrict__ w,
                                            const float* __restrict__ bias, const f16* __restrict__ res,
                                            f16* __restrict__ y, const Problem& p, float* ws) {
    for (int i = threadIdx.x; i < p.K * p.Kg; i += blockDim.x) ws[i] = f16_to_f32(w[i]);  // KRSC
    __syncthreads();
    const bool vec = p.C % 8 == 0 && p.ldx % 8 == 0 && aligned16(x);
    const int step = gridDim.x * blockDim.x;
    for (int m = blockIdx.x * blockDim.x + threadIdx.x; m < p.M; m += step) {
        const Origin o = origin(p, m);
        float acc[CONVG_DIRECT_K];
#pragma unroll
        for (int k = 0; k < CONVG_DIRECT_K; ++k) acc[k] = 0.f;
        for (int r = 0; r < p.R; ++r) {
            const int hh = r * p.dh;
            if (static_cast<unsigned>(o.h + hh) >= static_cast<unsigned>(p.H)) continue;
            for (int s = 0; s < p.S; ++s) {
                const int ww = s * p.dw;
                if (static_cast<unsigned>(o.w + ww) >= static_cast<unsigned>(p.W)) continue;
                const f16* px = x + static_cast<long long>(o.pix + hh * p.W + ww) * p.ldx;
                const float* wt = ws + (r * p.S + s) * p.C;
                if (vec) {
                    for (int c = 0; c < p.C; c += 8) {
                        float v[8];
                        load_f16x8(v, px + c);
                        direct_taps(v, wt + c, p.Kg, p.K, acc);
                    }
                } else {
                    for (int c = 0; c < p.C; ++c) {
                        const float v = f16_to_f32(px[c]);
#pragma unroll
                        for (int k = 0; k < CONVG_DIRECT_K; ++k)
                            if (k < p.K) acc[k] += v * wt[k * p.Kg + c];
                    }
                }
            }
        }
        f16* dst = y + static_cast<long long>(m) * p.ldy;
        const f16* rp = res != nullptr ? res + static_cast<long long>(m) * p.ldr : nullptr;
#pragma unroll
        for (int k = 0; k < CONVG_DIRECT_K; ++k) {
            if (k < p.K) {
                acc[k] += bias != nullptr ? bias[k] : 0.f;
                if (rp != nullptr) acc[k] += f16_to_f32(rp[k]);
            }
        }
        // One switch on act for all of acc (a switch a channel held every row's temporaries live).
        dt_activate_n(acc, p.act, p.p0, p.p1);
#pragma unroll
        for (int k = 0; k < CONVG_DIRECT_K; ++k)
            if (k < p.K) dst[k] = f32_to_f16(acc[k]);
    }
}

// Each macro is the list BM,BN,BK,WARPS_M,WARPS_N,STAGES,MIN_BLOCKS
// (dualtrack.kernels.ConvGeneralSpec.variant picks one per launch).
typedef mma::Swizzled<CONVG_F16_MAIN> Main;
typedef mma::Swizzled<CONVG_F16_NARROW> Narrow;  // K <= 32 output channels
typedef mma::Swizzled<CONVG_F16_WIDE> Wide;      // K >= 128 and enough pixels to fill the GPU
typedef mma::Swizzled<CONVG_F16_SMALL> Small;    // too few Main tiles to fill the GPU
typedef mma::Swizzled<CONVG_F16_GATHER> Gather;  // C % 8 != 0: the pipelined scalar path

}  // namespace convg

// ws, splits: split-K (the tile entries only; every other entry is launched with null and 1): with
// splits > 1, gridDim.z = groups * splits and split s of group g writes its fp32 sums (no bias,
// residual or activation) to ws + (s * M + m) * (groups * K) + g * K + k; conv_nhwc_f16_splitk
// then finishes y. bias, res and y are not read or written by such a launch.
#define CONVG_PARAMS(T)                                                                                     \
    const T *__restrict__ x, const T *__restrict__ w, const float *__restrict__ bias,                      \
        const T *__restrict__ res, T *__restrict__ y, float *__restrict__ ws, int N, int H, int W, int C, int K, \
        int P, int Q, int R, int S, int sh, int sw, int pt, int pl, int dh, int dw, int ldx, int ldy, int ldr,  \
        int act, float p0, float p1, int splits

#define CONVG_PROBLEM                                                                                          \
    convg::Problem {                                                                                           \
        N, H, W, C, K, P, Q, R, S, sh, sw, pt, pl, dh, dw, ldx, ldy, ldr, act, p0, p1, splits, N * P * Q, R * S * C \
    }

#define CONVG_F16_ENTRY(NAME, CF, GATHER)                                                     \
    extern "C" __global__ void __launch_bounds__(CF::THREADS, CF::MIN_BLOCKS) NAME(CONVG_PARAMS(f16)) { \
        __shared__ __align__(16) unsigned char smem[convg::Smem<CF>::BYTES];                  \
        const convg::Problem p = CONVG_PROBLEM;                                               \
        const convg::Layer l = convg::layer_of(p);                                            \
        const convg::GroupOffsets o = convg::group_offsets(p, l);                             \
        const int ldp = l.groups * K;                                                         \
        float* part = ws != nullptr ? ws + static_cast<long long>(l.split) * p.M * ldp + o.k : nullptr; \
        convg::conv_f16<CF, GATHER>(x + o.x, w + o.w, part ? nullptr : convg::shifted(bias, o.k),      \
                                    convg::shifted(res, o.k), y + o.k, part, ldp, l.split, p, smem);    \
    }

CONVG_F16_ENTRY(conv_nhwc_f16, convg::Main, false)
CONVG_F16_ENTRY(conv_nhwc_f16_narrow, convg::Narrow, false)
CONVG_F16_ENTRY(conv_nhwc_f16_wide, convg::Wide, false)
CONVG_F16_ENTRY(conv_nhwc_f16_small, convg::Small, false)
CONVG_F16_ENTRY(conv_nhwc_f16_gather, convg::Gather, true)

// C <= 8 input channels, group 1 (the RGB stems): the input patch staged once in shared memory,
// A fragments built from it through a per-k offset table (conv_stem.cuh). Each macro is the list
// TP,BN,MIN_BLOCKS (output rows and channels a block); dynamic shared memory sized per launch.
#include "conv_stem.cuh"

#define CONVG_STEM_ENTRY(NAME, TL)                                                                      \
    extern "C" __global__ void __launch_bounds__(TL::THREADS, TL::MIN_BLOCKS) NAME(CONVG_PARAMS(f16)) { \
        extern __shared__ __align__(16) unsigned char stem_smem[];                                      \
        const convg::Problem p = CONVG_PROBLEM;                                                         \
        stem::conv<TL>(x, w, bias, res, y, p, stem_smem);                                               \
    }

namespace stem {
typedef Tile<CONVG_STEM> Main;
typedef Tile<CONVG_STEM_NARROW> Narrow;  // K <= 32, or filters too long for Main's shared memory
}  // namespace stem

CONVG_STEM_ENTRY(conv_nhwc_f16_stem, stem::Main)
CONVG_STEM_ENTRY(conv_nhwc_f16_stem_narrow, stem::Narrow)

// At least 1536 threads an SM (6 blocks of 256): the 40 registers it took before dt_activate had
// every activation's formula (ptxas spills nothing at that bound).
extern "C" __global__ void __launch_bounds__(CONVG_DIRECT_THREADS, 1536 / CONVG_DIRECT_THREADS) conv_nhwc_f16_direct(CONVG_PARAMS(f16)) {
    __shared__ __align__(16) float wsh[CONVG_DIRECT_W];
    const convg::Problem p = CONVG_PROBLEM;
    const convg::GroupOffsets o = convg::group_offsets(p, convg::layer_of(p));
    convg::conv_direct(x + o.x, w + o.w, convg::shifted(bias, o.k), convg::shifted(res, o.k), y + o.k, p, wsh);
}

// ------------------------------------------------------------------------------------------------
// Split-K's second launch: y[m, k] = act(sum_s ws[s, m, k] + bias[k] + res[m, k]) over M pixels and
// K channels (every group's: the tile entries' ldp), the slices added in split order so the sum is
// the same on every run. A thread an output element, consecutive threads on consecutive channels.
// ------------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(CONVG_SPLITK_THREADS) conv_nhwc_f16_splitk(
    const float* __restrict__ ws, const float* __restrict__ bias, const f16* __restrict__ res, f16* __restrict__ y,
    int M, int K, int splits, int ldy, int ldr, int act, float p0, float p1) {
    const long long plane = static_cast<long long>(M) * K;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < plane; e += step) {
        const long long m = e / K;
        const int k = static_cast<int>(e - m * K);
        const float* src = ws + e;
        float v = 0.f;
        int s = 0;
        // Eight loads in flight, then their sum in split order.
        for (; s + 8 <= splits; s += 8) {
            float t[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) t[i] = src[(s + i) * plane];
#pragma unroll
            for (int i = 0; i < 8; ++i) v += t[i];
        }
        for (; s < splits; ++s) v += src[s * plane];
        if (bias != nullptr) v += bias[k];
        if (res != nullptr) v += f16_to_f32(res[m * ldr + k]);
        y[m * ldy + k] = f32_to_f16(dt_activate(v, act, p0, p1));
    }
}

// ------------------------------------------------------------------------------------------------
// fp32: CUDA cores, register-tiled SIMT GEMM over the scalar path's flattened taps, k-major shared
// tiles, register-staged double buffer. fp32 models are the exception on Track A, so this entry
// is written for correctness on every shape rather than for speed.
// ------------------------------------------------------------------------------------------------

namespace convg32 {

typedef simt::Tiles<CONVG_F32_BM, CONVG_F32_BN, CONVG_F32_BK, CONVG_F32_TM, CONVG_F32_TN> T;
static_assert(T::SMEM_BYTES + 3 * T::BM * 4 <= 48 * 1024, "static shared memory is capped at 48 KiB");

// k-tile kt = flattened taps [kt*BK, kt*BK + BK), element by element (simt::store_tile's scalar
// mapping: element i of a thread is row threadIdx.x / BK + i * (THREADS / BK), column threadIdx.x % BK).
__device__ __forceinline__ void load(const float* x, const float* w, const convg::Problem& p, const int* row_h,
                                     const int* row_w, const int* row_pix, simt::Stage<T>& st, int kt, int n0) {
    const int kg = kt * T::BK + threadIdx.x % T::BK;
    const convg::Tap t = convg::tap_of(p, kg);
#pragma unroll
    for (int i = 0; i < T::A_SCA; ++i) {
        const int row = threadIdx.x / T::BK + i * (T::THREADS / T::BK);
        st.a[i] = convg::gather(x, p, row_h[row], row_w[row], row_pix[row], t);
    }
#pragma unroll
    for (int i = 0; i < T::B_SCA; ++i) {
        const int k = n0 + threadIdx.x / T::BK + i * (T::THREADS / T::BK);
        st.b[i] = (t.ok && k < p.K) ? w[static_cast<long long>(k) * p.Kg + kg] : 0.f;
    }
}

}  // namespace convg32

extern "C" __global__ void __launch_bounds__(convg32::T::THREADS) conv_nhwc_f32(CONVG_PARAMS(float)) {
    using convg32::T;
    __shared__ __align__(16) float As[2 * T::BK * T::BMP];
    __shared__ __align__(16) float Bs[2 * T::BK * T::BNP];
    __shared__ int row_h[T::BM], row_w[T::BM], row_pix[T::BM];
    const convg::Problem p = CONVG_PROBLEM;
    const convg::GroupOffsets go = convg::group_offsets(p, convg::layer_of(p));
    x += go.x;
    w += go.w;
    bias = convg::shifted(bias, go.k);
    res = convg::shifted(res, go.k);
    y += go.k;
    const int m0 = blockIdx.x * T::BM;
    const int n0 = blockIdx.y * T::BN;
    const int tm0 = T::tm0();  // this thread's pixels: m0+tm0 .. +TM-1
    const int tn0 = T::tn0();  // this thread's channels: n0+tn0 .. +TN-1
    for (int i = threadIdx.x; i < T::BM; i += T::THREADS) {
        const convg::Origin o = convg::origin(p, m0 + i);
        row_h[i] = o.h;
        row_w[i] = o.w;
        row_pix[i] = o.pix;
    }
    __syncthreads();

    float acc[T::TM][T::TN];
    const auto load = [&](simt::Stage<T>& st, int kt) { convg32::load(x, w, p, row_h, row_w, row_pix, st, kt, n0); };
    simt::mainloop<T, false>(load, (p.Kg + T::BK - 1) / T::BK, As, Bs, acc);

#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + tm0 + i;
        if (m >= p.M) break;
#pragma unroll
        for (int j = 0; j < T::TN; ++j) {
            const int k = n0 + tn0 + j;
            if (k >= p.K) break;
            float v = acc[i][j] + (bias != nullptr ? bias[k] : 0.f);
            if (res != nullptr) v += res[static_cast<long long>(m) * p.ldr + k];
            y[static_cast<long long>(m) * p.ldy + k] = dt_activate(v, p.act, p.p0, p.p1);
        }
    }
}
