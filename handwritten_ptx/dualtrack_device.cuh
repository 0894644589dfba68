// Device helpers the Track A kernels share (handwritten_ptx/*.cu include it). NVRTC gets this
// header in memory from dualtrack.ptx (nvrtcCreateProgram's headers), so builds need no toolkit
// headers, and its content is part of the PTX cache key. Only what is used is emitted: a helper
// here costs a kernel that does not call it nothing.

#pragma once

typedef unsigned short f16;  // raw IEEE binary16 bits

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

// One k-tile of a register-tiled SIMT GEMM (the fp32 kernels): acc[i][j] += A[k][tm0+i] * B[k][tn0+j]
// for k < BK, from k-major shared tiles with row pitches BMP and BNP floats (16-byte reads).
template <int BK, int TM, int TN, int BMP, int BNP>
__device__ __forceinline__ void simt_ktile(const float* A, const float* B, float (&acc)[TM][TN], int tm0, int tn0) {
#pragma unroll
    for (int k = 0; k < BK; ++k) {
        float a[TM], b[TN];
#pragma unroll
        for (int i = 0; i < TM; i += 4) {
            const float4 v = lds128(A + k * BMP + tm0 + i);
            a[i] = v.x;
            a[i + 1] = v.y;
            a[i + 2] = v.z;
            a[i + 3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < TN; j += 4) {
            const float4 v = lds128(B + k * BNP + tn0 + j);
            b[j] = v.x;
            b[j + 1] = v.y;
            b[j + 2] = v.z;
            b[j + 3] = v.w;
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
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

// The activation codes of dualtrack.plan.ACTIVATIONS; p0, p1 are the activation's parameters
// (Clip: min, max; HardSigmoid: alpha, beta). NaN propagates through every one of them, as numpy's.
enum Act { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 2, ACT_HARDSIGMOID = 3, ACT_HARDSWISH = 4, ACT_SIGMOID = 5 };

__device__ __forceinline__ float clamp_nan(float v, float lo, float hi) {
    // fminf/fmaxf would turn NaN into a bound; the comparisons below keep it.
    return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ float apply_act(float v, int act, float p0, float p1) {
    switch (act) {
        case ACT_RELU: return v < 0.0f ? 0.0f : v;
        case ACT_CLIP: return clamp_nan(v, p0, p1);
        case ACT_HARDSIGMOID: return clamp_nan(fmaf(p0, v, p1), 0.0f, 1.0f);
        case ACT_HARDSWISH: return v * clamp_nan(fmaf(v, 1.0f / 6.0f, 0.5f), 0.0f, 1.0f);
        case ACT_SIGMOID: return 1.0f / (1.0f + expf(-v));
        default: return v;
    }
}

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
