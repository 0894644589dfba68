// Fused attention (flash-attention style: one pass over the key/value tiles, fp32 online softmax).
//
//   s[b,h,i,j] = scale * sum_c q[b,h,i,c] * k[b,h,j,c] + bias[b % bmod, h, i, j]     (bias optional)
//   o[b,h,i,c] = sum_j softmax_j(s[b,h,i,:]) * v[b,h,j,c]
//
// b < B (batch; Swin's windows are batches too), h < Hd heads, i < Lq queries, j < Lk keys, c < D, the
// head dim (one entry per D: attention_f16_d16/_d32/_d64/_d128). Every tensor is reached through four
// element strides (batch, head, row, dim) from its pointer, so the exporters' Transposes and Reshapes
// between token layouts ((N, L, heads*d), an NHWC image's pixels) and head layouts fold into the
// indexing: element (b,h,i,c) of q is q[b*qb + h*qh + i*qi + c*qc]. The bias is fp16 or fp32
// (bias_f32), broadcast wherever a stride is 0; bmod folds a batch of windows onto the bias's
// (window-pattern) batch: row b reads bias batch b % bmod. A null bias adds nothing.
//
// Numerics: q.k and p.v on tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulators); scores,
// the running max m and sum l per row in fp32; p = exp(s - m) rounded to fp16 for the p.v product
// (as flash attention does), the sum l taken over the fp32 p; one division by l and one rounding
// at the end. A row whose scores are all -inf gives NaN, as onnxruntime's Softmax does.
//
// Geometry: a block per (b*Hd + h, tile of TILE queries), TILE/16 warps, a warp per 16 query rows.
// K and V tiles of TILE rows are staged in shared memory (rows padded by 8 halves: conflict-free
// fragment reads), the query tile once through the K buffer into registers. Rows past Lq and Lk
// are zero-filled; keys past Lk get score -inf; rows past Lq are not written. Loads take 16 bytes
// where the tile's rows allow it (dim stride 1, row stride a multiple of 8, 16-byte aligned rows),
// else element by element; stores are element by element (any output strides).
//
// No toolkit #include: see conv3x3_nhwc.cu. The tile size comes from dualtrack.kernels (-D).

#if !defined(ATTN_TILE)
#error "tile sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

namespace attn {

// Enumerators, not namespace-scope constexpr variables: NVRTC would emit those as .global data.
enum : int { TILE = ATTN_TILE, THREADS = ATTN_TILE / 16 * 32 };
#define ATTN_LOG2E 1.4426950408889634f

static_assert(TILE % 16 == 0 && TILE >= 16 && TILE <= 128, "ATTN_TILE: a multiple of 16 up to 128");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xFF800000u); }

__device__ __forceinline__ float exp2_approx(float x) {  // ex2(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return static_cast<unsigned>(f32_to_f16(lo)) | (static_cast<unsigned>(f32_to_f16(hi)) << 16);
}

__device__ __forceinline__ unsigned lds32(const f16* p) { return *reinterpret_cast<const unsigned*>(p); }

// Rows row0 .. row0+TILE-1 (those below rows; the rest zero) of D halves each, element (r, c) at
// base[r*sr + c*sc], into dst (row stride D+8 halves). Every thread of the block takes part.
template <int D>
__device__ __forceinline__ void load_tile(f16* dst, const f16* base, int row0, int rows, int sr, int sc) {
    constexpr int LDS = D + 8;
    const bool vec = sc == 1 && sr % 8 == 0 && aligned16(base);  // the same for every thread: no divergence
    if (vec) {
        constexpr int CHUNKS = D / 8;
        for (int idx = threadIdx.x; idx < TILE * CHUNKS; idx += THREADS) {
            const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
            uint4 u = make_uint4(0u, 0u, 0u, 0u);
            if (row0 + r < rows) u = *reinterpret_cast<const uint4*>(base + static_cast<long long>(row0 + r) * sr + c);
            *reinterpret_cast<uint4*>(dst + r * LDS + c) = u;
        }
    } else {
        for (int idx = threadIdx.x; idx < TILE * D; idx += THREADS) {
            const int r = idx / D, c = idx % D;
            f16 e = 0;
            if (row0 + r < rows) e = base[static_cast<long long>(row0 + r) * sr + static_cast<long long>(c) * sc];
            dst[r * LDS + c] = e;
        }
    }
}

struct Args {
    const f16 *q, *k, *v;
    const void* bias;
    f16* o;
    int B, Hd, Lq, Lk;
    int qb, qh, qi, qc, kb, kh, ki, kc, vb, vh, vi, vc, ob, oh, oi, oc;
    int bb, bh, bi, bj, bmod, bias_f32;
    float scale;
};

__device__ __forceinline__ float bias_at(const Args& a, long long off) {
    return a.bias_f32 ? static_cast<const float*>(a.bias)[off] : f16_to_f32(static_cast<const f16*>(a.bias)[off]);
}

// The scores of one K tile for this warp's 16 rows (s[n]: keys j0 + 8n .. 8n+7, accumulator layout),
// scaled, biased and masked (keys past Lk: -inf).
template <int D>
__device__ __forceinline__ void scores(float (&s)[TILE / 8][4], const unsigned (&qf)[D / 16][4], const f16* ks,
                                       const Args& a, long long bias0, int row, int j0) {
    constexpr int LDS = D + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < TILE / 8; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const f16* kr = ks + (n * 8 + g) * LDS + kk * 16 + 2 * t;  // B[c][j] = k[j][c]: key j's row
            mma_16816(s[n], qf[kk], lds32(kr), lds32(kr + 8));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = row + g + (e >> 1) * 8, j = j0 + n * 8 + 2 * t + (e & 1);
            float x = s[n][e] * a.scale;
            if (a.bias != nullptr && i < a.Lq && j < a.Lk)
                x += bias_at(a, bias0 + static_cast<long long>(i) * a.bi + static_cast<long long>(j) * a.bj);
            s[n][e] = j < a.Lk ? x : neg_inf();
        }
    }
}

// The online softmax step of one tile for this thread's two rows (r = 0: row g, 1: row g+8): the new
// running max, the accumulators rescaled by exp(m_old - m_new), s turned into p = exp(s - m_new).
template <int D>
__device__ __forceinline__ void online_softmax(float (&s)[TILE / 8][4], float (&acc)[D / 8][4], float (&m)[2],
                                               float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        // The four threads of a quad hold one row's columns.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        const float base = m_new == neg_inf() ? 0.0f : m_new;  // all -inf so far: p = 0, not NaN, until a finite score
        const float alpha = exp2_approx((m[r] - base) * ATTN_LOG2E);
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[n][e] = exp2_approx((s[n][e] - base) * ATTN_LOG2E);
                sum += s[n][e];
            }
        }
        l[r] = l[r] * alpha + sum;  // this thread's columns only; the quad's partial sums are added at the end
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            acc[dn][2 * r] *= alpha;
            acc[dn][2 * r + 1] *= alpha;
        }
        m[r] = m_new;
    }
}

// Four 8x8 fp16 matrices, each thread's fragment transposed: with row r of each matrix a row of a
// row-major (k, n) tile in shared memory, register m holds the mma B fragment (k = 2t, 2t+1; n = g)
// of matrix m.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// acc += p . v of one tile: p (fp16) from the score accumulators (keys 16kt .. 16kt+15 are score tiles
// 2kt and 2kt+1: the accumulator layout of two n8 tiles is the A layout of one k16 step); V's B
// fragments of two n8 tiles by one ldmatrix.trans: lanes 0-7 give the rows of keys 0-7, lanes 8-15
// keys 8-15, at columns dn*8; lanes 16-31 the same at dn*8 + 8 (rows 16-byte aligned: LDS % 8 == 0).
template <int D>
__device__ __forceinline__ void accumulate_pv(float (&acc)[D / 8][4], const float (&s)[TILE / 8][4], const f16* vs) {
    constexpr int LDS = D + 8;
    static_assert(D % 16 == 0 && LDS % 8 == 0, "ldmatrix rows: 16-byte aligned, two n8 tiles a step");
    const int lane = threadIdx.x & 31;
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
#pragma unroll
    for (int kt = 0; kt < TILE / 16; ++kt) {
        const unsigned a[4] = {
            pack_f16x2(s[2 * kt][0], s[2 * kt][1]), pack_f16x2(s[2 * kt][2], s[2 * kt][3]),
            pack_f16x2(s[2 * kt + 1][0], s[2 * kt + 1][1]), pack_f16x2(s[2 * kt + 1][2], s[2 * kt + 1][3]),
        };
        const f16* v0 = vs + (kt * 16 + lrow) * LDS + lcol;
#pragma unroll
        for (int dn = 0; dn < D / 8; dn += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, smem_u32(v0 + dn * 8));
            mma_16816(acc[dn], a, b[0], b[1]);
            mma_16816(acc[dn + 1], a, b[2], b[3]);
        }
    }
}

template <int D>
__device__ __forceinline__ void attention(const Args& a) {
    static_assert(D % 16 == 0 && D <= 128, "head dim: a multiple of 16 up to 128");
    constexpr int LDS = D + 8;
    __shared__ __align__(16) f16 ks[TILE * LDS];
    __shared__ __align__(16) f16 vs[TILE * LDS];
    const int b = blockIdx.x / a.Hd, h = blockIdx.x % a.Hd;
    const int i0 = blockIdx.y * TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row = i0 + warp * 16;  // this warp's first query row

    const f16* qp = a.q + static_cast<long long>(b) * a.qb + static_cast<long long>(h) * a.qh;
    const f16* kp = a.k + static_cast<long long>(b) * a.kb + static_cast<long long>(h) * a.kh;
    const f16* vp = a.v + static_cast<long long>(b) * a.vb + static_cast<long long>(h) * a.vh;
    const long long bias0 = static_cast<long long>(b % a.bmod) * a.bb + static_cast<long long>(h) * a.bh;

    load_tile<D>(ks, qp, i0, a.Lq, a.qi, a.qc);  // the query tile, staged through the K buffer
    __syncthreads();
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const f16* q0 = ks + (warp * 16 + g) * LDS + kk * 16 + 2 * t;
        qf[kk][0] = lds32(q0);
        qf[kk][1] = lds32(q0 + 8 * LDS);
        qf[kk][2] = lds32(q0 + 8);
        qf[kk][3] = lds32(q0 + 8 * LDS + 8);
    }
    __syncthreads();

    float acc[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
    for (int j0 = 0; j0 < a.Lk; j0 += TILE) {
        load_tile<D>(ks, kp, j0, a.Lk, a.ki, a.kc);
        load_tile<D>(vs, vp, j0, a.Lk, a.vi, a.vc);
        __syncthreads();
        float s[TILE / 8][4];
        scores<D>(s, qf, ks, a, bias0, row, j0);
        online_softmax<D>(s, acc, m, l);
        accumulate_pv<D>(acc, s, vs);
        __syncthreads();  // the tiles are overwritten next
    }

    f16* op = a.o + static_cast<long long>(b) * a.ob + static_cast<long long>(h) * a.oh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.0f / sum;  // 0 when every score is -inf: 0 * inf = NaN, onnxruntime's answer
        const int i = row + g + r * 8;
        if (i >= a.Lq) continue;
        f16* orow = op + static_cast<long long>(i) * a.oi;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = dn * 8 + 2 * t + e;
                orow[static_cast<long long>(c) * a.oc] = f32_to_f16(acc[dn][2 * r + e] * inv);
            }
        }
    }
}

}  // namespace attn

// The ABI (handwritten_ptx/README.md): pointers, then int32s, then the fp32 scale.
#define ATTN_ENTRY(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(attn::THREADS) attention_f16_d##D(                            \
        const f16* q, const f16* k, const f16* v, const void* bias, f16* o, int B, int Hd, int Lq, int Lk,     \
        int qb, int qh, int qi, int qc, int kb, int kh, int ki, int kc, int vb, int vh, int vi, int vc, int ob, \
        int oh, int oi, int oc, int bb, int bh, int bi, int bj, int bmod, int bias_f32, float scale) {         \
        const attn::Args a = {q,  k,  v,  bias, o,  B,  Hd, Lq, Lk, qb, qh, qi, qc, kb,   kh,       ki,   kc, \
                              vb, vh, vi, vc,   ob, oh, oi, oc, bb, bh, bi, bj, bmod, bias_f32, scale};        \
        attn::attention<D>(a);                                                                                 \
    }

ATTN_ENTRY(16)
ATTN_ENTRY(32)
ATTN_ENTRY(64)
ATTN_ENTRY(128)
