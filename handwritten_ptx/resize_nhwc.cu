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
// fp32 math, one rounding to the output dtype (a copy for nearest). An identity (Ho = H, Wo = W, and
// sh = sw = 1 or align_corners: every source coordinate is the output's own, exactly) is a copy in
// either mode, as onnxruntime's Resize makes it: bit for bit, where the blend would spread an inf
// or NaN neighbour through its weight of 0 (ResizeMode.identity).
//
// The work is arranged so that no element pays for index or coordinate math, which is what made a
// thread per element instruction-bound (divisions and two fp32 source coordinates per 16 bytes):
// - a block owns a strip of output columns (the output width split into gridDim.x strips) and
//   walks the output rows blockIdx.y, blockIdx.y + gridDim.y, ... (of N * Ho);
// - the taps of the strip's columns (source columns and weight: they depend on the column alone)
//   are computed once per block into shared memory as byte offsets, RESIZE_COLUMNS columns a pass;
//   the row's taps once per row (uniform over the block);
// - the threads then walk the row's work items, one output pixel x V channels each, channel group
//   fastest (coalesced stores; the lanes of a pixel read the same taps, a shared-memory broadcast),
//   stepping through (pixel, group) by additions only. V is the widest vector that C, ldx, ldy and
//   both pointers allow (uniform over the launch): fp16 8, 4, 2 or 1 elements (16 to 2 bytes), fp32
//   4, 2 or 1. The 4 taps of neighbouring output pixels overlap and are served by L1.
// Any grid is correct (the strips and the row loop follow gridDim); dualtrack.kernels.resize sizes
// it so that a block has a few work items a thread.
// No toolkit #include: see conv3x3_nhwc.cu. Block size and strip pass come from dualtrack.kernels.

#if !defined(RESIZE_THREADS) || !defined(RESIZE_COLUMNS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// Blocks an SM should hold (the register cap of __launch_bounds__): 4 x 256 threads keep enough
// 16-byte loads in flight; the fp16 8-channel item needs ~70 registers uncapped (3 blocks).
#define RESIZE_MIN_BLOCKS (1024 / RESIZE_THREADS > 0 ? 1024 / RESIZE_THREADS : 1)

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

// The taps of output coordinate o on one axis: nearest: i0 = i1, the source index (t 0); linear:
// the neighbours i0, i1 and t, the weight of i1.
struct Taps {
    int i0, i1;
    float t;
};

template <bool LINEAR>
__device__ __forceinline__ Taps axis_taps(int o, int L, int Lo, float s, int coord, int nearest) {
    float v = source_coord(o, L, Lo, s, coord);
    Taps t;
    if constexpr (!LINEAR) {
        t.i0 = t.i1 = nearest_index(v, L, nearest);
        t.t = 0.0f;
    } else {
        v = v < 0.0f ? 0.0f : (v > static_cast<float>(L - 1) ? static_cast<float>(L - 1) : v);
        t.i0 = static_cast<int>(v);
        t.i1 = t.i0 + 1 < L ? t.i0 + 1 : L - 1;
        t.t = v - static_cast<float>(t.i0);
    }
    return t;
}

// One output column of the strip as the items read it: the byte offsets of its two source columns
// within a source row (i0 * ldx, i1 * ldx elements) and of its pixel within the output row, and the
// weight of i1. Offsets rather than indices: an item then adds, where it would multiply 64-bit.
struct Column {
    long long x0, x1, y;
    float t;
};

template <typename T>
__device__ __forceinline__ const T* at(const T* p, long long bytes) {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p) + bytes);
}
template <typename T>
__device__ __forceinline__ T* at(T* p, long long bytes) {
    return reinterpret_cast<T*>(reinterpret_cast<char*>(p) + bytes);
}

// One work item: V channels of an output pixel. r0, r1: the item's channels in source rows h0, h1
// (column 0); dst: in the output row (column 0 of the pass); th the weight of row h1.
template <typename T, int V, bool LINEAR>
__device__ __forceinline__ void resize_item(const T* r0, const T* r1, T* dst, const Column& col, float th) {
    if constexpr (!LINEAR) {
        copy_elems<T, V>(at(dst, col.y), at(r0, col.x0));
    } else {
        float a[V], b[V], d[V], e[V], v[V];
        load_f32s(a, at(r0, col.x0));
        load_f32s(b, at(r0, col.x1));
        load_f32s(d, at(r1, col.x0));
        load_f32s(e, at(r1, col.x1));
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float top = a[j] + col.t * (b[j] - a[j]), bottom = d[j] + col.t * (e[j] - d[j]);
            v[j] = top + th * (bottom - top);
        }
        store_f32s(at(dst, col.y), v);
    }
}

// The block's strip of output columns over its output rows (see the header).
template <typename T, int V, bool LINEAR>
__device__ __forceinline__ void resize_strip(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C,
                                             int Ho, int Wo, int ldx, int ldy, int coord, int nearest, float sh,
                                             float sw, Column* cols) {
    const int groups = C / V;  // work items of a pixel
    const int strip = (Wo + gridDim.x - 1) / gridDim.x;
    const int wbeg = blockIdx.x * strip, wend = min(Wo, wbeg + strip);
    // This thread's first item of a pass as (pixel, group), and the block's step in the same terms:
    // the item loop then advances by additions only.
    const int step_px = blockDim.x / groups, step_g = blockDim.x - step_px * groups;
    const int first_px = threadIdx.x / groups, first_g = threadIdx.x - first_px * groups;
    const int rows = N * Ho;  // < 2^31: the launcher checks N * Ho * Wo
    for (int w0 = wbeg; w0 < wend; w0 += RESIZE_COLUMNS) {
        const int count = min(RESIZE_COLUMNS, wend - w0);
        __syncthreads();  // the previous pass is done with the table
        for (int j = threadIdx.x; j < count; j += blockDim.x) {
            const Taps t = axis_taps<LINEAR>(w0 + j, W, Wo, sw, coord, nearest);
            const long long xpix = static_cast<long long>(ldx) * sizeof(T), ypix = static_cast<long long>(ldy) * sizeof(T);
            cols[j] = Column{t.i0 * xpix, t.i1 * xpix, j * ypix, t.t};
        }
        __syncthreads();
        for (int r = blockIdx.y; r < rows; r += gridDim.y) {
            const int n = r / Ho, ho = r - n * Ho;
            const Taps row = axis_taps<LINEAR>(ho, H, Ho, sh, coord, nearest);
            const T* x0 = x + (static_cast<long long>(n) * H + row.i0) * W * ldx;
            const T* x1 = x + (static_cast<long long>(n) * H + row.i1) * W * ldx;
            T* yr = y + (static_cast<long long>(r) * Wo + w0) * ldy;
            int px = first_px, g = first_g;
            while (px < count) {
                const int c = g * V;
                resize_item<T, V, LINEAR>(x0 + c, x1 + c, yr + c, cols[px], row.t);
                px += step_px;
                g += step_g;
                if (g >= groups) {
                    g -= groups;
                    ++px;
                }
            }
        }
    }
}

template <typename T, int V>
__device__ __forceinline__ void resize_lanes(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C,
                                             int Ho, int Wo, int ldx, int ldy, int mode, int coord, int nearest,
                                             float sh, float sw, Column* cols) {
    // An identity's source coordinates are exact integers, so nearest's floor takes the output's own.
    const bool identity = H == Ho && W == Wo && (coord == 2 || (sh == 1.0f && sw == 1.0f));
    if (mode == 0 || identity) {
        resize_strip<T, V, false>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, coord, identity ? 0 : nearest, sh, sw, cols);
    } else {
        resize_strip<T, V, true>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, coord, nearest, sh, sw, cols);
    }
}

// Whether V-element vectors fit: C, ldx, ldy multiples of V (a power of two) and x, y aligned to
// the vector's bytes.
template <typename T, int V>
__device__ __forceinline__ bool fits(const T* x, const T* y, int C, int ldx, int ldy) {
    const unsigned long long bytes = V * sizeof(T);
    return ((C | ldx | ldy) & (V - 1)) == 0 &&
           ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(y)) & (bytes - 1)) == 0;
}

#define RESIZE_PARAMS(T)                                                                                            \
    (const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy,      \
     int mode, int coord, int nearest, float sh, float sw)
#define RESIZE_ARGS x, y, N, H, W, C, Ho, Wo, ldx, ldy, mode, coord, nearest, sh, sw, cols

extern "C" __global__ void __launch_bounds__(RESIZE_THREADS, RESIZE_MIN_BLOCKS) resize_nhwc_f16 RESIZE_PARAMS(f16) {
    __shared__ Column cols[RESIZE_COLUMNS];
    if (fits<f16, 8>(x, y, C, ldx, ldy)) {
        resize_lanes<f16, 8>(RESIZE_ARGS);
    } else if (fits<f16, 4>(x, y, C, ldx, ldy)) {
        resize_lanes<f16, 4>(RESIZE_ARGS);
    } else if (fits<f16, 2>(x, y, C, ldx, ldy)) {
        resize_lanes<f16, 2>(RESIZE_ARGS);
    } else {
        resize_lanes<f16, 1>(RESIZE_ARGS);
    }
}

extern "C" __global__ void __launch_bounds__(RESIZE_THREADS, RESIZE_MIN_BLOCKS) resize_nhwc_f32 RESIZE_PARAMS(float) {
    __shared__ Column cols[RESIZE_COLUMNS];
    if (fits<float, 4>(x, y, C, ldx, ldy)) {
        resize_lanes<float, 4>(RESIZE_ARGS);
    } else if (fits<float, 2>(x, y, C, ldx, ldy)) {
        resize_lanes<float, 2>(RESIZE_ARGS);
    } else {
        resize_lanes<float, 1>(RESIZE_ARGS);
    }
}
