// Elementwise ops on NHWC tensors, an activation fused after them:
//   op 0 (unary): y = act(a)
//   op 1 (add):   y = act(a + b)
//   op 2 (mul):   y = act(a * b)
// b is either a tensor of y's shape (bcast 0) or an (N, 1, 1, C) vector broadcast over H and W
// (bcast 1: the gate of a squeeze-and-excitation block, the scale of LR-ASPP's head). Computed in
// fp32, rounded once; act, p0, p1: dualtrack_device.cuh's apply_act. Every operand has its own
// channel stride (lda, ldb, ldy), so any of them may be a channel slice.
//
// One thread per output element, channel fastest (coalesced), no shared memory.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(ELTWISE_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

template <typename T>
__device__ __forceinline__ void eltwise(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, int N,
                                        int H, int W, int C, int lda, int ldb, int ldy, int op, int bcast, int act,
                                        float p0, float p1) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<long long>(N) * H * W * C) return;
    const NhwcIndex e = nhwc_index(idx, H, W, C);
    const int c = e.c;
    const long long p = e.p;
    float v = load_f32(a + p * lda + c);
    if (op != 0) {
        const float u = load_f32(b + (bcast ? e.n : p) * ldb + c);
        v = op == 1 ? v + u : v * u;
    }
    store_f32(y + p * ldy + c, apply_act(v, act, p0, p1));
}

extern "C" __global__ void __launch_bounds__(ELTWISE_THREADS)
eltwise_nhwc_f16(const f16* __restrict__ a, const f16* __restrict__ b, f16* __restrict__ y, int N, int H, int W,
                 int C, int lda, int ldb, int ldy, int op, int bcast, int act, float p0, float p1) {
    eltwise<f16>(a, b, y, N, H, W, C, lda, ldb, ldy, op, bcast, act, p0, p1);
}

extern "C" __global__ void __launch_bounds__(ELTWISE_THREADS)
eltwise_nhwc_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, int N, int H,
                 int W, int C, int lda, int ldb, int ldy, int op, int bcast, int act, float p0, float p1) {
    eltwise<float>(a, b, y, N, H, W, C, lda, ldb, ldy, op, bcast, act, p0, p1);
}
