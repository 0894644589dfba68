// Sliding-window inference's kernels (dualtrack.runtime.tiling; host side: dualtrack.kernels.blend).
//
//   cut:        windows[b, y, x, :] = image[o.y[b] + y, o.x[b] + x, :]  (3 uint8 channels, NHWC), zero where
//               that pixel is outside the H x W image and for b >= o.count (a short last batch)
//   accumulate: for each image pixel (y, x) of the launch's box [r0, r1) x [c0, c1) and each window j
//               covering it, in order j = 0 .. o.count - 1:
//                   acc[c][y % band][x] += probs[j][c][y - o.y[j]][x - o.x[j]] * weights[y - o.y[j]][x - o.x[j]]
//                   acc[C][y % band][x] += weights[...]
//               probs (n, C, h, w) float32 dense (the engine's output), weights (h, w) float32,
//               acc (C + 1) planes of band x W float32: a ring of rows (plane C: the sum of weights)
//   finish:     for image rows [lo, hi): p_c = acc[c] / acc[C]; mask[y][x] = argmax_c p_c (the first of
//               equal ones; C == 1: p_0 > 0.5); probs[c][y][x] = p_c where probs is not null; the
//               pixel's ring entries set to 0 for the rows that reuse them.
//
// One work item per pixel in a grid-stride loop (any grid is correct). accumulate is a gather: a
// thread owns its accumulator pixel and visits the launch's windows in order, so overlapping
// windows of one batch never race and the sums are the numpy reference's (kernels/blend.py
// accumulate), bit for bit: every product and sum an explicit _rn intrinsic (no fma contraction),
// the division IEEE. Rows are addressed as y % band: the host keeps every launch's rows inside
// [done, done + band), finished rows below done (BlendSpec checks it).
// No toolkit #include: see conv3x3_nhwc.cu. The sizes come from dualtrack.kernels as -D macros.

#if !defined(BLEND_THREADS) || !defined(BLEND_MAX_WINDOWS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

// A launch's window origins (image row and column of each window's top-left; negative where the
// image is padded), by value: dualtrack.kernels.blend's BlendOrigins, field for field.
struct BlendOrigins {
    int y[BLEND_MAX_WINDOWS];
    int x[BLEND_MAX_WINDOWS];
    int count;
};
static_assert(sizeof(BlendOrigins) <= 3072, "kernel parameters of every driver and arch: 4 KiB, with the rest");

extern "C" __global__ void __launch_bounds__(BLEND_THREADS)
blend_nhwc_cut_u8(const unsigned char* __restrict__ image, unsigned char* __restrict__ windows, int H, int W, int h,
                  int w, int batch, BlendOrigins o) {
    const long long total = static_cast<long long>(batch) * h * w;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
        const int x = static_cast<int>(i % w);
        const long long r = i / w;
        const int y = static_cast<int>(r % h);
        const int b = static_cast<int>(r / h);
        unsigned char v0 = 0, v1 = 0, v2 = 0;
        if (b < o.count) {
            const int iy = o.y[b] + y;
            const int ix = o.x[b] + x;
            if (iy >= 0 && iy < H && ix >= 0 && ix < W) {
                const unsigned char* src = image + (static_cast<long long>(iy) * W + ix) * 3;
                v0 = src[0];
                v1 = src[1];
                v2 = src[2];
            }
        }
        unsigned char* dst = windows + i * 3;
        dst[0] = v0;
        dst[1] = v1;
        dst[2] = v2;
    }
}

extern "C" __global__ void __launch_bounds__(BLEND_THREADS)
blend_nhwc_accumulate_f32(const float* __restrict__ probs, const float* __restrict__ weights, float* __restrict__ acc,
                          int C, int h, int w, int H, int W, int band, int r0, int r1, int c0, int c1,
                          BlendOrigins o) {
    const int box_w = c1 - c0;
    const long long total = static_cast<long long>(r1 - r0) * box_w;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long plane = static_cast<long long>(band) * W;  // one class's ring of rows
    const long long window = static_cast<long long>(h) * w;    // one class of one window's output
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
        const int y = r0 + static_cast<int>(i / box_w);
        const int x = c0 + static_cast<int>(i % box_w);
        const long long a = static_cast<long long>(y % band) * W + x;
        for (int j = 0; j < o.count; ++j) {
            const int wy = y - o.y[j];
            const int wx = x - o.x[j];
            if (wy < 0 || wy >= h || wx < 0 || wx >= w) continue;
            const long long q = static_cast<long long>(wy) * w + wx;
            const float wt = weights[q];
            const float* p = probs + static_cast<long long>(j) * C * window + q;
            for (int c = 0; c < C; ++c) {
                float* s = acc + c * plane + a;
                *s = __fadd_rn(*s, __fmul_rn(p[c * window], wt));
            }
            float* s = acc + C * plane + a;
            *s = __fadd_rn(*s, wt);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLEND_THREADS)
blend_nhwc_finish_f32(float* __restrict__ acc, unsigned char* __restrict__ mask, float* __restrict__ probs, int C,
                      int H, int W, int band, int lo, int hi) {
    const long long total = static_cast<long long>(hi - lo) * W;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long plane = static_cast<long long>(band) * W;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
        const int y = lo + static_cast<int>(i / W);
        const int x = static_cast<int>(i % W);
        const long long a = static_cast<long long>(y % band) * W + x;
        const long long pixel = static_cast<long long>(y) * W + x;
        const float sum = acc[C * plane + a];
        int best = 0;
        float top = 0.0f;
        for (int c = 0; c < C; ++c) {
            const float v = __fdiv_rn(acc[c * plane + a], sum);
            if (probs != nullptr) probs[c * static_cast<long long>(H) * W + pixel] = v;
            if (c == 0 || v > top) {  // strictly greater: the first of equal ones, as numpy's argmax
                top = v;
                best = c;
            }
            acc[c * plane + a] = 0.0f;
        }
        acc[C * plane + a] = 0.0f;
        mask[pixel] = static_cast<unsigned char>(C == 1 ? (top > 0.5f ? 1 : 0) : best);
    }
}
