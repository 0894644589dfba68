// Elementwise ops on NHWC tensors, an activation fused after them (op: dualtrack.contract.plan.ELTWISE_OPS):
//   op 0 (unary): y = act(a)
//   op 1 (add):   y = act(a + b)        op 5 (rsub):  y = act(b - a)
//   op 2 (mul):   y = act(a * b)        op 6 (rdiv):  y = act(b / a)
//   op 3 (sub):   y = act(a - b)        op 7 (prelu): y = act(a < 0 ? a * b : a)   (NaN stays NaN)
//   op 4 (div):   y = act(a / b)
// b is a tensor of y's shape (bcast 0), an (N, 1, 1, C) vector broadcast over H and W (bcast 1: the
// gate of a squeeze-and-excitation block, the scale of LR-ASPP's head), a (C,) vector broadcast
// over N, H and W (bcast 2: a constant operand, a per-channel PReLU slope or layer scale; ldb unused),
// or an (N, H, W, 1) map broadcast over C (bcast 3: an attention gate, scSE's spatial gate).
// Computed in fp32 (IEEE division), rounded once; act, p0, p1: dt_activate
// (dualtrack_activations.cuh). Every operand has its own channel stride (lda, ldb, ldy), so any of
// them may be a channel slice.
//
// Work items of one output element, channel fastest (coalesced), no shared memory; fp16 with C and
// the strides multiples of 8 (16-byte aligned pointers) takes 8 channels an item: 16-byte accesses.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(ELTWISE_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// a op b of one element (op >= 1; the header's table).
__device__ __forceinline__ float binary_op(int op, float v, float u) {
    switch (op) {
        case 1: return v + u;
        case 2: return v * u;
        case 3: return v - u;
        case 4: return v / u;
        case 5: return u - v;
        case 6: return u / v;
        default: return v < 0.0f ? v * u : v;  // 7: prelu
    }
}

// The pixel row of b that pixel p of image n reads (bcast 0, 1, 2, 3).
__device__ __forceinline__ long long operand_row(int bcast, long long n, long long p) {
    return (bcast == 0 || bcast == 3) ? p : (bcast == 1 ? n : 0);
}

// Work items (pixel x channel, channel fastest) in a grid-stride loop: any grid is correct, the
// host's grid (dualtrack.kernels.eltwise) only sets how many items a thread takes.
template <typename T>
__device__ __forceinline__ void eltwise(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, int N,
                                        int H, int W, int C, int lda, int ldb, int ldy, int op, int bcast, int act,
                                        float p0, float p1) {
    const long long total = static_cast<long long>(N) * H * W * C;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex e = nhwc_index(idx, H, W, C);
        const int c = e.c;
        const long long p = e.p;
        float v = load_f32(a + p * lda + c);
        if (op != 0) {
            const float u = load_f32(b + operand_row(bcast, e.n, p) * ldb + (bcast == 3 ? 0 : c));
            v = binary_op(op, v, u);
        }
        store_f32(y + p * ldy + c, dt_activate(v, act, p0, p1));
    }
}

// The fp16 vector path: a work item is 8 neighbouring channels of one pixel (16-byte loads and
// store). Needs C, lda, ldy (and ldb where the op is binary) multiples of 8 and the pointers
// 16-byte aligned (eltwise_vec8); per element the same fp32 math and rounding as eltwise.
__device__ __forceinline__ void eltwise_f16x8(const f16* __restrict__ a, const f16* __restrict__ b,
                                              f16* __restrict__ y, int N, int H, int W, int C, int lda, int ldb,
                                              int ldy, int op, int bcast, int act, float p0, float p1) {
    const int C8 = C / 8;
    const long long total = static_cast<long long>(N) * H * W * C8;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex e = nhwc_index(idx, H, W, C8);
        const int c = e.c * 8;
        const long long p = e.p;
        float v[8];
        load_f16x8(v, a + p * lda + c);
        if (op != 0 && bcast == 3) {  // one value of the pixel's gate for all 8 channels
            const float u = load_f32(b + p * ldb);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = binary_op(op, v[j], u);
        } else if (op != 0) {
            float u[8];
            load_f16x8(u, b + operand_row(bcast, e.n, p) * ldb + c);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = binary_op(op, v[j], u[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = dt_activate(v[j], act, p0, p1);
        store_f16x8(y + p * ldy + c, v);
    }
}

// Whether the fp16 vector path applies (uniform over the launch).
__device__ __forceinline__ bool eltwise_vec8(const f16* a, const f16* b, const f16* y, int C, int lda, int ldb,
                                             int ldy, int op, int bcast) {
    const bool b_ok = op == 0 || bcast == 3 || (ldb % 8 == 0 && aligned16(b));  // bcast 3 reads b scalar
    return C % 8 == 0 && lda % 8 == 0 && ldy % 8 == 0 && aligned16(a) && aligned16(y) && b_ok;
}

extern "C" __global__ void __launch_bounds__(ELTWISE_THREADS)
eltwise_nhwc_f16(const f16* __restrict__ a, const f16* __restrict__ b, f16* __restrict__ y, int N, int H, int W,
                 int C, int lda, int ldb, int ldy, int op, int bcast, int act, float p0, float p1) {
    if (eltwise_vec8(a, b, y, C, lda, ldb, ldy, op, bcast)) {
        eltwise_f16x8(a, b, y, N, H, W, C, lda, ldb, ldy, op, bcast, act, p0, p1);
        return;
    }
    eltwise<f16>(a, b, y, N, H, W, C, lda, ldb, ldy, op, bcast, act, p0, p1);
}

extern "C" __global__ void __launch_bounds__(ELTWISE_THREADS)
eltwise_nhwc_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, int N, int H,
                 int W, int C, int lda, int ldb, int ldy, int op, int bcast, int act, float p0, float p1) {
    eltwise<float>(a, b, y, N, H, W, C, lda, ldb, ldy, op, bcast, act, p0, p1);
}
