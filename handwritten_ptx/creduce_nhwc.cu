// A reduction over the channels of each pixel (op `creduce`: an ONNX Reduce op over axis 1 of an NCHW
// image with keepdims; CBAM's spatial attention pools), NHWC:
//   y[n,h,w,0] = reduce_c x[n,h,w,c]     op: sum, mean, max, min, L1, L2, sum of squares (dualtrack_reduce.cuh)
// in fp32, rounded once to the output dtype. A thread per pixel (grid-stride), its C channels read in
// order (fp16: 16-byte loads where C, ldx and x allow), y written at pixel stride ldy (a channel of a
// Concat's output: CBAM's [max, mean] pair lands in place).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as a -D macro.

#if !defined(CREDUCE_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"
#include "dualtrack_reduce.cuh"

template <typename T>
__device__ __forceinline__ void creduce(const T* __restrict__ x, T* __restrict__ y, long long P, int C, int ldx,
                                        int ldy, int op, bool vec8) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += step) {
        const T* src = x + p * ldx;
        float a = dt_red_init(op);
        if (vec8) {  // fp16 only (the f16 entry decides it)
            for (int c = 0; c < C; c += 8) {
                float v[8];
                load_f16x8(v, reinterpret_cast<const f16*>(src) + c);
#pragma unroll
                for (int j = 0; j < 8; ++j) a = dt_red_combine(a, dt_red_map(v[j], op), op);
            }
        } else {
            for (int c = 0; c < C; ++c) a = dt_red_combine(a, dt_red_map(load_f32(src + c), op), op);
        }
        store_f32(y + p * ldy, dt_red_finish(a, static_cast<float>(C), op));
    }
}

#define CREDUCE_PARAMS(T) \
    (const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy, int op)

extern "C" __global__ void __launch_bounds__(CREDUCE_THREADS) creduce_nhwc_f16 CREDUCE_PARAMS(f16) {
    const bool vec8 = C % 8 == 0 && ldx % 8 == 0 && aligned16(x);  // uniform over the launch
    creduce<f16>(x, y, static_cast<long long>(N) * H * W, C, ldx, ldy, op, vec8);
}

extern "C" __global__ void __launch_bounds__(CREDUCE_THREADS) creduce_nhwc_f32 CREDUCE_PARAMS(float) {
    creduce<float>(x, y, static_cast<long long>(N) * H * W, C, ldx, ldy, op, false);
}
