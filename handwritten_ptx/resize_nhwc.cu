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
// A thread per work item (grid-stride): one output element, or 8 neighbouring channels of an output
// pixel on the fp16 vector path (16-byte accesses), channel fastest (coalesced); the taps of
// neighbouring output pixels overlap in L1. No shared memory.
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

// The source taps of output pixel (ho, wo), the same for every channel of the pixel: nearest: the
// pixel (h0, w0); linear: rows h0, h1 and columns w0, w1 with the weights th, tw of h1 and w1.
struct Taps {
    int h0, h1, w0, w1;
    float th, tw;
};

__device__ __forceinline__ Taps taps(int ho, int wo, int H, int W, int Ho, int Wo, int mode, int coord, int nearest,
                                     float sh, float sw) {
    const float vh = source_coord(ho, H, Ho, sh, coord), vw = source_coord(wo, W, Wo, sw, coord);
    Taps t;
    if (mode == 0) {
        t.h0 = t.h1 = nearest_index(vh, H, nearest);
        t.w0 = t.w1 = nearest_index(vw, W, nearest);
        t.th = t.tw = 0.0f;
    } else {
        linear_taps(vh, H, t.h0, t.h1, t.th);
        linear_taps(vw, W, t.w0, t.w1, t.tw);
    }
    return t;
}

// One work item: `lanes` neighbouring channels from channel c of output pixel p (image n). The
// scalar path (lanes 1) for either dtype; the fp16 vector path (8 lanes: 16-byte loads and store,
// element for element the same fp32 math and rounding).
template <typename T>
__device__ __forceinline__ void resize_item(const T* __restrict__ img, T* __restrict__ dst, const Taps& t, int W,
                                            int ldx, int mode) {
    const long long r0 = static_cast<long long>(t.h0) * W, r1 = static_cast<long long>(t.h1) * W;
    if (mode == 0) {
        *dst = img[(r0 + t.w0) * ldx];
        return;
    }
    const float a = load_f32(img + (r0 + t.w0) * ldx), b = load_f32(img + (r0 + t.w1) * ldx);
    const float d = load_f32(img + (r1 + t.w0) * ldx), e = load_f32(img + (r1 + t.w1) * ldx);
    const float top = a + t.tw * (b - a), bottom = d + t.tw * (e - d);
    store_f32(dst, top + t.th * (bottom - top));
}

__device__ __forceinline__ void resize_item_x8(const f16* __restrict__ img, f16* __restrict__ dst, const Taps& t,
                                               int W, int ldx, int mode) {
    const long long r0 = static_cast<long long>(t.h0) * W, r1 = static_cast<long long>(t.h1) * W;
    if (mode == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(img + (r0 + t.w0) * ldx);
        return;
    }
    float a[8], b[8], d[8], e[8], v[8];
    load_f16x8(a, img + (r0 + t.w0) * ldx);
    load_f16x8(b, img + (r0 + t.w1) * ldx);
    load_f16x8(d, img + (r1 + t.w0) * ldx);
    load_f16x8(e, img + (r1 + t.w1) * ldx);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float top = a[j] + t.tw * (b[j] - a[j]), bottom = d[j] + t.tw * (e[j] - d[j]);
        v[j] = top + t.th * (bottom - top);
    }
    store_f16x8(dst, v);
}

// Grid-stride over work items of `lanes` channels (channel fastest, then w, h, n); the launcher
// sizes the grid for the path the device most likely takes (dualtrack.kernels.streaming).
template <typename T, int LANES>
__device__ __forceinline__ void resize(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int Ho,
                                       int Wo, int ldx, int ldy, int mode, int coord, int nearest, float sh,
                                       float sw) {
    const int CL = C / LANES;
    const long long total = static_cast<long long>(N) * Ho * Wo * CL;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, Ho, Wo, CL);
        const int c = o.c * LANES;
        const T* img = x + o.n * H * W * static_cast<long long>(ldx) + c;
        const Taps t = taps(o.h, o.w, H, W, Ho, Wo, mode, coord, nearest, sh, sw);
        T* dst = y + o.p * ldy + c;
        if constexpr (LANES == 8) {
            resize_item_x8(img, dst, t, W, ldx, mode);
        } else {
            resize_item(img, dst, t, W, ldx, mode);
        }
    }
}

extern "C" __global__ void __launch_bounds__(RESIZE_THREADS)
resize_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx,
                int ldy, int mode, int coord, int nearest, float sh, float sw) {
    // The vector path needs C, ldx, ldy multiples of 8 and 16-byte aligned x and y (uniform over the launch).
    if (C % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) && aligned16(y)) {
        resize<f16, 8>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, mode, coord, nearest, sh, sw);
        return;
    }
    resize<f16, 1>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, mode, coord, nearest, sh, sw);
}

extern "C" __global__ void __launch_bounds__(RESIZE_THREADS)
resize_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo,
                int ldx, int ldy, int mode, int coord, int nearest, float sh, float sw) {
    resize<float, 1>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, mode, coord, nearest, sh, sw);
}
