// Device helpers the Track A kernels share (handwritten_ptx/*.cu include it). NVRTC gets this
// header in memory from dualtrack.ptx (nvrtcCreateProgram's headers), so builds need no toolkit
// headers, and its content is part of the PTX cache key. Only what is used is emitted: a helper
// here costs a kernel that does not call it nothing.

#pragma once

typedef unsigned short f16;  // raw IEEE binary16 bits

// The fp16 and fp32 entries of a kernel that is one template over its element type: NAME##_f16 and
// NAME##_f32, of THREADS threads a block, with the parameter list PARAMS(T) (a function-like macro
// of the element type: the ABI of handwritten_ptx/README.md), each calling BODY<T> ARGS.
#define DUALTRACK_F16_F32_ENTRIES(NAME, THREADS, PARAMS, BODY, ARGS)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_f16 PARAMS(f16) { BODY<f16> ARGS; }   \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_f32 PARAMS(float) { BODY<float> ARGS; }

__device__ __forceinline__ float f16_to_f32(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16 f32_to_f16(float f) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that zero-fills the destination when src_bytes is 0 (halo, tails).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 16-byte shared-memory load. Written in PTX because NVRTC 13.0 compiles the plain float4 read
// of the fp32 kernel's inner loop nondeterministically (it sometimes adds a redundant v2 load),
// and the checked-in PTX must be reproducible.
__device__ __forceinline__ float4 lds128(const float* p) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(smem_u32(p))
                 : "memory");
    return v;
}

// D += A(16x16, row) * B(16x8, col), fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// --- element access and the activation epilogue of the mobile kernels (dwconv, fc, eltwise, ...) ---
// One element of an fp16 or fp32 tensor as fp32, and back with one rounding (round to nearest even).
__device__ __forceinline__ float load_f32(const f16* p) { return f16_to_f32(*p); }
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ void store_f32(f16* p, float v) { *p = f32_to_f16(v); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }

// 8 fp16 elements (16 bytes, p 16-byte aligned) as fp32, and back with one rounding each: the
// vector paths of the fp16 mobile kernels, element for element the same conversions as above.
__device__ __forceinline__ void load_f16x8(float (&v)[8], const f16* p) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = f16_to_f32(static_cast<f16>(words[i] & 0xffffu));
        v[2 * i + 1] = f16_to_f32(static_cast<f16>(words[i] >> 16));
    }
}

__device__ __forceinline__ void store_f16x8(f16* p, const float (&v)[8]) {
    unsigned words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        words[i] = static_cast<unsigned>(f32_to_f16(v[2 * i])) | (static_cast<unsigned>(f32_to_f16(v[2 * i + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// Maxima that propagate NaN (max.NaN: NaN if either operand is, as numpy's max and PyTorch's max-pool),
// of one value or of a 16-byte chunk (8 fp16 in a uint4, 4 fp32 in a float4); max_of picks by type.
__device__ __forceinline__ unsigned max_f16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ f16 max_f16(f16 a, f16 b) {
    f16 d;
    asm("max.NaN.f16 %0, %1, %2;" : "=h"(d) : "h"(a), "h"(b));
    return d;
}

__device__ __forceinline__ float max_f32(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ uint4 max_f16x8(uint4 a, uint4 b) {
    return make_uint4(max_f16x2(a.x, b.x), max_f16x2(a.y, b.y), max_f16x2(a.z, b.z), max_f16x2(a.w, b.w));
}

__device__ __forceinline__ float4 max_f32x4(float4 a, float4 b) {
    return make_float4(max_f32(a.x, b.x), max_f32(a.y, b.y), max_f32(a.z, b.z), max_f32(a.w, b.w));
}

__device__ __forceinline__ f16 max_of(f16 a, f16 b) { return max_f16(a, b); }
__device__ __forceinline__ float max_of(float a, float b) { return max_f32(a, b); }
__device__ __forceinline__ uint4 max_of(uint4 a, uint4 b) { return max_f16x8(a, b); }
__device__ __forceinline__ float4 max_of(float4 a, float4 b) { return max_f32x4(a, b); }

// V neighbouring elements as fp32 and back, for a kernel written once for its scalar path (V = 1,
// either dtype) and its vector paths: fp16 V = 8 (16 bytes), and for channel counts that are not a
// multiple of 8, fp16 V = 4, 2 (8, 4 bytes); fp32 V = 4, 2 (16, 8 bytes). p is aligned to the
// vector's size; the same conversions and one rounding per element as the scalar path.
template <typename T>
__device__ __forceinline__ void load_f32s(float (&v)[1], const T* p) {
    v[0] = load_f32(p);
}
__device__ __forceinline__ void load_f32s(float (&v)[8], const f16* p) { load_f16x8(v, p); }
__device__ __forceinline__ void load_f32s(float (&v)[4], const f16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v[0] = f16_to_f32(static_cast<f16>(u.x & 0xffffu)), v[1] = f16_to_f32(static_cast<f16>(u.x >> 16));
    v[2] = f16_to_f32(static_cast<f16>(u.y & 0xffffu)), v[3] = f16_to_f32(static_cast<f16>(u.y >> 16));
}
__device__ __forceinline__ void load_f32s(float (&v)[2], const f16* p) {
    const unsigned u = *reinterpret_cast<const unsigned*>(p);
    v[0] = f16_to_f32(static_cast<f16>(u & 0xffffu)), v[1] = f16_to_f32(static_cast<f16>(u >> 16));
}
__device__ __forceinline__ void load_f32s(float (&v)[4], const float* p) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void load_f32s(float (&v)[2], const float* p) {
    const float2 q = *reinterpret_cast<const float2*>(p);
    v[0] = q.x, v[1] = q.y;
}
template <typename T>
__device__ __forceinline__ void store_f32s(T* p, const float (&v)[1]) {
    store_f32(p, v[0]);
}
__device__ __forceinline__ void store_f32s(f16* p, const float (&v)[8]) { store_f16x8(p, v); }
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return static_cast<unsigned>(f32_to_f16(lo)) | (static_cast<unsigned>(f32_to_f16(hi)) << 16);
}
__device__ __forceinline__ void store_f32s(f16* p, const float (&v)[4]) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]));
}
__device__ __forceinline__ void store_f32s(f16* p, const float (&v)[2]) {
    *reinterpret_cast<unsigned*>(p) = pack_f16x2(v[0], v[1]);
}
__device__ __forceinline__ void store_f32s(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_f32s(float* p, const float (&v)[2]) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
}

// V neighbouring elements copied bit for bit (NaN payloads included) in one access of
// V * sizeof(T) bytes (2 to 16), both pointers aligned to it: a gather that does no arithmetic.
template <int BYTES>
struct Bits;
template <>
struct Bits<16> {
    typedef uint4 type;
};
template <>
struct Bits<8> {
    typedef uint2 type;
};
template <>
struct Bits<4> {
    typedef unsigned type;
};
template <>
struct Bits<2> {
    typedef unsigned short type;
};
template <typename T, int V>
__device__ __forceinline__ void copy_elems(T* dst, const T* src) {
    typedef typename Bits<V * sizeof(T)>::type B;
    *reinterpret_cast<B*>(dst) = *reinterpret_cast<const B*>(src);
}

// The fused activations (dt_activate): generated from the table dualtrack.contract.activations.
#include "dualtrack_activations.cuh"

// An NHWC element of a flat index (channel fastest, then w, h, n), as the one-thread-per-element
// kernels enumerate their outputs. 64-bit division costs tens of instructions a step, so indices
// that fit 32 bits (every launch short of 2^32 elements) divide in 32 bits.
struct NhwcIndex {
    long long n, p;  // image, pixel (n*H + h)*W + w
    int h, w, c;
};

__device__ __forceinline__ NhwcIndex nhwc_index(long long idx, int H, int W, int C) {
    NhwcIndex r;
    if (idx < 0xffffffffll) {
        const unsigned i = static_cast<unsigned>(idx), p = i / static_cast<unsigned>(C);
        const unsigned hw = p / static_cast<unsigned>(W);
        r.c = static_cast<int>(i - p * static_cast<unsigned>(C));
        r.w = static_cast<int>(p - hw * static_cast<unsigned>(W));
        r.h = static_cast<int>(hw % static_cast<unsigned>(H));
        r.n = hw / static_cast<unsigned>(H);
        r.p = p;
    } else {
        r.p = idx / C;
        r.c = static_cast<int>(idx - r.p * C);
        const long long hw = r.p / W;
        r.w = static_cast<int>(r.p - hw * W);
        r.h = static_cast<int>(hw % H);
        r.n = hw / H;
    }
    return r;
}

// ------------------------------------------------------------------------------------------------
// The fp16 kernels' tensor-core tiling (conv3x3_nhwc_f16*, conv_nhwc_f16*, convt2x2_nhwc_f16): a
// BM x BN output tile per block of WARPS_M x WARPS_N warps, each warp MT x NT mma.sync m16n8k16
// tiles; BK-deep k-tiles copied in 16-byte chunks through STAGES cp.async stages; the epilogue
// stages the tile in shared memory in rows of BNP halves. How A and B lie in shared memory is the
// layout's: Swizzled (the implicit-GEMM convolutions) or a kernel's own (convt2x2's padded rows).
// ------------------------------------------------------------------------------------------------

namespace mma {

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct Tiles {
    enum : int {
        BM = BM_,
        BN = BN_,
        BK = BK_,
        WARPS_M = WARPS_M_,
        WARPS_N = WARPS_N_,
        STAGES = STAGES_,
        THREADS = 32 * WARPS_M * WARPS_N,
        WM = BM / WARPS_M,  // warp tile
        WN = BN / WARPS_N,
        MT = WM / 16,  // m16 tiles per warp
        NT = WN / 8,   // n8 tiles per warp
        CPR = BK / 8,  // 16-byte chunks per tile row
        BNP = BN + 8,  // epilogue tile row, padded by 16 bytes (conflict-free 4-byte stores)
    };
    static_assert(BM % (16 * WARPS_M) == 0 && BN % (16 * WARPS_N) == 0, "warp tile must be m16 x n16 multiples");
    static_assert(BK % 16 == 0, "BK is a multiple of the mma k (16)");
    static_assert(STAGES >= 2, "cp.async pipeline needs two stages or more");
    static_assert(THREADS % CPR == 0 && (BM * CPR) % THREADS == 0 && (BN * CPR) % THREADS == 0, "vector loads");
    static_assert(THREADS % BK == 0 && (BM * BK) % THREADS == 0 && (BN * BK) % THREADS == 0, "scalar loads");
    static_assert(THREADS % (BN / 8) == 0 && (BM * (BN / 8)) % THREADS == 0, "epilogue stores");
};

// The implicit-GEMM convolutions' layout (conv3x3_nhwc_f16*, conv_nhwc_f16*): a stage is the A
// tile (BM rows) then the B tile (BN rows), each unpadded [row][BK] halves with the 16-byte chunks
// of each row XOR-swizzled (swz), so the 8 row addresses of one ldmatrix phase hit 8 distinct bank
// groups. Registers are capped so that MIN_BLOCKS blocks fit on an SM (__launch_bounds__).
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_>
struct Swizzled : Tiles<BM_, BN_, BK_, WARPS_M_, WARPS_N_, STAGES_> {
    typedef Tiles<BM_, BN_, BK_, WARPS_M_, WARPS_N_, STAGES_> T;
    enum : int {
        A_STAGE = BM_ * BK_,  // halves
        STAGE = (BM_ + BN_) * BK_,
        A_CH = BM_ * T::CPR / T::THREADS,  // 16-byte A chunks a thread copies per k-tile
        B_CH = BN_ * T::CPR / T::THREADS,
        PIPE = STAGES_ * STAGE,  // halves
        MIN_BLOCKS = MIN_BLOCKS_,
    };
    static_assert(BK_ == 32 || BK_ == 64, "the swizzle is written for 64- and 128-byte tile rows");

    // Physical 16-byte chunk of logical chunk q in tile row `row`. 64-byte rows (BK = 32): rows
    // 2j, 2j+1 share a 128-byte line, so XOR with bits 1-2 of the row; 128-byte rows: bits 0-2.
    static __device__ __forceinline__ int swz(int row, int q) {
        return BK_ == 32 ? (q ^ ((row >> 1) & 3)) : (q ^ (row & 7));
    }
    static __device__ __forceinline__ int at(int row, int q) { return row * BK_ + swz(row, q) * 8; }  // halves
};

// A warp's accumulators, MT x NT m16n8 tiles of 4 fp32 values, set to 0 before the first stage.
template <class CF>
__device__ __forceinline__ void clear(float (&acc)[CF::MT][CF::NT][4]) {
#pragma unroll
    for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < CF::NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// One stage's BK columns through the tensor cores: ldmatrix fragments, MT x NT mma per k16, into
// acc. The stage at shared address a_base holds A (BM rows) then B (BN rows, from A_STAGE halves
// on), each a [row][BK] tile whose 16-byte chunk q of row r starts CF::at(r, q) halves in.
template <class CF>
__device__ __forceinline__ void stage(unsigned a_base, float (&acc)[CF::MT][CF::NT][4], int wm, int wn, int lane) {
    const unsigned b_base = a_base + CF::A_STAGE * 2;
#pragma unroll
    for (int kk = 0; kk < CF::BK; kk += 16) {
        unsigned af[CF::MT][4];
        unsigned bf[CF::NT][2];
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) {
            // lanes 0-15 address rows 0-15 at k, lanes 16-31 the same rows at k+8: matrices
            // (rows 0-7,k) (rows 8-15,k) (rows 0-7,k+8) (rows 8-15,k+8) = the mma A fragment.
            const int row = wm * CF::WM + mt * 16 + (lane & 15);
            ldmatrix_x4(af[mt], a_base + CF::at(row, kk / 8 + (lane >> 4)) * 2);
        }
#pragma unroll
        for (int nt = 0; nt < CF::NT; nt += 2) {
            // matrices (n 0-7,k) (n 0-7,k+8) (n 8-15,k) (n 8-15,k+8) = b0,b1 of two n8 tiles.
            const int row = wn * CF::WN + nt * 8 + (lane >> 4) * 8 + (lane & 7);
            unsigned r[4];
            ldmatrix_x4(r, b_base + CF::at(row, kk / 8 + ((lane >> 3) & 1)) * 2);
            bf[nt][0] = r[0];
            bf[nt][1] = r[1];
            bf[nt + 1][0] = r[2];
            bf[nt + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < CF::NT; ++nt) mma_16816(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
}

// The epilogue's first step (after a barrier: the tile reuses the pipeline's shared memory): every
// accumulator plus bias_of(col) (col: the column in the block's tile), through act (fp32), rounded
// once to fp16 into tile, BM rows of BNP halves. bias_of is read once a column a warp.
template <class CF, class Bias, class Act>
__device__ __forceinline__ void stage_epilogue(f16* tile, const float (&acc)[CF::MT][CF::NT][4], int wm, int wn,
                                               int lane, Bias bias_of, Act act) {
#pragma unroll
    for (int nt = 0; nt < CF::NT; ++nt) {
        const int col = wn * CF::WN + nt * 8 + (lane & 3) * 2;
        const float b0 = bias_of(col);
        const float b1 = bias_of(col + 1);
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) {
            const int row = wm * CF::WM + mt * 16 + (lane >> 2);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float v0 = act(acc[mt][nt][2 * half] + b0);
                const float v1 = act(acc[mt][nt][2 * half + 1] + b1);
                const unsigned packed = static_cast<unsigned>(f32_to_f16(v0)) |
                                        (static_cast<unsigned>(f32_to_f16(v1)) << 16);
                *reinterpret_cast<unsigned*>(tile + (row + 8 * half) * CF::BNP + col) = packed;
            }
        }
    }
}

// The second step (after a barrier): the staged tile out in chunks of 8 consecutive columns, of
// output rows m0 + row < M and columns n0 + col < NC; out(m, n) is the address of column n of
// row m. A whole chunk is one 16-byte store where vec allows it (the caller's alignment and
// strides), element stores elsewhere.
template <class CF, class Out>
__device__ __forceinline__ void store_epilogue(const f16* tile, int m0, int n0, int M, int NC, bool vec, Out out) {
    constexpr int OCPR = CF::BN / 8;
#pragma unroll
    for (int i = 0; i < CF::BM * OCPR / CF::THREADS; ++i) {
        const int row = threadIdx.x / OCPR + i * (CF::THREADS / OCPR);
        const int q8 = (threadIdx.x % OCPR) * 8;
        const int m = m0 + row;
        const int n = n0 + q8;
        if (m >= M || n >= NC) continue;
        const f16* src = tile + row * CF::BNP + q8;
        if (vec && n + 8 <= NC) {
            *reinterpret_cast<uint4*>(out(m, n)) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < 8 && n + e < NC; ++e) *out(m, n + e) = src[e];
        }
    }
}

}  // namespace mma

// ------------------------------------------------------------------------------------------------
// The fp32 kernels' GEMM (conv3x3_nhwc_f32, convt2x2_nhwc_f32, conv_nhwc_f32): CUDA cores, register-tiled SIMT,
// k-major shared tiles, register-staged double buffer. A block computes BM x BN outputs, a thread
// TM x TN of them; k-tiles are BK deep. A kernel brings only how one k-tile is read from global
// memory (its `load`, into a Stage) and its epilogue.
// ------------------------------------------------------------------------------------------------

namespace simt {

// The compile-time sizes as enumerators (namespace-scope constexpr variables become .global
// symbols in the PTX).
template <int BM_, int BN_, int BK_, int TM_, int TN_>
struct Tiles {
    enum : int {
        BM = BM_,
        BN = BN_,
        BK = BK_,
        TM = TM_,  // outputs per thread along pixels
        TN = TN_,  // outputs per thread along channels
        THREADS = (BM / TM) * (BN / TN),
        // k-major tiles (As[k][m]) so a thread's TM pixels and TN channels are float4 reads; rows
        // padded by 4 floats, which keeps 16-byte alignment and halves the bank conflicts of the
        // transposing stores.
        BMP = BM + 4,
        BNP = BN + 4,
        CPR = BK / 4,                // float4 chunks per tile row (vector path)
        A_VEC = BM * CPR / THREADS,  // chunks per thread
        B_VEC = BN * CPR / THREADS,
        A_SCA = BM * BK / THREADS,  // elements per thread (scalar path)
        B_SCA = BN * BK / THREADS,
        SMEM_BYTES = 2 * BK * (BMP + BNP) * 4,  // the two buffers of As and Bs
    };
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0, "float4 fragments");
    static_assert(THREADS % CPR == 0 && (BM * CPR) % THREADS == 0 && (BN * CPR) % THREADS == 0, "vector loads");
    static_assert(THREADS % BK == 0 && (BM * BK) % THREADS == 0 && (BN * BK) % THREADS == 0, "scalar loads");

    // This thread's outputs within the block's tile: rows tm0() .. +TM-1, columns tn0() .. +TN-1.
    static __device__ __forceinline__ int tm0() { return (threadIdx.x / (BN / TN)) * TM; }
    static __device__ __forceinline__ int tn0() { return (threadIdx.x % (BN / TN)) * TN; }
};

// Staging registers: one k-tile of A and B on its way from global to shared memory. The vector
// path fills a[4*i .. 4*i+3] with chunk i, the scalar path a[i] with element i.
template <class T>
struct Stage {
    float a[T::A_SCA > 4 * T::A_VEC ? T::A_SCA : 4 * T::A_VEC];
    float b[T::B_SCA > 4 * T::B_VEC ? T::B_SCA : 4 * T::B_VEC];
};

// dst[at .. at+3] = v: a float4 into a register array (staged tile, fragments).
template <int N>
__device__ __forceinline__ void put4(float (&dst)[N], int at, const float4 v) {
    dst[at] = v.x;
    dst[at + 1] = v.y;
    dst[at + 2] = v.z;
    dst[at + 3] = v.w;
}

// Transposing store of the staged tile into As[k][m], Bs[k][n] (the element mapping of the loads:
// vector chunk i of a thread is row threadIdx.x / CPR + i * (THREADS / CPR), channels
// (threadIdx.x % CPR) * 4 ..; scalar element i is row threadIdx.x / BK + i * (THREADS / BK),
// column threadIdx.x % BK).
template <class T, bool VEC>
__device__ __forceinline__ void store_tile(const Stage<T>& st, float* As, float* Bs) {
    if constexpr (VEC) {
        const int c4 = (threadIdx.x % T::CPR) * 4;
#pragma unroll
        for (int i = 0; i < T::A_VEC; ++i) {
            const int row = threadIdx.x / T::CPR + i * (T::THREADS / T::CPR);
#pragma unroll
            for (int e = 0; e < 4; ++e) As[(c4 + e) * T::BMP + row] = st.a[4 * i + e];
        }
#pragma unroll
        for (int i = 0; i < T::B_VEC; ++i) {
            const int row = threadIdx.x / T::CPR + i * (T::THREADS / T::CPR);
#pragma unroll
            for (int e = 0; e < 4; ++e) Bs[(c4 + e) * T::BNP + row] = st.b[4 * i + e];
        }
    } else {
        const int j = threadIdx.x % T::BK;
#pragma unroll
        for (int i = 0; i < T::A_SCA; ++i) As[j * T::BMP + threadIdx.x / T::BK + i * (T::THREADS / T::BK)] = st.a[i];
#pragma unroll
        for (int i = 0; i < T::B_SCA; ++i) Bs[j * T::BNP + threadIdx.x / T::BK + i * (T::THREADS / T::BK)] = st.b[i];
    }
}

// acc = A * B over num_kt k-tiles, for this thread's outputs (Tiles::tm0, tn0); `load(st, kt)`
// reads k-tile kt into the staging registers (VEC: float4 chunks, else elements), As and Bs hold
// two k-tiles each.
template <class T, bool VEC, class Load>
__device__ __forceinline__ void mainloop(const Load& load, int num_kt, float* As, float* Bs,
                                         float (&acc)[T::TM][T::TN]) {
    const int tm0 = T::tm0(), tn0 = T::tn0();
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j) acc[i][j] = 0.f;
    Stage<T> st;
    load(st, 0);
    store_tile<T, VEC>(st, As, Bs);
    __syncthreads();
    for (int kt = 0; kt < num_kt; ++kt) {
        const int buf = kt & 1;
        const bool more = kt + 1 < num_kt;
        // The next tile's global loads are in flight while this tile is multiplied.
        if (more) load(st, kt + 1);
        const float* A = As + buf * T::BK * T::BMP;
        const float* B = Bs + buf * T::BK * T::BNP;
#pragma unroll
        for (int k = 0; k < T::BK; ++k) {
            float a[T::TM], b[T::TN];
#pragma unroll
            for (int i = 0; i < T::TM; i += 4) put4(a, i, lds128(A + k * T::BMP + tm0 + i));
#pragma unroll
            for (int j = 0; j < T::TN; j += 4) put4(b, j, lds128(B + k * T::BNP + tn0 + j));
#pragma unroll
            for (int i = 0; i < T::TM; ++i)
#pragma unroll
                for (int j = 0; j < T::TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // The other buffer was last read in iteration kt-1, which every thread has left (barrier
        // at its end), so it can be overwritten without a second barrier.
        if (more) store_tile<T, VEC>(st, As + (buf ^ 1) * T::BK * T::BMP, Bs + (buf ^ 1) * T::BK * T::BNP);
        __syncthreads();
    }
}

}  // namespace simt
