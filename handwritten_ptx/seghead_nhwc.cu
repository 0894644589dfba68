// The segmentation head's post-processing (the front end's image wrap, `post/*`, or a model's own
// Softmax/ArgMax tail): NHWC logits in, the model's own outputs out, in the model's layout:
//   probs[n, c, h, w] = act(x[n, h, w, :])[c]       NCHW, fp32 (or fp16: PROBS_F16), dense
//   mask[n, h, w]     = argmax_c a[n, h, w, c]       uint8, dense; a = the activation's output
//                       (or, THRESHOLD, a one-class head: a[n, h, w, 0] > thr)
// act: 0 none, 1 softmax over the C classes, 2 sigmoid (dualtrack.plan.HEAD_ACTS). Softmax is the
// numerically stable one: m = max_c v_c, e_c = expf(v_c - m), p_c = e_c / sum_c e_c (classes summed
// in order). All math in fp32; the fp16 roundings the ONNX graph makes (Casts to fp16, an activation
// computed in an fp16 tensor) are made where the graph makes them (flags, dualtrack.plan.HEAD_FLAGS):
// ROUND_IN rounds v to fp16 before the activation, ROUND_PROBS the probabilities written, ROUND_ARG
// the values the argmax compares. ArgMax as ONNX's with select_last_index = 0 (onnxruntime's): the
// first class of the greatest value, a strict `>` scan from class 0, so a NaN is never chosen over a
// number after it (a NaN in class 0 keeps class 0). A NaN logit makes its pixel's softmax NaN.
//
// One thread per pixel in a grid-stride loop (any grid is correct): it reads its C logits (channel
// stride ldx; into registers for C <= 16, else once per pass, max, sum and write, from L1), writes C
// probabilities, one per class plane (consecutive threads, consecutive pixels: coalesced), and one
// mask byte.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(SEGHEAD_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

enum HeadAct { HEAD_NONE = 0, HEAD_SOFTMAX = 1, HEAD_SIGMOID = 2 };
enum HeadFlag { ROUND_IN = 1, ROUND_PROBS = 2, ROUND_ARG = 4, PROBS_F16 = 8, THRESHOLD = 16 };

__device__ __forceinline__ float round_f16(float v) { return f16_to_f32(f32_to_f16(v)); }

template <typename T>
__device__ __forceinline__ float logit(const T* px, int c, int flags) {
    const float v = load_f32(px + c);
    return (flags & ROUND_IN) ? round_f16(v) : v;
}

// One class's output: its probability written (rounded as the graph rounds it), and the argmax's
// strict scan from class 0 (the first of equal values wins, a NaN never does).
__device__ __forceinline__ void emit(void* probs, long long at, int c, float a, int flags, int& best, float& best_v) {
    const float pr = (flags & ROUND_PROBS) ? round_f16(a) : a;
    if (flags & PROBS_F16) static_cast<f16*>(probs)[at] = f32_to_f16(pr);
    else static_cast<float*>(probs)[at] = pr;
    const float s = (flags & ROUND_ARG) ? round_f16(a) : a;
    if (c == 0 || s > best_v) {
        best_v = s;
        best = c;
    }
}

// Up to CMAX classes (C <= CMAX): the logits read once into registers (the loops unroll over CMAX,
// so the array never goes to local memory).
template <int CMAX, typename T>
__device__ __forceinline__ int pixel_regs(const T* px, void* probs, long long out0, long long HW, int C, int act,
                                          int flags, float& best_v) {
    float a[CMAX];
#pragma unroll
    for (int c = 0; c < CMAX; ++c) a[c] = c < C ? logit(px, c, flags) : 0.0f;
    if (act == HEAD_SOFTMAX) {
        float m = a[0], sum = 0.0f;
#pragma unroll
        for (int c = 1; c < CMAX; ++c)
            if (c < C) m = fmaxf(m, a[c]);  // fmaxf: a NaN is not the max
#pragma unroll
        for (int c = 0; c < CMAX; ++c)
            if (c < C) sum += (a[c] = expf(a[c] - m));
#pragma unroll
        for (int c = 0; c < CMAX; ++c) a[c] = a[c] / sum;
    } else if (act == HEAD_SIGMOID) {
#pragma unroll
        for (int c = 0; c < CMAX; ++c) a[c] = 1.0f / (1.0f + expf(-a[c]));
    }
    int best = 0;
#pragma unroll
    for (int c = 0; c < CMAX; ++c)
        if (c < C) emit(probs, out0 + c * HW, c, a[c], flags, best, best_v);
    return best;
}

// Any number of classes: the logits read again for each pass (max, sum, write; the re-reads hit L1),
// the same arithmetic in the same order as pixel_regs, so both give the same bits.
template <typename T>
__device__ __forceinline__ int pixel_any(const T* px, void* probs, long long out0, long long HW, int C, int act,
                                         int flags, float& best_v) {
    float m = 0.0f, sum = 1.0f;
    if (act == HEAD_SOFTMAX) {
        m = logit(px, 0, flags);
        for (int c = 1; c < C; ++c) m = fmaxf(m, logit(px, c, flags));
        sum = 0.0f;
        for (int c = 0; c < C; ++c) sum += expf(logit(px, c, flags) - m);
    }
    int best = 0;
    for (int c = 0; c < C; ++c) {
        float a = logit(px, c, flags);
        if (act == HEAD_SOFTMAX) a = expf(a - m) / sum;
        else if (act == HEAD_SIGMOID) a = 1.0f / (1.0f + expf(-a));
        emit(probs, out0 + c * HW, c, a, flags, best, best_v);
    }
    return best;
}

template <typename T>
__device__ __forceinline__ void seghead(const T* __restrict__ x, void* __restrict__ probs,
                                        unsigned char* __restrict__ mask, int N, int H, int W, int C, int ldx,
                                        int act, int flags, float thr) {
    const long long HW = static_cast<long long>(H) * W;
    const long long total = static_cast<long long>(N) * HW;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < total; p += step) {
        // 64-bit division costs tens of instructions; every launch short of 2^32 pixels divides in 32 bits.
        const long long n = total < 0xffffffffll ? static_cast<unsigned>(p) / static_cast<unsigned>(HW) : p / HW;
        const long long out0 = n * C * HW + (p - n * HW);
        const T* px = x + p * ldx;
        float best_v = 0.0f;
        const int best = C <= 4    ? pixel_regs<4>(px, probs, out0, HW, C, act, flags, best_v)
                         : C <= 16 ? pixel_regs<16>(px, probs, out0, HW, C, act, flags, best_v)
                                   : pixel_any(px, probs, out0, HW, C, act, flags, best_v);
        mask[p] = (flags & THRESHOLD) ? static_cast<unsigned char>(best_v > thr ? 1 : 0)
                                      : static_cast<unsigned char>(best);
    }
}

extern "C" __global__ void __launch_bounds__(SEGHEAD_THREADS)
seghead_nhwc_f16(const f16* __restrict__ x, void* __restrict__ probs, unsigned char* __restrict__ mask, int N,
                 int H, int W, int C, int ldx, int act, int flags, float thr) {
    seghead<f16>(x, probs, mask, N, H, W, C, ldx, act, flags, thr);
}

extern "C" __global__ void __launch_bounds__(SEGHEAD_THREADS)
seghead_nhwc_f32(const float* __restrict__ x, void* __restrict__ probs, unsigned char* __restrict__ mask, int N,
                 int H, int W, int C, int ldx, int act, int flags, float thr) {
    seghead<float>(x, probs, mask, N, H, W, C, ldx, act, flags, thr);
}
