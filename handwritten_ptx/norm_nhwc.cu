// The normalisation family, NHWC (op `norm`: dualtrack.kernels.norm), fp32 statistics and math:
//   group statistics (GroupNorm, InstanceNorm = G groups of C/G channels, G = C):
//     mean[n,g], var[n,g] over (H, W, C/G) of image n (the biased variance, as ONNX and torch);
//   apply: y = act((x - mean) * rsqrt(var + eps) * gamma[c] + beta[c] (+ r if res == 1)) (+ r if res == 2)
//     with mean, var of (n, g = c / (C/G)) read at mean[n*stat_n + g], var[n*stat_n + g]: stat_n = G
//     for computed statistics, 0 for per-channel constants (an unfolded BatchNormalization: G = C,
//     its running mean and variance); gamma, beta null: 1, 0; r (res != 0): a tensor of y's shape;
//   layer: the same epilogue with mean, var over the C channels of each pixel (ConvNeXt's LayerNorm2d).
// act, p0, p1: dt_activate (dualtrack_activations.cuh). Every tensor has its own channel stride (ldx,
// ldr, ldy), so x may be read from and y written into a channel slice (a Concat's).
//
// The statistics are a split reduction, so that one image with a few groups of a large picture still
// fills the GPU (IREE's one-workgroup-per-row reduction did not: FACTS 29):
//   stats:    grid (C/32 channel tiles, chunks, N): a block reduces 32 channels over one chunk of
//             `chunk` pixels to a partial (mean, M2) per channel (its count is the chunk's pixels) in
//             `part` [n][chunk][c][2]; a thread keeps sums shifted by its first value, the block's
//             rows meet by Chan's formula in shared memory;
//   finalize: grid (G, N): a block combines the chunks x C/G partials of its group (Chan's formula)
//             into mean[n*G + g] and var[n*G + g];
//   apply:    grid (blocks, N), a thread per channel vector (fp16: 8 channels) striding over an image's
//             pixels with its statistics and affine folded in registers.
// Deterministic: no atomics, a fixed combination order for a given launch.
// No toolkit #include: see conv3x3_nhwc.cu. The block sizes come from dualtrack.kernels as -D macros.

#if !defined(NORM_THREADS) || !defined(NORM_FIN_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(NORM_THREADS % 32 == 0 && NORM_THREADS >= 128 && NORM_THREADS <= 1024,
              "the stats block: 32 channels x NORM_THREADS/32 rows (fp16 vectors: 4 x NORM_THREADS/4)");
static_assert((NORM_FIN_THREADS & (NORM_FIN_THREADS - 1)) == 0 && NORM_FIN_THREADS >= 32 && NORM_FIN_THREADS <= 1024,
              "the finalize block's tree reduction halves it");

#include "dualtrack_device.cuh"

// A (count, mean, M2) summary of a set of values; `add` merges another (Chan et al.'s pairwise update).
struct Moments {
    float n, mean, m2;

    __device__ __forceinline__ void add(float nb, float mb, float m2b) {
        if (nb <= 0.0f) return;
        const float total = n + nb;
        const float d = mb - mean;
        const float f = nb / total;
        mean = fmaf(d, f, mean);
        m2 = m2 + m2b + d * d * n * f;
        n = total;
    }
};

// Pixels of the chunk [p0, p0 + len) that row `row` of `rows` visits (p = p0 + row, += rows).
__device__ __forceinline__ int row_count(int len, int row, int rows) {
    return row < len ? (len - row + rows - 1) / rows : 0;
}

// The stats block, V channels a thread (1, or 8 fp16 in one 16-byte load: C, ldx multiples of 8 and x
// 16-byte aligned). A thread's values are summed shifted by its first one (numerically the variance
// of values near that shift, not of their squares).
template <typename T, int V>
__device__ __forceinline__ void norm_stats(const T* __restrict__ x, float* __restrict__ part, int HW, int C, int ldx,
                                           int chunk) {
    constexpr int LANES = 32 / V, ROWS = NORM_THREADS / LANES;
    __shared__ float s_mean[ROWS][33], s_m2[ROWS][33];  // padded: the final pass reads a column
    const int q = threadIdx.x % LANES, row = threadIdx.x / LANES;
    const int c0 = blockIdx.x * 32, c = c0 + q * V;
    const int k = blockIdx.y, chunks = gridDim.y;
    const long long n = blockIdx.z;
    const int p0 = k * chunk;
    const int len = min(chunk, HW - p0);
    const int cnt = row_count(len, row, ROWS);
    float shift[V], s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) shift[j] = s1[j] = s2[j] = 0.0f;
    if (c < C && cnt > 0) {
        const T* src = x + (n * HW + p0) * ldx + c;
        load_f32s(shift, src + static_cast<long long>(row) * ldx);
#pragma unroll 4
        for (int p = row; p < len; p += ROWS) {
            float v[V];
            load_f32s(v, src + static_cast<long long>(p) * ldx);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float d = v[j] - shift[j];
                s1[j] += d;
                s2[j] = fmaf(d, d, s2[j]);
            }
        }
    }
    const float inv = cnt > 0 ? 1.0f / static_cast<float>(cnt) : 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        s_mean[row][q * V + j] = shift[j] + s1[j] * inv;
        s_m2[row][q * V + j] = fmaxf(s2[j] - s1[j] * s1[j] * inv, 0.0f);
    }
    __syncthreads();
    if (threadIdx.x < 32 && c0 + static_cast<int>(threadIdx.x) < C) {
        Moments m = {0.0f, 0.0f, 0.0f};
        for (int r = 0; r < ROWS; ++r)
            m.add(static_cast<float>(row_count(len, r, ROWS)), s_mean[r][threadIdx.x], s_m2[r][threadIdx.x]);
        float* out = part + ((n * chunks + k) * C + c0 + threadIdx.x) * 2;
        out[0] = m.mean;
        out[1] = m.m2;
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
norm_nhwc_stats_f16(const f16* __restrict__ x, float* __restrict__ part, int N, int H, int W, int C, int ldx,
                    int chunk) {
    if (C % 8 == 0 && ldx % 8 == 0 && aligned16(x)) {  // uniform over the launch
        norm_stats<f16, 8>(x, part, H * W, C, ldx, chunk);
        return;
    }
    norm_stats<f16, 1>(x, part, H * W, C, ldx, chunk);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
norm_nhwc_stats_f32(const float* __restrict__ x, float* __restrict__ part, int N, int H, int W, int C, int ldx,
                    int chunk) {
    norm_stats<float, 1>(x, part, H * W, C, ldx, chunk);
}

// A block per (group, image): the group's chunks x C/G partials, a thread's share merged in order,
// then the threads' summaries pairwise in shared memory.
extern "C" __global__ void __launch_bounds__(NORM_FIN_THREADS)
norm_nhwc_finalize(const float* __restrict__ part, float* __restrict__ mean, float* __restrict__ var, int N, int HW,
                   int C, int G, int chunk, int chunks) {
    __shared__ float s_n[NORM_FIN_THREADS], s_mean[NORM_FIN_THREADS], s_m2[NORM_FIN_THREADS];
    const int g = blockIdx.x, cg = C / G;
    const long long n = blockIdx.y;
    const int items = chunks * cg;
    Moments m = {0.0f, 0.0f, 0.0f};
    for (int i = threadIdx.x; i < items; i += NORM_FIN_THREADS) {
        const int k = i / cg, c = g * cg + (i - k * cg);
        const float* p = part + ((n * chunks + k) * C + c) * 2;
        m.add(static_cast<float>(min(chunk, HW - k * chunk)), p[0], p[1]);
    }
    s_n[threadIdx.x] = m.n;
    s_mean[threadIdx.x] = m.mean;
    s_m2[threadIdx.x] = m.m2;
    __syncthreads();
    for (int half = NORM_FIN_THREADS / 2; half > 0; half /= 2) {
        if (static_cast<int>(threadIdx.x) < half) {
            Moments a = {s_n[threadIdx.x], s_mean[threadIdx.x], s_m2[threadIdx.x]};
            const int o = threadIdx.x + half;
            a.add(s_n[o], s_mean[o], s_m2[o]);
            s_n[threadIdx.x] = a.n;
            s_mean[threadIdx.x] = a.mean;
            s_m2[threadIdx.x] = a.m2;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        mean[n * G + g] = s_mean[0];
        var[n * G + g] = s_n[0] > 0.0f ? s_m2[0] / s_n[0] : 0.0f;
    }
}

// The epilogue every entry shares: normalised v of channel c -> affine, residual, activation.
struct NormEpilogue {
    const float* gamma;
    const float* beta;
    int res, act;
    float p0, p1;

    __device__ __forceinline__ float operator()(float v, int c, float r) const {
        if (gamma != nullptr) v *= gamma[c];
        if (beta != nullptr) v += beta[c];
        if (res == 1) v += r;
        v = dt_activate(v, act, p0, p1);
        return res == 2 ? v + r : v;
    }
};

// The apply pass. Grid (blocks, N): the blocks of image n = blockIdx.y stride over its H*W*C/V work
// items by a multiple of C/V, so a thread keeps one channel vector for the whole pass: its V channels'
// statistics, gamma and beta are read and folded (mean, rsqrt(var + eps) * gamma, beta) once, and the
// pass streams x (and r) in and y out alone. Per-item loads of the statistics and the affine (eight
// times the bytes of an fp16 item) bounded the pass by the load units at 2.6x its memory time.
// The launch (dualtrack.kernels.norm) gives an image at least C/V threads.
template <typename T, int V>
__device__ __forceinline__ void norm_apply(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                           const float* __restrict__ mean, const float* __restrict__ var, int H,
                                           int W, int C, int ldx, int ldr, int ldy, int G, int stat_n, float eps,
                                           const NormEpilogue& ep) {
    const int CV = C / V, cg = C / G;
    const long long HW = static_cast<long long>(H) * W, n = blockIdx.y;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long lanes = threads / CV * CV;  // the threads at work: a multiple of C/V
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= lanes) return;
    const int c = static_cast<int>(i % CV) * V;
    const long long pstep = lanes / CV;
    float mu[V], sc[V], be[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const long long s = n * stat_n + (c + j) / cg;
        mu[j] = mean[s];
        sc[j] = rsqrtf(var[s] + eps) * (ep.gamma != nullptr ? ep.gamma[c + j] : 1.0f);
        be[j] = ep.beta != nullptr ? ep.beta[c + j] : 0.0f;
    }
    for (long long p = n * HW + i / CV, end = (n + 1) * HW; p < end; p += pstep) {
        float v[V], rv[V];
        load_f32s(v, x + p * ldx + c);
        if (ep.res != 0) {
            load_f32s(rv, r + p * ldr + c);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) rv[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float t = fmaf(v[j] - mu[j], sc[j], be[j]);
            v[j] = ep.res == 1 ? t + rv[j] : t;
        }
        dt_activate_n(v, ep.act, ep.p0, ep.p1);  // one dispatch on the activation for the V values
        if (ep.res == 2) {
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] += rv[j];
        }
        store_f32s(y + p * ldy + c, v);
    }
}

// Whether an fp16 entry takes 8 channels a work item (uniform over the launch).
__device__ __forceinline__ bool norm_vec8(const f16* x, const f16* r, const f16* y, int C, int ldx, int ldr, int ldy,
                                          int res) {
    const bool r_ok = res == 0 || (ldr % 8 == 0 && aligned16(r));
    return C % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) && aligned16(y) && r_ok;
}

#define NORM_APPLY_PARAMS(T)                                                                                   \
    (const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y, const float* __restrict__ mean,      \
     const float* __restrict__ var, const float* __restrict__ gamma, const float* __restrict__ beta, int N,    \
     int H, int W, int C, int ldx, int ldr, int ldy, int G, int stat_n, int res, float eps, int act, float p0, \
     float p1)

extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_nhwc_f16 NORM_APPLY_PARAMS(f16) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    if (norm_vec8(x, r, y, C, ldx, ldr, ldy, res)) {
        norm_apply<f16, 8>(x, r, y, mean, var, H, W, C, ldx, ldr, ldy, G, stat_n, eps, ep);
        return;
    }
    norm_apply<f16, 1>(x, r, y, mean, var, H, W, C, ldx, ldr, ldy, G, stat_n, eps, ep);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_nhwc_f32 NORM_APPLY_PARAMS(float) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    norm_apply<float, 1>(x, r, y, mean, var, H, W, C, ldx, ldr, ldy, G, stat_n, eps, ep);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// LayerNorm over channels: a warp per pixel (grid-stride over pixels), lanes over V-channel vectors.
// Two passes for the statistics (the mean, then the squared deviations from it) and one for the
// output; the pixel's C values come from L1 after the first.
template <typename T, int V>
__device__ __forceinline__ void layer_norm(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                           long long pixels, int C, int ldx, int ldr, int ldy, float eps,
                                           const NormEpilogue& ep) {
    const int lane = threadIdx.x % 32;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    const float inv_c = 1.0f / static_cast<float>(C);
    for (long long p = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; p < pixels;
         p += warps) {
        const T* src = x + p * ldx;
        float sum = 0.0f;
        for (int c = lane * V; c < C; c += 32 * V) {
            float v[V];
            load_f32s(v, src + c);
#pragma unroll
            for (int j = 0; j < V; ++j) sum += v[j];
        }
        const float mu = warp_sum(sum) * inv_c;
        float sq = 0.0f;
        for (int c = lane * V; c < C; c += 32 * V) {
            float v[V];
            load_f32s(v, src + c);
#pragma unroll
            for (int j = 0; j < V; ++j) sq = fmaf(v[j] - mu, v[j] - mu, sq);
        }
        const float rs = rsqrtf(warp_sum(sq) * inv_c + eps);
        for (int c = lane * V; c < C; c += 32 * V) {
            float v[V], rv[V];
            load_f32s(v, src + c);
            if (ep.res != 0) {
                load_f32s(rv, r + p * ldr + c);
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) rv[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = ep((v[j] - mu) * rs, c + j, rv[j]);
            store_f32s(y + p * ldy + c, v);
        }
    }
}

#define LAYER_NORM_PARAMS(T)                                                                               \
    (const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y, const float* __restrict__ gamma, \
     const float* __restrict__ beta, int N, int H, int W, int C, int ldx, int ldr, int ldy, int res,       \
     float eps, int act, float p0, float p1)

extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_nhwc_layer_f16 LAYER_NORM_PARAMS(f16) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    const long long pixels = static_cast<long long>(N) * H * W;
    if (norm_vec8(x, r, y, C, ldx, ldr, ldy, res)) {
        layer_norm<f16, 8>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
        return;
    }
    layer_norm<f16, 1>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_nhwc_layer_f32 LAYER_NORM_PARAMS(float) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    layer_norm<float, 1>(x, r, y, static_cast<long long>(N) * H * W, C, ldx, ldr, ldy, eps, ep);
}
