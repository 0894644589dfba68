// ONNX Resize over H and W (mode nearest or linear), NHWC: (N, H, W, C) -> (N, Ho, Wo, C).
//
// Per output coordinate o of an axis of input length L and output length Lo, with the scale s that
// ONNX divides by (the `scales` input, or Lo / L when the export gave `sizes`), in fp32 as
// onnxruntime computes it, the source coordinate (coord, dualtrack.plan.RESIZE_COORDS) is
//   0 half_pixel          (o + 0.5) / s - 0.5
//   1 pytorch_half_pixel  Lo > 1 ? (o + 0.5) / s - 0.5 : 0
//   2 align_corners       Lo > 1 ? o * (L - 1) / (Lo - 1) : 0
//   3 asymmetric          o / s
// mode 1 (linear): clamped to [0, L-1], the two neighbours floor and floor+1 (clamped) weighted by
// the fraction, rows then columns (bilinear). mode 0 (nearest): rounded by `nearest`
// (RESIZE_NEAREST: floor, ceil, round_prefer_floor, round_prefer_ceil) and clamped to [0, L-1].
// fp32 math, one rounding to the output dtype (a copy for nearest).
//
// One thread per output element, channel fastest (coalesced); the four taps of neighbouring
// output pixels overlap in L1. No shared memory.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(RESIZE_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

__device__ __forceinline__ float source_coord(int o, int L, int Lo, float s, int coord) {
    const float of = static_cast<float>(o);
    switch (coord) {
        case 0: return (of + 0.5f) / s - 0.5f;
        case 1: return Lo > 1 ? (of + 0.5f) / s - 0.5f : 0.0f;
        case 2: return Lo > 1 ? of * static_cast<float>(L - 1) / static_cast<float>(Lo - 1) : 0.0f;
        default: return of / s;
    }
}

__device__ __forceinline__ int nearest_index(float v, int L, int nearest) {
    float r;
    switch (nearest) {
        case 0: r = floorf(v); break;
        case 1: r = ceilf(v); break;
        case 2: r = v == floorf(v) + 0.5f ? floorf(v) : rintf(v); break;  // ties down
        default: r = v == floorf(v) + 0.5f ? ceilf(v) : rintf(v); break;  // ties up
    }
    const int i = static_cast<int>(r);
    return i < 0 ? 0 : (i > L - 1 ? L - 1 : i);
}

// Linear taps of one axis: i0, i1 and the weight of i1.
__device__ __forceinline__ void linear_taps(float v, int L, int& i0, int& i1, float& t) {
    v = v < 0.0f ? 0.0f : (v > static_cast<float>(L - 1) ? static_cast<float>(L - 1) : v);
    i0 = static_cast<int>(v);
    i1 = i0 + 1 < L ? i0 + 1 : L - 1;
    t = v - static_cast<float>(i0);
}

template <typename T>
__device__ __forceinline__ void resize(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int Ho,
                                       int Wo, int ldx, int ldy, int mode, int coord, int nearest, float sh,
                                       float sw) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<long long>(N) * Ho * Wo * C) return;
    const NhwcIndex o = nhwc_index(idx, Ho, Wo, C);
    const int c = o.c, ho = o.h, wo = o.w;
    const long long n = o.n, p = o.p;  // image, output pixel
    const T* img = x + n * H * W * static_cast<long long>(ldx) + c;
    const float vh = source_coord(ho, H, Ho, sh, coord), vw = source_coord(wo, W, Wo, sw, coord);
    T* dst = y + p * ldy + c;
    if (mode == 0) {
        const int h = nearest_index(vh, H, nearest), w = nearest_index(vw, W, nearest);
        *dst = img[(static_cast<long long>(h) * W + w) * ldx];
        return;
    }
    int h0, h1, w0, w1;
    float th, tw;
    linear_taps(vh, H, h0, h1, th);
    linear_taps(vw, W, w0, w1, tw);
    const long long r0 = static_cast<long long>(h0) * W, r1 = static_cast<long long>(h1) * W;
    const float a = load_f32(img + (r0 + w0) * ldx), b = load_f32(img + (r0 + w1) * ldx);
    const float d = load_f32(img + (r1 + w0) * ldx), e = load_f32(img + (r1 + w1) * ldx);
    const float top = a + tw * (b - a), bottom = d + tw * (e - d);
    store_f32(dst, top + th * (bottom - top));
}

#define RESIZE_PARAMS(T)                                                                                    \
    (const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy,   \
     int mode, int coord, int nearest, float sh, float sw)
DUALTRACK_F16_F32_ENTRIES(resize_nhwc, RESIZE_THREADS, RESIZE_PARAMS, resize,
                          (x, y, N, H, W, C, Ho, Wo, ldx, ldy, mode, coord, nearest, sh, sw))
