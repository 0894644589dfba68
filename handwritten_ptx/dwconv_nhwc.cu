// Depthwise convolution (ONNX Conv with group == C, K = M*C: channel multiplier M, weights
// (K, 1, R, S)), NHWC, bias and an activation fused:
//   y[n,ho,wo,k] = act(bias[k] + sum_{r,s} x[n, ho*sh - pt + r*dh, wo*sw - pl + s*dw, k / M] * w[r,s,k])
// for any R x S kernel (1..7 a side: ConvNeXt's 7x7, 1xk / kx1 factorised ones), strides sh/sw >= 1,
// dilations dh/dw >= 1 and top/left padding pt, pl (taps outside the image read 0; the output size
// Ho x Wo comes from the caller, so bottom/right padding is implied). Output channel k reads input
// channel k / M (ONNX's group k / M of one input channel). act, p0, p1: dt_activate
// (dualtrack_activations.cuh, generated from dualtrack.contract.activations).
//
// Memory-bound (R*S FMAs per output element): work items are output pixel x channel, channel
// fastest, so a warp reads neighbouring channels of one tap (coalesced) and the R*S taps of
// neighbouring output pixels overlap in L1. fp16 with M = 1, C and the strides multiples of 8 (and
// 16-byte aligned pointers) takes 8 channels an item (16-byte loads and stores); else one. Weights
// are packed RSK (w[(r*S + s)*K + k], the activation dtype) so they coalesce the same way; bias fp32
// or null; fp32 accumulation, one rounding. The tap loops are unrolled for the square 3x3 and 5x5
// kernels of MobileNets; other sizes loop (the loads, not the loop, bound this kernel).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(DWCONV_THREADS) || !defined(DW_ROW)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

struct DwProblem {
    int N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, M, act;
    float p0, p1;
};

// Every element (pixel, channel) is one work item, or with V = 8 (the fp16 vector path, M = 1) every
// 8 neighbouring channels of one output pixel, so each tap is one 16-byte load of x and one of w and
// the result one 16-byte store (needs C, ldx, ldy multiples of 8 and x, w, y 16-byte aligned:
// dwconv_vec8). Per channel the same fmaf chain either way (bias first, taps in r, s order), so the
// two paths give bit-identical results. A grid-stride loop covers the items, so any grid is correct
// and the host's grid only sets how many items a thread takes (dualtrack.kernels.dwconv sizes it
// for the vector path when C and the strides allow it). RT > 0: an RT x RT kernel, unrolled.
template <typename T, int RT, int V>
__device__ __forceinline__ void dwconv(const T* __restrict__ x, const T* __restrict__ w,
                                       const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    const int R = RT > 0 ? RT : p.R, S = RT > 0 ? RT : p.S;
    const int K = p.C * p.M;
    const int KV = K / V;
    const long long total = static_cast<long long>(p.N) * p.Ho * p.Wo * KV;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, p.Ho, p.Wo, KV);
        const int k = o.c * V, ho = o.h, wo = o.w;
        const int c = k / p.M;                  // V > 1 only with M == 1: channels k..k+V-1 of x
        const long long n = o.n, pix = o.p;    // image, output pixel

        const int h0 = ho * p.sh - p.pt, w0 = wo * p.sw - p.pl;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = bias != nullptr ? bias[k + j] : 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int h = h0 + r * p.dh;
            if (h < 0 || h >= p.H) continue;
            const T* row = x + ((n * p.H + h) * p.W) * static_cast<long long>(p.ldx) + c;
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int wi = w0 + s * p.dw;
                if (wi < 0 || wi >= p.W) continue;
                float xv[V], wv[V];
                load_f32s(xv, row + static_cast<long long>(wi) * p.ldx);
                load_f32s(wv, w + (r * S + s) * K + k);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = fmaf(xv[j], wv[j], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = dt_activate(acc[j], p.act, p.p0, p.p1);
        store_f32s(y + pix * p.ldy + k, acc);
    }
}

// Stride 1, dilation 1 along W (ConvNeXt's 7x7, MobileNet's 3x3 and 5x5): a work item is DW_ROW
// neighbouring output pixels of one row, so the S + DW_ROW - 1 input pixels of a kernel row are loaded
// once for all of them and each weight once a row, instead of every tap of every output loading both
// (the loads, not the FMAs, bounded the per-pixel path). Per output the same fmaf chain as dwconv
// (bias first, taps in r, s order, out-of-image taps skipped): bit-identical results. The host's grid
// (dualtrack.kernels.dwconv) counts items of DW_ROW pixels where this path runs.
template <typename T, int RT, int V>
__device__ __forceinline__ void dwconv_rows(const T* __restrict__ x, const T* __restrict__ w,
                                            const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    constexpr int B = DW_ROW, S = RT, TAPS = RT + DW_ROW - 1;
    const int K = p.C, KV = K / V, WB = (p.Wo + B - 1) / B;
    const long long total = static_cast<long long>(p.N) * p.Ho * WB * KV;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, p.Ho, WB, KV);
        const int k = o.c * V, ho = o.h, wo0 = o.w * B;
        const long long n = o.n;
        const int h0 = ho * p.sh - p.pt, w0 = wo0 - p.pl;
        float acc[B][V];
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int j = 0; j < V; ++j) acc[b][j] = bias != nullptr ? bias[k + j] : 0.0f;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            const int h = h0 + r * p.dh;
            if (h < 0 || h >= p.H) continue;
            const T* row = x + ((n * p.H + h) * p.W) * static_cast<long long>(p.ldx) + k;
            float wv[S][V];
#pragma unroll
            for (int s = 0; s < S; ++s) load_f32s(wv[s], w + (r * S + s) * K + k);
#pragma unroll
            for (int i = 0; i < TAPS; ++i) {
                const int wi = w0 + i;
                if (wi < 0 || wi >= p.W) continue;
                float xv[V];
                load_f32s(xv, row + static_cast<long long>(wi) * p.ldx);
                // Input pixel i is tap s = i - b of output b: ascending s for each output, as dwconv.
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const int s = i - b;
                    if (s < 0 || s >= S) continue;
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[b][j] = fmaf(xv[j], wv[s][j], acc[b][j]);
                }
            }
        }
        const long long pix = (n * p.Ho + ho) * static_cast<long long>(p.Wo) + wo0;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (wo0 + b >= p.Wo) break;
#pragma unroll
            for (int j = 0; j < V; ++j) acc[b][j] = dt_activate(acc[b][j], p.act, p.p0, p.p1);
            store_f32s(y + (pix + b) * p.ldy + k, acc[b]);
        }
    }
}

// Whether the fp16 vector path applies (uniform over the launch, so no divergence).
__device__ __forceinline__ bool dwconv_vec8(const f16* x, const f16* w, const f16* y, const DwProblem& p) {
    return p.M == 1 && p.C % 8 == 0 && p.ldx % 8 == 0 && p.ldy % 8 == 0 && aligned16(x) && aligned16(w) &&
           aligned16(y);
}

// Whether dwconv_rows takes the launch: a square 3, 5 or 7 kernel, stride and dilation 1 along W, no
// channel multiplier (dualtrack.kernels.dwconv's `row_path` says the same for the grid).
__device__ __forceinline__ bool dwconv_row_path(const DwProblem& p) {
    return p.M == 1 && p.R == p.S && (p.R == 3 || p.R == 5 || p.R == 7) && p.sw == 1 && p.dw == 1;
}

template <typename T, int V>
__device__ __forceinline__ void dwconv_any(const T* __restrict__ x, const T* __restrict__ w,
                                           const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    const bool square = p.R == p.S;
    if (dwconv_row_path(p)) {
        if (p.R == 3) {
            dwconv_rows<T, 3, V>(x, w, bias, y, p);
        } else if (p.R == 5) {
            dwconv_rows<T, 5, V>(x, w, bias, y, p);
        } else {
            dwconv_rows<T, 7, V>(x, w, bias, y, p);
        }
    } else if (square && p.R == 3) {
        dwconv<T, 3, V>(x, w, bias, y, p);
    } else if (square && p.R == 5) {
        dwconv<T, 5, V>(x, w, bias, y, p);
    } else {
        dwconv<T, 0, V>(x, w, bias, y, p);
    }
}

#define DWCONV_PARAMS(T)                                                                                    \
    const T *__restrict__ x, const T *__restrict__ w, const float *__restrict__ bias, T *__restrict__ y,   \
        int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy, int R, int S, int sh, int sw, int dh, \
        int dw, int pt, int pl, int M, int act, float p0, float p1

#define DWCONV_PROBLEM DwProblem{N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, M, act, p0, p1}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS) dwconv_nhwc_f16(DWCONV_PARAMS(f16)) {
    const DwProblem p = DWCONV_PROBLEM;
    if (dwconv_vec8(x, w, y, p)) {
        dwconv_any<f16, 8>(x, w, bias, y, p);
    } else {
        dwconv_any<f16, 1>(x, w, bias, y, p);
    }
}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS) dwconv_nhwc_f32(DWCONV_PARAMS(float)) {
    dwconv_any<float, 1>(x, w, bias, y, DWCONV_PROBLEM);
}
