// fp16 NHWC -> e4m3 (OCP float8 e4m3fn) NHWC, the activation side of FP8 Track A (issue 42):
//
//   xq[n,h,w,c] = satfinite(round_to_nearest_even(x[n,h,w,c] * inv_scale))
//
// x: fp16 with pixel stride ldx (a channel slice of a wider buffer); xq: one byte an element,
// dense (pixel stride C), so the conv_fp8 entries' TMA rows are C bytes. The product is one fp32
// rounding, then cvt.rn.satfinite.e4m3x2.f32: |v| > 448 (inf included) gives +-448, NaN stays NaN
// (0x7f), as the spec's numpy reference (clip to +-448, then ml_dtypes' float8_e4m3fn cast).
//
// Work items: 8 channels of one pixel (16-byte load, 8-byte store) where C and ldx are multiples
// of 8 and the pointers aligned (16 and 8 bytes), else one element; a grid-stride loop, so any
// grid is correct. sm_89+ (the e4m3 conversion): built for compute_90a only, as conv_fp8.
// No toolkit #include (see conv3x3_nhwc.cu). The block size comes from dualtrack.kernels.

#if !defined(QUANTIZE_FP8_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `make ptx`"
#endif

#include "dualtrack_device.cuh"

// Two fp32 values as two e4m3 bytes: lo in bits 0-7, hi in bits 8-15 (cvt puts its first
// source operand in the upper byte).
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ bool quantize_vec8(const f16* x, const unsigned char* y, int C, int ldx) {
    return C % 8 == 0 && ldx % 8 == 0 && aligned16(x) && (reinterpret_cast<unsigned long long>(y) & 7ull) == 0;
}

extern "C" __global__ void __launch_bounds__(QUANTIZE_FP8_THREADS)
quantize_fp8_f16(const f16* __restrict__ x, unsigned char* __restrict__ y, int N, int H, int W, int C, int ldx,
                 float inv_scale) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (quantize_vec8(x, y, C, ldx)) {
        const int C8 = C / 8;
        const long long total = static_cast<long long>(N) * H * W * C8;
        for (long long idx = first; idx < total; idx += step) {
            const NhwcIndex e = nhwc_index(idx, H, W, C8);  // 32-bit division where the index fits
            const long long p = e.p;
            const int c = e.c * 8;
            float v[8];
            load_f16x8(v, x + p * ldx + c);
            unsigned w[2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                w[i] = e4m3x2(v[4 * i] * inv_scale, v[4 * i + 1] * inv_scale) |
                       (e4m3x2(v[4 * i + 2] * inv_scale, v[4 * i + 3] * inv_scale) << 16);
            *reinterpret_cast<uint2*>(y + p * C + c) = make_uint2(w[0], w[1]);
        }
        return;
    }
    const long long total = static_cast<long long>(N) * H * W * C;
    for (long long idx = first; idx < total; idx += step) {
        const NhwcIndex e = nhwc_index(idx, H, W, C);
        const long long p = e.p;
        const int c = e.c;
        y[p * C + c] = static_cast<unsigned char>(e4m3x2(f16_to_f32(x[p * ldx + c]) * inv_scale, 0.f) & 0xffu);
    }
}
