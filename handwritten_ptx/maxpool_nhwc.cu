// General 2-D pooling, NHWC: ONNX MaxPool (first output only) and AveragePool, by `mode`
// (dualtrack.contract.plan.POOL_MODES):
//   mode 0 (max):  y[n,ho,wo,c] = max over r < R, s < S with 0 <= h < H, 0 <= w < W of x[n,h,w,c],
//   h = ho*sh - pt + r*dh,  w = wo*sw - pl + s*dw.
//   mode 1, 2 (average): the fp32 sum over the same taps divided by a count, one rounding:
//   mode 2 (count_include_pad 0) the taps inside the image; mode 1 (count_include_pad 1) the window
//   clipped to the padded image, (min(h0 + R, H + pb) - h0) * (min(w0 + S, W + pr) - w0) with
//   h0 = ho*sh - pt, w0 = wo*sw - pl (onnxruntime's and PyTorch's rule: a ceil_mode window that
//   reaches past the bottom/right pads counts only up to them). Average pools have dilation 1
//   (the partition's check: opset 19's dilated AveragePool counts taps differently).
// Taps in the padding are skipped, so a padded value never wins (ONNX pads with -inf). The output
// size Ho x Wo is the caller's (dualtrack.kernels.maxpool.PoolGeometry: ONNX's floor or ceil rule,
// the bottom/right padding only sets it); the caller also refuses a geometry in which some window
// holds no pixel of the image, which would leave -inf here.
//
// `lanes` threads (a power of two <= 32) per output pixel and 16-byte chunk of channels (8 fp16 or 4
// fp32 values), lane fastest, then chunk, as maxpool2x2_nhwc.cu with lanes 1: the chunk is one vector
// load per tap when C, ldx, ldy and both pointers allow it, a bounds-checked scalar loop otherwise, so
// the launch geometry does not depend on alignment. The taps inside the image are found once per
// thread (no test per tap). With lanes > 1 (large windows: PSPNet's pyramid pools a 66 x 66 window
// into one pixel, which one thread would walk alone, 4356 loads in a row) lane l takes the window's
// rows r0 + l, r0 + l + lanes, ..., and the lanes' partial maxima or fp32 sums meet by warp shuffles
// (a group of lanes never straddles a warp: lanes divides 32 and the block size); lane 0 stores.
// The average's fp32 sum is then in another order than row-major (rounding differs in the last bits
// of fp32, below the one fp16 rounding of the result).
//
// NaN propagates (max.NaN), as in maxpool2x2, numpy's max and PyTorch's max_pool2d (onnxruntime's
// CPU MaxPool gives NaN or not depending on where in the window it is: dualtrack/kernels/maxpool.py).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(MAXPOOL_THREADS) || !defined(MAXPOOL_VEC_F16) || !defined(MAXPOOL_VEC_F32)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(MAXPOOL_VEC_F16 * 2 == 16 && MAXPOOL_VEC_F32 * 4 == 16, "one thread per 16-byte chunk of channels");

#include "dualtrack_device.cuh"

// V neighbouring elements (one 16-byte chunk) as fp32 and back: the average's vector path.
__device__ __forceinline__ void load_chunk(float (&v)[8], const f16* p) { load_f16x8(v, p); }
__device__ __forceinline__ void load_chunk(float (&v)[4], const float* p) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void store_chunk(f16* p, const float (&v)[8]) { store_f16x8(p, v); }
__device__ __forceinline__ void store_chunk(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// -inf of each type the kernel reduces in (the identity of max; never an output, see above).
__device__ __forceinline__ void neg_inf(f16& v) { v = 0xFC00u; }
__device__ __forceinline__ void neg_inf(float& v) { v = __int_as_float(0xFF800000u); }
__device__ __forceinline__ void neg_inf(uint4& v) { v = make_uint4(0xFC00FC00u, 0xFC00FC00u, 0xFC00FC00u, 0xFC00FC00u); }
__device__ __forceinline__ void neg_inf(float4& v) {
    const float m = __int_as_float(0xFF800000u);
    v = make_float4(m, m, m, m);
}

// [lo, hi): the taps r of one axis whose coordinate o0 + r*d lies in [0, L).
__device__ __forceinline__ void taps_inside(int o0, int d, int L, int R, int& lo, int& hi) {
    lo = o0 < 0 ? (-o0 + d - 1) / d : 0;
    hi = o0 < L ? min(R, (L - o0 + d - 1) / d) : 0;
}

// The average of one chunk's window (modes 1, 2): taps [r0, r1) x [s0, s1) of rows h0 + r*dh and
// columns w0 + s*dw, summed in fp32 in row-major tap order, divided by `count` once.
template <typename T, int V>
__device__ __forceinline__ void avg_chunk(const T* __restrict__ img, T* __restrict__ dst, int W, int ldx, int h0,
                                          int w0, int dh, int dw, int r0, int r1, int s0, int s1, float count,
                                          bool vec, int n_el, int lane, int lanes, bool live) {
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.0f;
#pragma unroll 1
    for (int r = r0 + lane; r < r1; r += lanes) {
        const T* row = img + static_cast<long long>(h0 + r * dh) * W * ldx;
        if (vec) {
#pragma unroll 3
            for (int s = s0; s < s1; ++s) {
                float v[V];
                load_chunk(v, row + static_cast<long long>(w0 + s * dw) * ldx);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += v[e];
            }
        } else {
#pragma unroll 1
            for (int s = s0; s < s1; ++s) {
                const T* px = row + static_cast<long long>(w0 + s * dw) * ldx;
#pragma unroll
                for (int e = 0; e < V; ++e)
                    if (e < n_el) acc[e] += load_f32(px + e);
            }
        }
    }
#pragma unroll 1
    for (int m = lanes >> 1; m > 0; m >>= 1)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], m);
    if (!live || lane != 0) return;
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = acc[e] / count;
    if (vec) {
        store_chunk(dst, acc);
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e)
            if (e < n_el) store_f32(dst + e, acc[e]);
    }
}

// The partial maximum of lane ^ m (a whole warp calls these: see lanes above).
__device__ __forceinline__ f16 shfl_xor(f16 v, int m) {
    return static_cast<f16>(__shfl_xor_sync(0xffffffffu, static_cast<unsigned>(v), m));
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ uint4 shfl_xor(uint4 v, int m) {
    return make_uint4(__shfl_xor_sync(0xffffffffu, v.x, m), __shfl_xor_sync(0xffffffffu, v.y, m),
                      __shfl_xor_sync(0xffffffffu, v.z, m), __shfl_xor_sync(0xffffffffu, v.w, m));
}
__device__ __forceinline__ float4 shfl_xor(float4 v, int m) {
    return make_float4(shfl_xor(v.x, m), shfl_xor(v.y, m), shfl_xor(v.z, m), shfl_xor(v.w, m));
}

// T: element type; V: elements per 16-byte chunk; Vec: the 16-byte type.
template <typename T, int V, typename Vec>
__device__ __forceinline__ void maxpool(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C,
                                        int Ho, int Wo, int ldx, int ldy, int R, int S, int sh, int sw, int dh,
                                        int dw, int pt, int pl, int pb, int pr, int mode, int lanes) {
    const int chunks = (C + V - 1) / V;
    const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long idx = thread / lanes;
    const int lane = static_cast<int>(thread - idx * lanes);
    // A thread past the end still takes part in its warp's shuffles (lanes > 1) with no taps.
    const bool live = idx < static_cast<long long>(N) * Ho * Wo * chunks;
    if (!live && lanes == 1) return;
    // Output pixel (n, ho, wo) and channel chunk, chunk fastest: neighbouring threads read
    // neighbouring bytes of one pixel.
    const NhwcIndex o = nhwc_index(live ? idx : 0, Ho, Wo, chunks);
    const long long n = o.n;
    const int ho = o.h, wo = o.w, c = o.c * V;

    const int h0 = ho * sh - pt, w0 = wo * sw - pl;
    int r0, r1, s0, s1;
    taps_inside(h0, dh, H, R, r0, r1);
    taps_inside(w0, dw, W, S, s0, s1);
    if (!live) r1 = r0;
    const T* img = x + n * H * static_cast<long long>(W) * ldx + c;  // channel c of pixel (n, 0, 0)
    T* dst = y + o.p * ldy + c;

    const bool vec = C % V == 0 && ldx % V == 0 && ldy % V == 0 && aligned16(x) && aligned16(y);
    if (mode != 0) {
        // The count is per output pixel (the same for every channel); the partition refuses a
        // window with no tap in the image, so mode 2's count is >= 1.
        const int hi = min(h0 + R, H + pb), wi = min(w0 + S, W + pr);
        const float count = mode == 1 ? static_cast<float>((hi - h0) * (wi - w0))
                                      : static_cast<float>((r1 - r0) * (s1 - s0));
        avg_chunk<T, V>(img, dst, W, ldx, h0, w0, dh, dw, r0, r1, s0, s1, count, vec, C - c < V ? C - c : V, lane,
                        lanes, live);
        return;
    }
    if (vec) {
        Vec acc;
        neg_inf(acc);
        // Unrolled by 3 along a row: a 3-wide window's loads are in flight together, at about half
        // the registers a wider unroll takes (occupancy is what a memory-bound kernel lives on).
#pragma unroll 1
        for (int r = r0 + lane; r < r1; r += lanes) {
            const T* row = img + static_cast<long long>(h0 + r * dh) * W * ldx;
#pragma unroll 3
            for (int s = s0; s < s1; ++s)
                acc = max_of(acc, *reinterpret_cast<const Vec*>(row + static_cast<long long>(w0 + s * dw) * ldx));
        }
#pragma unroll 1
        for (int m = lanes >> 1; m > 0; m >>= 1) acc = max_of(acc, shfl_xor(acc, m));
        if (live && lane == 0) *reinterpret_cast<Vec*>(dst) = acc;
    } else {
        const int n_el = C - c < V ? C - c : V;
        T acc[V];
        for (int e = 0; e < V; ++e) neg_inf(acc[e]);
#pragma unroll 1
        for (int r = r0 + lane; r < r1; r += lanes) {
            const T* row = img + static_cast<long long>(h0 + r * dh) * W * ldx;
#pragma unroll 1
            for (int s = s0; s < s1; ++s) {
                const T* px = row + static_cast<long long>(w0 + s * dw) * ldx;
#pragma unroll
                for (int e = 0; e < V; ++e)
                    if (e < n_el) acc[e] = max_of(acc[e], px[e]);
            }
        }
#pragma unroll 1
        for (int m = lanes >> 1; m > 0; m >>= 1)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = max_of(acc[e], shfl_xor(acc[e], m));
        if (!live || lane != 0) return;
#pragma unroll
        for (int e = 0; e < V; ++e)
            if (e < n_el) dst[e] = acc[e];
    }
}

#define MAXPOOL_PARAMS(T)                                                                                        \
    const T *__restrict__ x, T *__restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy, int R, \
        int S, int sh, int sw, int dh, int dw, int pt, int pl, int pb, int pr, int mode, int lanes
#define MAXPOOL_ARGS x, y, N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, pb, pr, mode, lanes

extern "C" __global__ void __launch_bounds__(MAXPOOL_THREADS) maxpool_nhwc_f16(MAXPOOL_PARAMS(f16)) {
    maxpool<f16, MAXPOOL_VEC_F16, uint4>(MAXPOOL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MAXPOOL_THREADS) maxpool_nhwc_f32(MAXPOOL_PARAMS(float)) {
    maxpool<float, MAXPOOL_VEC_F32, float4>(MAXPOOL_ARGS);
}
