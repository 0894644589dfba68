// A reduction over the channels of each pixel (op `creduce`: ONNX ReduceSum, ReduceMean, ReduceMax or
// ReduceMin over axis 1 of an NCHW image with keepdims; CBAM's spatial attention pools), NHWC:
//   y[n,h,w,0] = reduce_c x[n,h,w,c]     op 0 sum, 1 mean (the sum / C), 2 max, 3 min
// in fp32, rounded once to the output dtype. A thread per pixel (grid-stride), its C channels read in
// order (fp16: 16-byte loads where C, ldx and x allow), y written at pixel stride ldy (a channel of a
// Concat's output: CBAM's [max, mean] pair lands in place). Max and min propagate a NaN, as ONNX's
// reference does (fmaxf alone would drop it).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as a -D macro.

#if !defined(CREDUCE_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

enum : int { CR_SUM = 0, CR_MEAN = 1, CR_MAX = 2, CR_MIN = 3 };

__device__ __forceinline__ float cr_init(int op) {
    return op == CR_MAX ? __int_as_float(0xff800000u) : op == CR_MIN ? __int_as_float(0x7f800000u) : 0.0f;
}

__device__ __forceinline__ float cr_step(float a, float v, int op) {
    if (op <= CR_MEAN) return a + v;
    if (a != a) return a;  // a NaN seen stays
    if (v != v) return v;
    return op == CR_MAX ? fmaxf(a, v) : fminf(a, v);
}

template <typename T>
__device__ __forceinline__ void creduce(const T* __restrict__ x, T* __restrict__ y, long long P, int C, int ldx,
                                        int ldy, int op, bool vec8) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += step) {
        const T* src = x + p * ldx;
        float a = cr_init(op);
        if (vec8) {  // fp16 only (the f16 entry decides it)
            for (int c = 0; c < C; c += 8) {
                float v[8];
                load_f16x8(v, reinterpret_cast<const f16*>(src) + c);
#pragma unroll
                for (int j = 0; j < 8; ++j) a = cr_step(a, v[j], op);
            }
        } else {
            for (int c = 0; c < C; ++c) a = cr_step(a, load_f32(src + c), op);
        }
        if (op == CR_MEAN) a /= static_cast<float>(C);
        store_f32(y + p * ldy, a);
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
