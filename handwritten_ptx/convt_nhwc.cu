// Transposed 2-D convolution (ONNX ConvTranspose) of any kernel R x S, strides sh/sw, dilations
// dh/dw, padding and output padding, and G groups, NHWC, in gather form, with a fused epilogue:
//
//   y[n,oh,ow,g*K+k] = act(bias[g*K+k] + res[n,oh,ow,g*K+k]
//                          + sum_{r,s,c} x[n,ih,iw,g*C+c] * w[g,r,s,c,k])
//   over the taps with oh = ih*sh - pt + r*dh and ow = iw*sw - pl + s*dw,
//
// i.e. tap r reaches output row oh from input row ih = (oh + pt - r*dh) / sh where that division is
// exact and 0 <= ih < H (columns alike). C and K are the channels of one group; the caller passes
// the output size P x Q, so the end padding and output_padding are implied. Taps are gathered, not
// scattered: every output element is written once, by one thread, with no atomics, and the sum is
// fp32 with one rounding; bias (fp32 or null), residual (null: none; its own channel stride ldr)
// and act/p0/p1 (dt_activate, dualtrack_activations.cuh) are applied in that order.
//
// Weights are packed (G, R, S, C, K) from ONNX's (G*C, K, R, S) (dualtrack.kernels.convt), so the
// K output channels of one (tap, input channel) are contiguous. A work item is one output pixel and
// 8 consecutive output channels of one group (channel blocks fastest): a warp's lanes read one x
// value each (the same pixel's, broadcast, where K spans 256 channels) and 8 neighbouring weights
// each (coalesced); the fp16 vector path reads 16-byte chunks (K, ldy, ldr multiples of 8 and w, y,
// res 16-byte aligned) and, where C, ldx and x allow, 8 input channels at a time.
// CUDA cores: the ConvTransposes this takes (any but the 2x2/2 one convt2x2 runs on tensor cores)
// are decoder upsamplers, a small share of a network's FLOPs.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(CONVTG_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

namespace convtg {

struct Problem {
    int N, H, W, C, K, G, P, Q, R, S, sh, sw, pt, pl, dh, dw, ldx, ldy, ldr, act;
    float p0, p1;
};

enum : int { V = 8 };  // output channels a work item

// acc[j] += sum_c x[c] * w[c*K + j] for j < nk, the C input channels of one tap.
template <typename T, bool VEC>
__device__ __forceinline__ void tap(float (&acc)[V], const T* xp, const T* wp, int C, int K, int nk, bool vec_x) {
    if constexpr (VEC) {  // fp16, nk == 8, rows 16-byte aligned
        int c = 0;
        if (vec_x) {
            for (; c < C; c += 8) {
                float xv[8];
                load_f16x8(xv, xp + c);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float wv[V];
                    load_f16x8(wv, wp + static_cast<long long>(c + i) * K);
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[j] = fmaf(xv[i], wv[j], acc[j]);
                }
            }
        }
        for (; c < C; ++c) {
            const float xv = load_f32(xp + c);
            float wv[V];
            load_f16x8(wv, wp + static_cast<long long>(c) * K);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = fmaf(xv, wv[j], acc[j]);
        }
    } else {
        for (int c = 0; c < C; ++c) {
            const float xv = load_f32(xp + c);
            const T* row = wp + static_cast<long long>(c) * K;
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (j < nk) acc[j] = fmaf(xv, load_f32(row + j), acc[j]);
        }
    }
}

template <typename T, bool VEC>
__device__ __forceinline__ void convt(const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias,
                                      const T* __restrict__ res, T* __restrict__ y, const Problem& p) {
    const int KB = (p.K + V - 1) / V;  // channel blocks of a group
    const int CB = p.G * KB;
    const bool vec_x = VEC && p.C % 8 == 0 && p.ldx % 8 == 0 && aligned16(x);
    const long long total = static_cast<long long>(p.N) * p.P * p.Q * CB;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, p.P, p.Q, CB);
        const int g = o.c / KB;
        const int k0 = (o.c - g * KB) * V;
        const int nk = p.K - k0 < V ? p.K - k0 : V;
        const T* xg = x + static_cast<long long>(g) * p.C;
        const T* wg = w + static_cast<long long>(g) * p.R * p.S * p.C * p.K + k0;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.f;
        for (int r = 0; r < p.R; ++r) {
            const int th = o.h + p.pt - r * p.dh;
            if (th < 0) break;  // th falls as r grows: no later tap reaches this row
            const int ih = th / p.sh;
            if (ih * p.sh != th || ih >= p.H) continue;
            for (int s = 0; s < p.S; ++s) {
                const int tw = o.w + p.pl - s * p.dw;
                if (tw < 0) break;
                const int iw = tw / p.sw;
                if (iw * p.sw != tw || iw >= p.W) continue;
                const T* xp = xg + ((o.n * p.H + ih) * p.W + iw) * static_cast<long long>(p.ldx);
                const T* wp = wg + static_cast<long long>(r * p.S + s) * p.C * p.K;
                tap<T, VEC>(acc, xp, wp, p.C, p.K, nk, vec_x);
            }
        }
        const int kk = g * p.K + k0;  // the first channel in the full tensors
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (j < nk && bias != nullptr) acc[j] += bias[kk + j];
        if (res != nullptr) {
            const T* rp = res + o.p * p.ldr + kk;
            if constexpr (VEC) {
                float rv[V];
                load_f16x8(rv, rp);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] += rv[j];
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j)
                    if (j < nk) acc[j] += load_f32(rp + j);
            }
        }
        dt_activate_n(acc, p.act, p.p0, p.p1);
        T* dst = y + o.p * p.ldy + kk;
        if constexpr (VEC) {
            store_f16x8(dst, acc);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (j < nk) store_f32(dst + j, acc[j]);
        }
    }
}

// Whether the fp16 vector path applies (uniform over the launch, so no divergence).
__device__ __forceinline__ bool vec8(const f16* w, const f16* res, const f16* y, const Problem& p) {
    const bool r_ok = res == nullptr || (p.ldr % 8 == 0 && aligned16(res));
    return p.K % 8 == 0 && p.ldy % 8 == 0 && aligned16(w) && aligned16(y) && r_ok;
}

}  // namespace convtg

#define CONVT_PARAMS(T)                                                                                       \
    const T *__restrict__ x, const T *__restrict__ w, const float *__restrict__ bias,                        \
        const T *__restrict__ res, T *__restrict__ y, int N, int H, int W, int C, int K, int G, int P, int Q, \
        int R, int S, int sh, int sw, int pt, int pl, int dh, int dw, int ldx, int ldy, int ldr, int act, float p0, \
        float p1

#define CONVT_PROBLEM \
    convtg::Problem { N, H, W, C, K, G, P, Q, R, S, sh, sw, pt, pl, dh, dw, ldx, ldy, ldr, act, p0, p1 }

extern "C" __global__ void __launch_bounds__(CONVTG_THREADS) convt_nhwc_f16(CONVT_PARAMS(f16)) {
    const convtg::Problem p = CONVT_PROBLEM;
    if (convtg::vec8(w, res, y, p)) {
        convtg::convt<f16, true>(x, w, bias, res, y, p);
    } else {
        convtg::convt<f16, false>(x, w, bias, res, y, p);
    }
}

extern "C" __global__ void __launch_bounds__(CONVTG_THREADS) convt_nhwc_f32(CONVT_PARAMS(float)) {
    convtg::convt<float, false>(x, w, bias, res, y, CONVT_PROBLEM);
}
