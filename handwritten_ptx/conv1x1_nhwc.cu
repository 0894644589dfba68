// 1x1 convolution (stride 1, no padding, group 1), NHWC, bias and optional ReLU fused:
//   y[p, k] = relu?(bias[k] + sum_c x[p, c] * w[k, c])   for every pixel p of N*H*W.
//
// Made for a segmentation head (C = 32 features in, K = 2 classes out): a few output channels per
// pixel, so there is no GEMM to feed the tensor cores and the kernel is a stream over x. One thread
// per pixel and group of up to CONV1X1_KG output channels (grid.y: the groups), fp32 accumulation
// in registers, the group's weights staged once per block in shared memory as fp32 (read as
// broadcasts). x is read in 16-byte vectors when C, ldx and the pointer allow, element by element
// otherwise, so any C and channel stride (a channel slice of a wider buffer) work.
//
// Weights: w[k * C + c] (ONNX (K, C, 1, 1) as it is stored); bias: fp32, or null for none.
// ReLU maps negatives to 0 and keeps NaN, as the numpy reference (np.maximum) does.
// No toolkit #include: see conv3x3_nhwc.cu. Sizes come from dualtrack.kernels as -D macros.

#if !defined(CONV1X1_THREADS) || !defined(CONV1X1_KG) || !defined(CONV1X1_MAX_C)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

__device__ __forceinline__ float to_f32(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float to_f32(float f) { return f; }

__device__ __forceinline__ void from_f32(float f, f16* out) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    *out = h;
}
__device__ __forceinline__ void from_f32(float f, float* out) { *out = f; }

// 16 bytes of x as fp32 values: 8 halves or 4 floats.
__device__ __forceinline__ void unpack(const uint4 v, float* out, const f16*) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = to_f32(static_cast<f16>(u[i] & 0xffffu));
        out[2 * i + 1] = to_f32(static_cast<f16>(u[i] >> 16));
    }
}
__device__ __forceinline__ void unpack(const uint4 v, float* out, const float*) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
}

template <typename T>
__device__ __forceinline__ void conv1x1(const T* __restrict__ x, const T* __restrict__ w,
                                        const float* __restrict__ bias, T* __restrict__ y, int N, int H, int W,
                                        int C, int K, int ldx, int ldy, int relu) {
    constexpr int V = 16 / sizeof(T);  // channels in one 16-byte vector
    __shared__ float ws[CONV1X1_MAX_C * CONV1X1_KG];  // ws[c * KG + j]: the group's weights, fp32
    const int k0 = blockIdx.y * CONV1X1_KG;
    const int kg = K - k0 < CONV1X1_KG ? K - k0 : CONV1X1_KG;
    for (int i = threadIdx.x; i < C * CONV1X1_KG; i += blockDim.x) {
        const int c = i / CONV1X1_KG, j = i % CONV1X1_KG;
        ws[i] = j < kg ? to_f32(w[static_cast<long long>(k0 + j) * C + c]) : 0.0f;
    }
    __syncthreads();

    const long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (p >= static_cast<long long>(N) * H * W) return;

    float acc[CONV1X1_KG];
#pragma unroll
    for (int j = 0; j < CONV1X1_KG; ++j) acc[j] = 0.0f;

    const T* src = x + p * ldx;
    int c = 0;
    if (C % V == 0 && ldx % V == 0 && aligned16(x)) {
        for (; c < C; c += V) {
            float v[V];
            unpack(*reinterpret_cast<const uint4*>(src + c), v, src);
#pragma unroll
            for (int e = 0; e < V; ++e) {
#pragma unroll
                for (int j = 0; j < CONV1X1_KG; ++j) acc[j] = fmaf(v[e], ws[(c + e) * CONV1X1_KG + j], acc[j]);
            }
        }
    }
    for (; c < C; ++c) {
        const float v = to_f32(src[c]);
#pragma unroll
        for (int j = 0; j < CONV1X1_KG; ++j) acc[j] = fmaf(v, ws[c * CONV1X1_KG + j], acc[j]);
    }

    T* dst = y + p * ldy + k0;
#pragma unroll
    for (int j = 0; j < CONV1X1_KG; ++j) {
        if (j < kg) {
            float r = acc[j] + (bias != nullptr ? bias[k0 + j] : 0.0f);
            if (relu && r < 0.0f) r = 0.0f;
            from_f32(r, dst + j);
        }
    }
}

#define CONV1X1_PARAMS(T)                                                                                   \
    (const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias, T* __restrict__ y, int N, \
     int H, int W, int C, int K, int ldx, int ldy, int relu)
DUALTRACK_F16_F32_ENTRIES(conv1x1_nhwc, CONV1X1_THREADS, CONV1X1_PARAMS, conv1x1,
                          (x, w, bias, y, N, H, W, C, K, ldx, ldy, relu))
