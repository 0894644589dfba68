// Fully connected layer on a pooled vector (ONNX Conv 1x1 on an (N, C, 1, 1) tensor: the two small
// convolutions of a squeeze-and-excitation block), bias and an activation fused:
//   y[n, k] = act(bias[k] + sum_c x[n, c] * w[k, c])      x: (N,1,1,C), y: (N,1,1,K)
// act, p0, p1: dt_activate (dualtrack_activations.cuh). Weights: w[k * C + c] (ONNX (K, C, 1, 1) as it is
// stored, the activation dtype); bias fp32 or null.
//
// A matrix-vector product per image (a few hundred thousand FMAs): one warp per output (n, k), its
// lanes stride over c (the weight row and x are read coalesced), a shuffle reduction in fp32, one
// rounding. No shared memory; FC_THREADS / 32 outputs per block.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(FC_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(FC_THREADS % 32 == 0, "one warp per output");

#include "dualtrack_device.cuh"

template <typename T>
__device__ __forceinline__ void fc(const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias,
                                   T* __restrict__ y, int N, int C, int K, int ldx, int ldy, int act, float p0,
                                   float p1) {
    const long long out = static_cast<long long>(blockIdx.x) * (FC_THREADS / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (out >= static_cast<long long>(N) * K) return;  // whole warps leave together
    const int k = static_cast<int>(out % K);
    const long long n = out / K;
    const T* xs = x + n * ldx;
    const T* ws = w + static_cast<long long>(k) * C;
    float acc = 0.0f;
    for (int c = lane; c < C; c += 32) acc = fmaf(load_f32(xs + c), load_f32(ws + c), acc);
#pragma unroll
    for (int d = 16; d > 0; d /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0) store_f32(y + n * ldy + k, dt_activate(acc + (bias != nullptr ? bias[k] : 0.0f), act, p0, p1));
}

#define FC_PARAMS(T)                                                                                        \
    (const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y, int N, \
     int C, int K, int ldx, int ldy, int act, float p0, float p1)
DUALTRACK_F16_F32_ENTRIES(fc_nhwc, FC_THREADS, FC_PARAMS, fc, (x, w, bias, y, N, C, K, ldx, ldy, act, p0, p1))
