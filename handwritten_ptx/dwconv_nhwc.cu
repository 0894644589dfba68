// Depthwise convolution (ONNX Conv with group == C == K, weights (C, 1, R, R)), NHWC, bias and an
// activation fused:
//   y[n,ho,wo,c] = act(bias[c] + sum_{r,s} x[n, ho*S - pt + r*D, wo*S - pl + s*D, c] * w[r,s,c])
// for R = 3 or 5, any stride S >= 1, dilation D >= 1 and top/left padding pt, pl (taps outside the
// image read 0; the output size Ho x Wo comes from the caller, so bottom/right padding is implied).
// act, p0, p1: dt_activate (dualtrack_activations.cuh, generated from dualtrack.contract.activations).
//
// Memory-bound (R*R FMAs per output element): work items are output pixel x channel, channel
// fastest, so a warp reads neighbouring channels of one tap (coalesced) and the R*R taps of
// neighbouring output pixels overlap in L1. fp16 with C and the strides multiples of 8 (and
// 16-byte aligned pointers) takes 8 channels an item (16-byte loads and stores); else one. Weights are packed RSC (w[(r*R + s)*C + c], the
// activation dtype) so they coalesce the same way; bias fp32 or null; fp32 accumulation, one
// rounding. The tap loops are unrolled for each R.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(DWCONV_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// Every element (pixel, channel) is one work item, or with V = 8 (the fp16 vector path) every 8
// neighbouring channels of one output pixel, so each tap is one 16-byte load of x and one of w and
// the result one 16-byte store (needs C, ldx, ldy multiples of 8 and x, w, y 16-byte aligned:
// dwconv_vec8). Per channel the same fmaf chain either way (bias first, taps in r, s order), so the
// two paths give bit-identical results. A grid-stride loop covers the items, so any grid is correct
// and the host's grid only sets how many items a thread takes (dualtrack.kernels.dwconv sizes it
// for the vector path when C and the strides allow it).
template <typename T, int R, int V>
__device__ __forceinline__ void dwconv(const T* __restrict__ x, const T* __restrict__ w,
                                       const float* __restrict__ bias, T* __restrict__ y, int N, int H, int W,
                                       int C, int Ho, int Wo, int ldx, int ldy, int S, int D, int pt, int pl,
                                       int act, float p0, float p1) {
    const int CV = C / V;
    const long long total = static_cast<long long>(N) * Ho * Wo * CV;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, Ho, Wo, CV);
        const int c = o.c * V, ho = o.h, wo = o.w;
        const long long n = o.n, p = o.p;  // image, output pixel

        const int h0 = ho * S - pt, w0 = wo * S - pl;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = bias != nullptr ? bias[c + j] : 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int h = h0 + r * D;
            if (h < 0 || h >= H) continue;
            const T* row = x + ((n * H + h) * W) * static_cast<long long>(ldx) + c;
#pragma unroll
            for (int s = 0; s < R; ++s) {
                const int wi = w0 + s * D;
                if (wi < 0 || wi >= W) continue;
                float xv[V], wv[V];
                load_f32s(xv, row + static_cast<long long>(wi) * ldx);
                load_f32s(wv, w + (r * R + s) * C + c);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = fmaf(xv[j], wv[j], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = dt_activate(acc[j], act, p0, p1);
        store_f32s(y + p * ldy + c, acc);
    }
}

// Whether the fp16 vector path applies (uniform over the launch, so no divergence).
__device__ __forceinline__ bool dwconv_vec8(const f16* x, const f16* w, const f16* y, int C, int ldx, int ldy) {
    return C % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
}

template <typename T>
__device__ __forceinline__ void dwconv_any(const T* __restrict__ x, const T* __restrict__ w,
                                           const float* __restrict__ bias, T* __restrict__ y, int N, int H, int W,
                                           int C, int Ho, int Wo, int ldx, int ldy, int R, int S, int D, int pt,
                                           int pl, int act, float p0, float p1) {
    if (R == 3) dwconv<T, 3, 1>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, S, D, pt, pl, act, p0, p1);
    if (R == 5) dwconv<T, 5, 1>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, S, D, pt, pl, act, p0, p1);
}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS)
dwconv_nhwc_f16(const f16* __restrict__ x, const f16* __restrict__ w, const float* __restrict__ bias,
                f16* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy, int R, int S,
                int D, int pt, int pl, int act, float p0, float p1) {
    if (dwconv_vec8(x, w, y, C, ldx, ldy)) {
        if (R == 3) dwconv<f16, 3, 8>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, S, D, pt, pl, act, p0, p1);
        if (R == 5) dwconv<f16, 5, 8>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, S, D, pt, pl, act, p0, p1);
        return;
    }
    dwconv_any<f16>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, R, S, D, pt, pl, act, p0, p1);
}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS)
dwconv_nhwc_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                float* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy, int R, int S,
                int D, int pt, int pl, int act, float p0, float p1) {
    dwconv_any<float>(x, w, bias, y, N, H, W, C, Ho, Wo, ldx, ldy, R, S, D, pt, pl, act, p0, p1);
}
