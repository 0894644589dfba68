// ONNX Pad over H and W of an NHWC tensor (mode constant, reflect or edge), which is also Track A's
// copy: with zero pads it copies a channel slice of one tensor into a channel slice of another (a
// Slice / Split along channels that cannot be a view, a Concat input computed on the other track).
//   y[n, ho, wo, c] = x[n, src(ho - pt, H), src(wo - pl, W), c]          c < C
// where src(i, L) on an axis of length L is i inside [0, L), else by mode (plan.PAD_MODES):
//   0 constant: no source, y = value (rounded once to the dtype)
//   1 reflect:  -i before the start, 2(L-1) - i past the end (the edge is not repeated; the host
//               checks every pad < L, as ONNX requires)
//   2 edge:     clamped to [0, L-1]
// The output size Ho x Wo (= H + pt + pb, W + pl + pr) is the caller's; the bottom/right pads only
// set it. x and y point at their slices' first channels, with channel strides ldx and ldy; values
// are copied bit for bit (no arithmetic), so fp16 NaN payloads and -0 survive.
//
// A thread per work item (grid-stride): one output element, or 8 neighbouring channels of an output
// pixel on the fp16 vector path (16-byte loads and stores), channel fastest (coalesced).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(PAD_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// The source coordinate of (shifted) output coordinate i on an axis of length L, or -1 where a
// constant pad writes the value.
__device__ __forceinline__ int pad_source(int i, int L, int mode) {
    if (i >= 0 && i < L) return i;
    if (mode == 0) return -1;
    if (mode == 1) return i < 0 ? -i : 2 * (L - 1) - i;
    return i < 0 ? 0 : L - 1;
}

// Work items of LANES channels (channel fastest, then wo, ho, n) in a grid-stride loop; the host's
// grid (dualtrack.kernels.pad) only sets how many items a thread takes.
template <typename T, int LANES>
__device__ __forceinline__ void pad(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int Ho,
                                    int Wo, int ldx, int ldy, int pt, int pl, int mode, float value) {
    const int CL = C / LANES;
    const long long total = static_cast<long long>(N) * Ho * Wo * CL;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, Ho, Wo, CL);
        const int c = o.c * LANES;
        const int sh = pad_source(o.h - pt, H, mode), sw = pad_source(o.w - pl, W, mode);
        T* dst = y + o.p * ldy + c;
        if (sh < 0 || sw < 0) {
            if constexpr (LANES == 8) {
                const unsigned h = f32_to_f16(value), pair = h | (h << 16);
                *reinterpret_cast<uint4*>(dst) = make_uint4(pair, pair, pair, pair);
            } else {
                store_f32(dst, value);
            }
            continue;
        }
        const T* src = x + ((o.n * H + sh) * W + sw) * ldx + c;
        if constexpr (LANES == 8) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            *dst = *src;
        }
    }
}

extern "C" __global__ void __launch_bounds__(PAD_THREADS)
pad_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx,
             int ldy, int pt, int pl, int mode, float value) {
    // The vector path needs C, ldx, ldy multiples of 8 and 16-byte aligned x and y (uniform over the launch).
    if (C % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) && aligned16(y)) {
        pad<f16, 8>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, pt, pl, mode, value);
        return;
    }
    pad<f16, 1>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, pt, pl, mode, value);
}

extern "C" __global__ void __launch_bounds__(PAD_THREADS)
pad_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int C, int Ho, int Wo, int ldx,
             int ldy, int pt, int pl, int mode, float value) {
    pad<float, 1>(x, y, N, H, W, C, Ho, Wo, ldx, ldy, pt, pl, mode, value);
}
