// ONNX DepthToSpace (opset 13) of an NHWC tensor: blocks of bs*bs channel groups moved into bs x bs
// pixel blocks, (N, H, W, K*bs*bs) -> (N, H*bs, W*bs, K):
//   y[n, h*bs + a, w*bs + b, k] = x[n, h, w, ch(a, b, k)]                 a, b < bs, k < K
//   mode 0 DCR: ch = (a*bs + b)*K + k     (a sub-pixel convolution's layout: 8 neighbouring k are
//                                          8 neighbouring channels of x)
//   mode 1 CRD: ch = k*bs*bs + a*bs + b   (torch's PixelShuffle: neighbouring k are bs*bs apart)
// x and y point at their first channels, with channel strides ldx and ldy (a view input, an output
// slice of a concatenation); values are copied bit for bit (no arithmetic), so fp16 NaN payloads
// and -0 survive.
//
// A thread per work item (grid-stride): one output element, or 8 neighbouring channels of an output
// pixel on the fp16 vector path (one 16-byte store; a 16-byte load in DCR, 8 gathered 2-byte loads
// in CRD), channel fastest (coalesced stores; DCR's loads are coalesced too: the output pixels
// w*bs .. w*bs + bs - 1 of one row read one contiguous bs*K run of x's pixel).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(D2S_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

// Work items of LANES channels (channel fastest, then wo, ho, n) in a grid-stride loop; the host's
// grid (dualtrack.kernels.depth_to_space) only sets how many items a thread takes. crd is 0 where
// bs is 1 (both modes are then a copy).
template <typename T, int LANES>
__device__ __forceinline__ void depth_to_space(const T* __restrict__ x, T* __restrict__ y, int N, int H, int W,
                                               int K, int ldx, int ldy, int bs, int crd) {
    const int Ho = H * bs, Wo = W * bs, KL = K / LANES;
    const long long total = static_cast<long long>(N) * Ho * Wo * KL;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, Ho, Wo, KL);
        const int k = o.c * LANES;
        const int h = o.h / bs, w = o.w / bs;
        const int sub = (o.h - h * bs) * bs + (o.w - w * bs);  // a*bs + b
        const int ch = crd ? k * bs * bs + sub : sub * K + k;
        const T* src = x + ((o.n * H + h) * W + w) * ldx + ch;
        T* dst = y + o.p * ldy + k;
        if constexpr (LANES == 8) {
            if (!crd) {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
                const int kstep = bs * bs;  // x's channel distance between neighbouring k
                unsigned r[4];              // little-endian: the lower half of each word is the first channel
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    r[j] = static_cast<unsigned>(src[2 * j * kstep]) |
                           (static_cast<unsigned>(src[(2 * j + 1) * kstep]) << 16);
                }
                *reinterpret_cast<uint4*>(dst) = make_uint4(r[0], r[1], r[2], r[3]);
            }
        } else {
            *dst = *src;
        }
    }
}

extern "C" __global__ void __launch_bounds__(D2S_THREADS)
depth_to_space_nhwc_f16(const f16* __restrict__ x, f16* __restrict__ y, int N, int H, int W, int K, int ldx, int ldy,
                        int bs, int mode) {
    const int crd = mode == 1 && bs > 1;
    // The vector path stores 16 bytes: K and ldy multiples of 8 and y 16-byte aligned; DCR also loads
    // 16 bytes (ldx a multiple of 8 and x aligned; K % 8 == 0 keeps ch one), CRD gathers (uniform
    // over the launch).
    const bool store16 = K % 8 == 0 && ldy % 8 == 0 && aligned16(y);
    if (store16 && (crd || (ldx % 8 == 0 && aligned16(x)))) {
        depth_to_space<f16, 8>(x, y, N, H, W, K, ldx, ldy, bs, crd);
        return;
    }
    depth_to_space<f16, 1>(x, y, N, H, W, K, ldx, ldy, bs, crd);
}

extern "C" __global__ void __launch_bounds__(D2S_THREADS)
depth_to_space_nhwc_f32(const float* __restrict__ x, float* __restrict__ y, int N, int H, int W, int K, int ldx,
                        int ldy, int bs, int mode) {
    depth_to_space<float, 1>(x, y, N, H, W, K, ldx, ldy, bs, mode == 1 && bs > 1);
}
