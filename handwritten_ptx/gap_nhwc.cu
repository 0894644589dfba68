// A reduction over each image's pixels (ONNX GlobalAveragePool, or a Reduce op over H and W with
// keepdims: the mean of a squeeze-excitation, ConvNeXt-V2's L2 norm), NHWC:
//   y[n, c] = reduce_{h,w} x[n,h,w,c]      (y is (N, 1, 1, C), channel stride ldy)
// op: sum, mean, max, min, L1, L2, sum of squares (dualtrack_reduce.cuh), in fp32, finished once (the
// mean divides once, L2 takes one square root), rounded once to the output dtype. The entries switch
// on op once and run a body compiled for it, so the mean's loop is the plain sum it always was.
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
#include "dualtrack_reduce.cuh"

template <typename T, int OP>
__device__ __forceinline__ void gap(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int ldx,
                                    int ldy, float (*partial)[33]) {
    constexpr int ROWS = GAP_THREADS / 32;  // partial: [ROWS][33], padded: the final column sum reads across rows
    const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    const int c = blockIdx.x * 32 + lane;
    const long long n = blockIdx.y;
    const long long HW = static_cast<long long>(H) * W;
    float acc = dt_red_init(OP);
    if (c < C) {
        const T* src = x + n * HW * ldx + c;
#pragma unroll 4
        for (long long p = row; p < HW; p += ROWS) acc = dt_red_combine(acc, dt_red_map(load_f32(src + p * ldx), OP), OP);
    }
    partial[row][lane] = acc;
    __syncthreads();
    if (row == 0 && c < C) {
        float sum = dt_red_init(OP);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) sum = dt_red_combine(sum, partial[r][lane], OP);
        store_f32(y + n * ldy + c, dt_red_finish(sum, static_cast<float>(HW), OP));
    }
}

// The fp16 vector path (C and ldx multiples of 8, x 16-byte aligned: gap_vec8): the block's 32
// channels are 4 lanes of 8 (one 16-byte load each) x GAP_THREADS/4 pixel rows, so a warp reads 8
// pixels' 32 channels at once. The rows of a warp meet by shuffles (lanes l, l^4, l^8, l^16 share
// channels), the warps in shared memory; a fixed order, no atomics, as above.
template <int OP>
__device__ __forceinline__ void gap_f16x8(const f16* __restrict__ x, f16* __restrict__ y, int H, int W, int C,
                                          int ldx, int ldy, float (*partial)[33]) {
    constexpr int WARPS = GAP_THREADS / 32, ROWS = GAP_THREADS / 4;  // partial: [WARPS][33]
    const int q = threadIdx.x % 4, row = threadIdx.x / 4, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c0 = blockIdx.x * 32, c = c0 + q * 8;
    const long long n = blockIdx.y;
    const long long HW = static_cast<long long>(H) * W;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = dt_red_init(OP);
    if (c < C) {
        const f16* src = x + n * HW * ldx + c;
#pragma unroll 4
        for (long long p = row; p < HW; p += ROWS) {
            float v[8];
            load_f16x8(v, src + p * ldx);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = dt_red_combine(acc[j], dt_red_map(v[j], OP), OP);
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int m = 4; m < 32; m *= 2) acc[j] = dt_red_combine(acc[j], __shfl_xor_sync(0xffffffffu, acc[j], m), OP);
    }
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 8; ++j) partial[warp][q * 8 + j] = acc[j];
    }
    __syncthreads();
    if (warp == 0 && c0 + lane < C) {
        float sum = dt_red_init(OP);
#pragma unroll
        for (int r = 0; r < WARPS; ++r) sum = dt_red_combine(sum, partial[r][lane], OP);
        store_f32(y + n * ldy + c0 + lane, dt_red_finish(sum, static_cast<float>(HW), OP));
    }
}

// One body a reduction (op is uniform over the launch; an op outside the table writes nothing: the
// host refuses it before any launch). The bodies share the entry's one shared array: one each would
// add up past the 48 KB a kernel may declare.
#define GAP_DISPATCH(CALL)                                                  \
    switch (op) {                                                           \
        case DT_RED_SUM: CALL(DT_RED_SUM); break;                           \
        case DT_RED_MEAN: CALL(DT_RED_MEAN); break;                         \
        case DT_RED_MAX: CALL(DT_RED_MAX); break;                           \
        case DT_RED_MIN: CALL(DT_RED_MIN); break;                           \
        case DT_RED_L1: CALL(DT_RED_L1); break;                             \
        case DT_RED_L2: CALL(DT_RED_L2); break;                             \
        case DT_RED_SUMSQUARE: CALL(DT_RED_SUMSQUARE); break;               \
        default: break;                                                     \
    }

extern "C" __global__ void __launch_bounds__(GAP_THREADS)
gap_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy, int op) {
    __shared__ float partial[GAP_THREADS / 32][33];
    if (C % 8 == 0 && ldx % 8 == 0 && aligned16(x)) {  // uniform over the launch
#define GAP_VEC(OP) gap_f16x8<OP>(x, y, H, W, C, ldx, ldy, partial)
        GAP_DISPATCH(GAP_VEC)
        return;
    }
#define GAP_F16(OP) gap<f16, OP>(x, y, N, H, W, C, ldx, ldy, partial)
    GAP_DISPATCH(GAP_F16)
}

extern "C" __global__ void __launch_bounds__(GAP_THREADS)
gap_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy, int op) {
    __shared__ float partial[GAP_THREADS / 32][33];
#define GAP_F32(OP) gap<float, OP>(x, y, N, H, W, C, ldx, ldy, partial)
    GAP_DISPATCH(GAP_F32)
}
