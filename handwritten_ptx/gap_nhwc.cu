// Global average pool (ONNX GlobalAveragePool, or ReduceMean over H and W with keepdims), NHWC:
//   y[n, c] = (sum_{h,w} x[n,h,w,c]) / (H*W)      (y is (N, 1, 1, C), channel stride ldy)
// summed in fp32, divided once, rounded once to the output dtype.
//
// A block owns 32 channels of one image (grid: channel groups x images): its GAP_THREADS threads
// are 32 channel lanes x GAP_THREADS/32 pixel rows, so a warp reads 32 neighbouring channels of one
// pixel (coalesced) and the rows stride over the image's pixels; the rows' partial sums meet in
// shared memory. Deterministic: no atomics, a fixed summation order for a given launch.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(GAP_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(GAP_THREADS % 32 == 0 && GAP_THREADS <= 1024, "32 channel lanes x GAP_THREADS/32 pixel rows");

#include "dualtrack_device.cuh"

template <typename T>
__device__ __forceinline__ void gap(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int ldx,
                                    int ldy) {
    constexpr int ROWS = GAP_THREADS / 32;
    __shared__ float partial[ROWS][33];  // padded: the final column sum reads across rows
    const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    const int c = blockIdx.x * 32 + lane;
    const long long n = blockIdx.y;
    const long long HW = static_cast<long long>(H) * W;
    float acc = 0.0f;
    if (c < C) {
        const T* src = x + n * HW * ldx + c;
#pragma unroll 4
        for (long long p = row; p < HW; p += ROWS) acc += load_f32(src + p * ldx);
    }
    partial[row][lane] = acc;
    __syncthreads();
    if (row == 0 && c < C) {
        float sum = 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) sum += partial[r][lane];
        store_f32(y + n * ldy + c, sum / static_cast<float>(HW));
    }
}

// The fp16 vector path (C and ldx multiples of 8, x 16-byte aligned: gap_vec8): the block's 32
// channels are 4 lanes of 8 (one 16-byte load each) x GAP_THREADS/4 pixel rows, so a warp reads 8
// pixels' 32 channels at once. The rows of a warp meet by shuffles (lanes l, l^4, l^8, l^16 share
// channels), the warps in shared memory; a fixed order, no atomics, as above.
__device__ __forceinline__ void gap_f16x8(const f16* __restrict__ x, f16* __restrict__ y, int H, int W, int C,
                                          int ldx, int ldy) {
    constexpr int WARPS = GAP_THREADS / 32, ROWS = GAP_THREADS / 4;
    __shared__ float partial[WARPS][33];
    const int q = threadIdx.x % 4, row = threadIdx.x / 4, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c0 = blockIdx.x * 32, c = c0 + q * 8;
    const long long n = blockIdx.y;
    const long long HW = static_cast<long long>(H) * W;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (c < C) {
        const f16* src = x + n * HW * ldx + c;
#pragma unroll 4
        for (long long p = row; p < HW; p += ROWS) {
            float v[8];
            load_f16x8(v, src + p * ldx);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += v[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int m = 4; m < 32; m *= 2) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], m);
    }
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 8; ++j) partial[warp][q * 8 + j] = acc[j];
    }
    __syncthreads();
    if (warp == 0 && c0 + lane < C) {
        float sum = 0.0f;
#pragma unroll
        for (int r = 0; r < WARPS; ++r) sum += partial[r][lane];
        store_f32(y + n * ldy + c0 + lane, sum / static_cast<float>(HW));
    }
}

extern "C" __global__ void __launch_bounds__(GAP_THREADS)
gap_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy) {
    if (C % 8 == 0 && ldx % 8 == 0 && aligned16(x)) {  // uniform over the launch
        gap_f16x8(x, y, H, W, C, ldx, ldy);
        return;
    }
    gap<f16>(x, y, N, H, W, C, ldx, ldy);
}

extern "C" __global__ void __launch_bounds__(GAP_THREADS)
gap_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy) {
    gap<float>(x, y, N, H, W, C, ldx, ldy);
}
