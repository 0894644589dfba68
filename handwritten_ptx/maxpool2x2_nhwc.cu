// 2x2 max-pool, stride 2, NHWC: y[n,ho,wo,c] = max_{dh,dw in {0,1}} x[n,2ho+dh,2wo+dw,c],
// output floor(H/2) x floor(W/2) (an odd last row/column is dropped, as ONNX MaxPool does).
//
// One thread per output pixel and 16-byte chunk of channels (8 fp16 or 4 fp32 values), so the
// launch geometry does not depend on alignment: the chunk is one vector load per tap when C, ldx,
// ldy and both pointers allow it, and a bounds-checked scalar loop otherwise.
//
// NaN propagates (max.NaN), as numpy's max and PyTorch's max-pool do.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(POOL_THREADS) || !defined(POOL_VEC_F16) || !defined(POOL_VEC_F32)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(POOL_VEC_F16 * 2 == 16 && POOL_VEC_F32 * 4 == 16, "one thread per 16-byte chunk of channels");

#include "dualtrack_device.cuh"

// T: element type; V: elements per 16-byte chunk; Vec: the 16-byte type.
template <typename T, int V, typename Vec>
__device__ __forceinline__ void maxpool2x2(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C,
                                           int ldx, int ldy) {
    const int Ho = H / 2, Wo = W / 2;
    const int chunks = (C + V - 1) / V;
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long total = static_cast<long long>(N) * Ho * Wo * chunks;
    if (idx >= total) return;

    // Channel chunk fastest, so neighbouring threads read neighbouring bytes of one pixel.
    const int q = static_cast<int>(idx % chunks);
    long long rest = idx / chunks;
    const int wo = static_cast<int>(rest % Wo);
    rest /= Wo;
    const int ho = static_cast<int>(rest % Ho);
    const long long n = rest / Ho;
    const int c = q * V;

    const long long p00 = (n * H + 2 * ho) * W + 2 * wo;  // top-left input pixel
    const T* x00 = x + p00 * ldx + c;
    const T* x01 = x00 + ldx;
    const T* x10 = x00 + static_cast<long long>(W) * ldx;
    const T* x11 = x10 + ldx;
    T* dst = y + ((n * Ho + ho) * Wo + wo) * ldy + c;

    const bool vec = C % V == 0 && ldx % V == 0 && ldy % V == 0 && aligned16(x) && aligned16(y);
    if (vec) {
        const Vec a = max_of(*reinterpret_cast<const Vec*>(x00), *reinterpret_cast<const Vec*>(x01));
        const Vec b = max_of(*reinterpret_cast<const Vec*>(x10), *reinterpret_cast<const Vec*>(x11));
        *reinterpret_cast<Vec*>(dst) = max_of(a, b);
    } else {
        const int n_el = C - c < V ? C - c : V;
        for (int e = 0; e < n_el; ++e) dst[e] = max_of(max_of(x00[e], x01[e]), max_of(x10[e], x11[e]));
    }
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
maxpool2x2_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int C, int ldx, int ldy) {
    maxpool2x2<f16, POOL_VEC_F16, uint4>(x, y, N, H, W, C, ldx, ldy);
}

extern "C" __global__ void __launch_bounds__(POOL_THREADS)
maxpool2x2_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int C, int ldx,
                    int ldy) {
    maxpool2x2<float, POOL_VEC_F32, float4>(x, y, N, H, W, C, ldx, ldy);
}
