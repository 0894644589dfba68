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
// A group norm is two launches. The statistics are a split reduction, so that one image with a few
// groups of a large picture still fills the GPU (IREE's one-workgroup-per-row reduction did not:
// FACTS 29), and the launch finalizes itself:
//   stats: grid (channel tiles, chunks, N): a block reduces a tile of channels over one chunk of
//          `chunk` pixels (a contiguous slab of x: 16-byte loads, every thread busy for any C; a
//          dense tensor whose C divides a vector's channels read flat, `reps` copies of C a vector)
//          to a partial (mean, M2); a thread keeps sums shifted by its first value, the block's rows
//          meet by Chan's formula in a tree in shared memory. A block that holds all C channels (C/V
//          vectors up to the block's width: every zoo shape) merges each group's channels there too
//          and writes one partial a group, `part` [n][chunk][g]; a wider tensor writes one a channel,
//          [n][chunk][c]. The last block of an image to arrive (a counter per image, after a fence;
//          it resets the counter) merges the image's partials into mean[n*G + g], var[n*G + g]: a
//          team of threads a group, each thread's share merged in order (means as offsets from the
//          group's first), then the team's by Chan's formula. The per-group partials are what keep
//          that last block short: chunks items a group, not chunks x C/G (measured on an H200 in
//          SegResNet's GroupNorms: docs/performance.md);
//   apply: grid (blocks, N) of one wave of the NORM_APPLY_BLOCKS an SM holds, a thread per channel
//          vector (16 bytes: 8 fp16 or 4 fp32 channels) striding over an image's pixels, four loads
//          in flight, with its statistics and affine folded in registers.
// A layer norm is one launch: a team of lanes a pixel holds it in registers (layer_norm_regs).
// Deterministic: the counter picks which block merges, not the order it merges in.
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as a -D macro.

#if !defined(NORM_THREADS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert((NORM_THREADS & (NORM_THREADS - 1)) == 0 && NORM_THREADS >= 64 && NORM_THREADS <= 1024,
              "a power of two: the final merge's teams split the block evenly");

#include "dualtrack_device.cuh"

#define NORM_UNROLL 4  // pixels a thread has in flight (loads issued before the math)
// The apply pass's pixels in flight where a residual is read too (two loads a pixel): two of them
// spill f16's 8-channel vectors under the NORM_APPLY_BLOCKS register bound (80 at 256 threads).
#define NORM_UNROLL_RES 1
#define MERGE_UNROLL 8  // partials a thread of the final merge has in flight (L2 round trips)
// Stats blocks an SM holds: three at 256 threads (at most 85 registers a thread: 72-80 with NVRTC 13.0,
// no spills), three blocks' loads in flight.
#define NORM_STATS_BLOCKS (768 / NORM_THREADS > 0 ? 768 / NORM_THREADS : 1)
// Apply blocks an SM holds: three at 256 threads (at most 80 registers a thread: f16's 8-channel
// vectors, NORM_UNROLL pixels deep, spill under 64), so one wave of them (dualtrack.kernels.norm,
// apply_launch) keeps 48 KB of loads in flight an SM.
#define NORM_APPLY_BLOCKS (768 / NORM_THREADS > 0 ? 768 / NORM_THREADS : 1)

// V channels as loaded (16 bytes, or one element), kept packed until their math: NORM_UNROLL pixels
// in flight then hold half the registers of their fp32 values (fp16), which is what lets a block
// of them share an SM with others.
template <typename T, int V>
struct Raw;

template <>
struct Raw<f16, 8> {
    uint4 q;
    __device__ __forceinline__ void load(const f16* p) { q = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void unpack(float (&v)[8]) const {
        const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = f16_to_f32(static_cast<f16>(words[i] & 0xffffu));
            v[2 * i + 1] = f16_to_f32(static_cast<f16>(words[i] >> 16));
        }
    }
};

template <>
struct Raw<float, 4> {
    float4 q;
    __device__ __forceinline__ void load(const float* p) { q = *reinterpret_cast<const float4*>(p); }
    __device__ __forceinline__ void unpack(float (&v)[4]) const { v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w; }
};

template <typename T>
struct Raw<T, 1> {
    T q;
    __device__ __forceinline__ void load(const T* p) { q = *p; }
    __device__ __forceinline__ void unpack(float (&v)[1]) const { v[0] = load_f32(&q); }
};

// A partial another block wrote in this launch, read from L2 (an SM's L1 is not coherent).
__device__ __forceinline__ float2 load_partial(const float* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
    return v;
}

// A (count, mean, M2) summary of a set of values; `add` merges another (Chan et al.'s pairwise
// update: the means' difference is scaled, never the sums, so values far from 0 keep their precision).
struct Moments {
    float n, mean, m2;

    __device__ __forceinline__ void add(float nb, float mb, float m2b) {
        if (nb <= 0.0f) return;
        const float total = n + nb;
        const float d = mb - mean;
        const float f = __fdividef(nb, total);
        mean = fmaf(d, f, mean);
        m2 = m2 + m2b + d * d * n * f;
        n = total;
    }
};

// Pixels of the chunk [p0, p0 + len) that row `row` of `rows` visits (p = p0 + row, += rows).
__device__ __forceinline__ int row_count(int len, int row, int rows) {
    return row < len ? (len - row + rows - 1) / rows : 0;
}

// The channels a thread of a group-norm launch takes at once: 16 bytes where C, the strides and the
// pointers allow (uniform over the launch), else one.
__device__ __forceinline__ bool vec_ok(const void* p, int ld, int C, int V) {
    return C % V == 0 && ld % V == 0 && aligned16(p);
}

// The shared memory of a stats block: each thread's V partial means and M2s (channel-major, so a
// row of the tree reads consecutive words), its count, the final merge's per-warp summaries, the flag.
template <int V>
struct StatsShared {
    float mean[V * NORM_THREADS], m2[V * NORM_THREADS], n[NORM_THREADS];
    float warp[3][NORM_THREADS / 32];
    int last;
};

// One tile of channels over the block's chunk: row `row` of the block sums pixels p0 + row, += rows
// of its V channels shifted by its first value, then the rows merge pairwise (a tree: log2(rows)
// steps) and row 0 writes the chunk's partial (mean, M2) of each channel.
template <typename T, int V>
__device__ __forceinline__ void stats_tile(const T* __restrict__ src, float* __restrict__ out, int c, int C, int ldx,
                                           int len, int row, int rows, int cols, StatsShared<V>& sh) {
    const bool busy = row < rows && c < C;
    const int cnt = busy ? row_count(len, row, rows) : 0;
    float shift[V], s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) shift[j] = s1[j] = s2[j] = 0.0f;
    if (cnt > 0) {
        src += c;
        load_f32s(shift, src + static_cast<long long>(row) * ldx);
        // The last step's loads past the chunk are skipped, not left to a one-at-a-time tail: a row
        // of a one-wave launch sums only a few steps (10 pixels a row at 256x256 x 16 channels, N=8).
        for (int p = row; p < len; p += NORM_UNROLL * rows) {
            Raw<T, V> raw[NORM_UNROLL];
#pragma unroll
            for (int u = 0; u < NORM_UNROLL; ++u) {
                if (p + u * rows < len) raw[u].load(src + static_cast<long long>(p + u * rows) * ldx);
            }
#pragma unroll
            for (int u = 0; u < NORM_UNROLL; ++u) {
                if (p + u * rows < len) {
                    float v[V];
                    raw[u].unpack(v);
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        const float d = v[j] - shift[j];
                        s1[j] += d;
                        s2[j] = fmaf(d, d, s2[j]);
                    }
                }
            }
        }
    }
    const float fn = static_cast<float>(cnt), inv = cnt > 0 ? 1.0f / fn : 0.0f;
    Moments m[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        m[j] = {fn, shift[j] + s1[j] * inv, fmaxf(s2[j] - s1[j] * s1[j] * inv, 0.0f)};
        sh.mean[j * NORM_THREADS + threadIdx.x] = m[j].mean;
        sh.m2[j * NORM_THREADS + threadIdx.x] = m[j].m2;
    }
    sh.n[threadIdx.x] = fn;
    int top = 1;
    while (top < rows) top *= 2;
    for (int half = top / 2; half > 0; half /= 2) {
        __syncthreads();  // the previous step's writes (rows < 2 half) are in
        if (row < half && row + half < rows) {  // reads rows >= half, which this step does not write
            const int o = threadIdx.x + half * cols;
            const float nb = sh.n[o];
#pragma unroll
            for (int j = 0; j < V; ++j) {
                m[j].add(nb, sh.mean[j * NORM_THREADS + o], sh.m2[j * NORM_THREADS + o]);
                sh.mean[j * NORM_THREADS + threadIdx.x] = m[j].mean;
                sh.m2[j * NORM_THREADS + threadIdx.x] = m[j].m2;
            }
            sh.n[threadIdx.x] = m[0].n;
        }
    }
    __syncthreads();  // the tree is done before the next tile writes shared memory
    if (out != nullptr && row == 0 && c < C) {  // per-channel partials (null: the block merges groups)
#pragma unroll
        for (int j = 0; j < V; ++j) reinterpret_cast<float2*>(out)[c + j] = make_float2(m[j].mean, m[j].m2);
    }
}

// Merge a team's S summaries (S a power of two dividing the block; uniform) into its first thread:
// shuffles within a warp, then the team's warps in shared memory. Every thread of the block calls it.
template <int V>
__device__ __forceinline__ Moments team_merge(Moments m, int S, StatsShared<V>& sh) {
    const int width = S < 32 ? S : 32;
    for (int off = 1; off < width; off *= 2) {
        const float nb = __shfl_xor_sync(0xffffffffu, m.n, off);
        const float mb = __shfl_xor_sync(0xffffffffu, m.mean, off);
        const float m2b = __shfl_xor_sync(0xffffffffu, m.m2, off);
        m.add(nb, mb, m2b);
    }
    if (S <= 32) return m;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        sh.warp[0][warp] = m.n;
        sh.warp[1][warp] = m.mean;
        sh.warp[2][warp] = m.m2;
    }
    __syncthreads();
    if (threadIdx.x % S == 0) {
        for (int w = 1; w < S / 32; ++w) m.add(sh.warp[0][warp + w], sh.warp[1][warp + w], sh.warp[2][warp + w]);
    }
    __syncthreads();  // read before the next round writes
    return m;
}

// The team width for G groups of `items` summaries each: the widest power of two with a team for
// every group while the block lasts, no wider than the items (uniform).
__device__ __forceinline__ int team_width(int G, int items) {
    int S = 1;
    while (S * 2 <= NORM_THREADS / G && S < items) S *= 2;
    return S;
}

// A block holding all C channels of its chunk (one tile, row 0's summaries in shared memory after
// stats_tile: channel c = col V + j at sh[j][col]) -> one (mean, M2) partial a group of the Cr real
// channels into out[g]: the group's reps x cg channels (copy r of real channel g cg + i is flat channel
// r Cr + g cg + i), each of `len` pixels, merged by a team as finalize_image merges (means as offsets
// from the group's first channel). Every thread of the block calls it.
template <int V>
__device__ __forceinline__ void group_partials(float* __restrict__ out, int len, int C, int Cr, int G,
                                               StatsShared<V>& sh) {
    const int cg = Cr / G, items = C / Cr * cg, S = team_width(G, items);
    const int teams = NORM_THREADS / S, team = threadIdx.x / S, lane = threadIdx.x % S;
    const float fn = static_cast<float>(len);
    for (int g0 = 0; g0 < G; g0 += teams) {  // uniform: team_merge synchronizes the block
        const int g = g0 + team;
        Moments m = {0.0f, 0.0f, 0.0f};
        float shift = 0.0f;
        if (g < G) {
            shift = sh.mean[g * cg % V * NORM_THREADS + g * cg / V];
            for (int i = lane; i < items; i += S) {
                const int copy = i / cg, f = copy * Cr + g * cg + (i - copy * cg);
                const int at = f % V * NORM_THREADS + f / V;
                m.add(fn, sh.mean[at] - shift, sh.m2[at]);
            }
        }
        m = team_merge(m, S, sh);
        if (g < G && lane == 0) reinterpret_cast<float2*>(out)[g] = make_float2(shift + m.mean, m.m2);
    }
}

// Where item i of group g lies among an image's partials [chunk][C]: chunk k = i / (reps cg), then
// the group's channel j % cg in copy j / cg of the Cr real channels (the C = reps Cr channels of the
// flat view repeat them; reps = 1 otherwise).
__device__ __forceinline__ long long item_offset(int i, int g, int cg, int reps_cg, int C, int Cr, int& k) {
    k = i / reps_cg;
    const int j = i - k * reps_cg, copy = j / cg;
    return static_cast<long long>(k) * C + copy * Cr + g * cg + (j - copy * cg);
}

// The last block of image n: its chunks x C partials -> mean, var of each of its G groups of the Cr
// real channels. A team of S threads a group (S: the largest power of two with a team for every
// group while the block lasts, no wider than the group's items), each thread merging items lane,
// lane + S, ... in order.
// GROUPED: the partials are one a group ([chunk][G], each of reps x cg channels' pixels:
// group_partials), not one a channel (two instantiations: the item arithmetic of one adds no
// registers to the other's unrolled loads).
template <int V, bool GROUPED>
__device__ __forceinline__ void finalize_image(const float* __restrict__ part, float* __restrict__ mean,
                                               float* __restrict__ var, long long n, int HW, int C, int Cr, int G,
                                               int chunk, int chunks, StatsShared<V>& sh) {
    const int cg = Cr / G, reps_cg = C / Cr * cg, items = GROUPED ? chunks : chunks * reps_cg;
    const int S = team_width(G, items);
    const int teams = NORM_THREADS / S, team = threadIdx.x / S, lane = threadIdx.x % S;
    // One partial's place and pixel count: item i is chunk i of group g ([chunk][G]), or item_offset's.
    const int per = GROUPED ? reps_cg : 1;
    auto at = [&](int i, int g, int& k) -> long long {
        if (GROUPED) {
            k = i;
            return static_cast<long long>(i) * G + g;
        }
        return item_offset(i, g, cg, reps_cg, C, Cr, k);
    };
    const float* img = part + n * chunks * (GROUPED ? G : C) * 2;
    for (int g0 = 0; g0 < G; g0 += teams) {  // uniform: team_merge synchronizes the block
        const int g = g0 + team;
        Moments m = {0.0f, 0.0f, 0.0f}, m_odd = {0.0f, 0.0f, 0.0f};  // two chains of dependent merges
        float shift = 0.0f;
        if (g < G) {
            // Means merged as offsets from the group's first partial mean: each merge rounds the mean
            // it updates, which near 100 is 7.6e-6 a step, and a chain of them walks; one rounding
            // of shift + offset at the end instead.
            int k0;
            shift = load_partial(img + 2 * at(0, g, k0)).x;
            int i = lane;
            for (; i + (MERGE_UNROLL - 1) * S < items; i += MERGE_UNROLL * S) {
                float2 pm[MERGE_UNROLL];
                int k[MERGE_UNROLL];
#pragma unroll
                for (int u = 0; u < MERGE_UNROLL; ++u)
                    pm[u] = load_partial(img + 2 * at(i + u * S, g, k[u]));
#pragma unroll
                for (int u = 0; u < MERGE_UNROLL; ++u) {
                    const float count = static_cast<float>(min(chunk, HW - k[u] * chunk) * per);
                    (u % 2 ? m_odd : m).add(count, pm[u].x - shift, pm[u].y);
                }
            }
            m.add(m_odd.n, m_odd.mean, m_odd.m2);
            for (; i < items; i += S) {
                int k;
                const float2 pm = load_partial(img + 2 * at(i, g, k));
                m.add(static_cast<float>(min(chunk, HW - k * chunk) * per), pm.x - shift, pm.y);
            }
        }
        m = team_merge(m, S, sh);
        if (g < G && lane == 0) {
            mean[n * G + g] = shift + m.mean;
            var[n * G + g] = m.n > 0.0f ? m.m2 / m.n : 0.0f;
        }
    }
}

// The stats launch. Grid (tiles, chunks, N): a tile is `cols` channel vectors (all C/V of them up to
// the block's width), the block's threads `rows` rows of `cols` (idle beyond rows x cols); a block
// takes tiles blockIdx.x, += gridDim.x, so any grid width covers the channels. HW pixels of C
// channels: the tensor's, or its flat view (C = reps Cr: a dense tensor of Cr | V channels read as
// V-channel pixels, so each load is 16 bytes and every lane busy).
template <typename T, int V>
__device__ __forceinline__ void norm_stats(const T* __restrict__ x, float* __restrict__ part, float* __restrict__ mean,
                                           float* __restrict__ var, int* __restrict__ arrivals, int HW, int C,
                                           int Cr, int ldx, int G, int chunk) {
    __shared__ StatsShared<V> sh;
    const int cv = C / V, cols = min(cv, NORM_THREADS), rows = NORM_THREADS / cols;
    const int tiles = (cv + cols - 1) / cols;
    const int col = threadIdx.x % cols, row = threadIdx.x / cols;
    const int k = blockIdx.y, chunks = gridDim.y;
    const long long n = blockIdx.z;
    const int p0 = k * chunk, len = min(chunk, HW - p0);
    const T* src = x + (n * HW + p0) * ldx;
    const bool grouped = tiles == 1 && gridDim.x == 1;  // uniform: the block holds every channel
    float* out = grouped ? nullptr : part + (n * chunks + k) * C * 2;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x)
        stats_tile<T, V>(src, out, (tile * cols + col) * V, C, ldx, len, row, rows, cols, sh);
    if (grouped) group_partials<V>(part + (n * chunks + k) * G * 2, min(chunk, HW - p0), C, Cr, G, sh);
    // Arrive: the partials are visible device-wide before the count that lets a block read them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) sh.last = atomicAdd(arrivals + n, 1) == static_cast<int>(gridDim.x * gridDim.y) - 1;
    __syncthreads();
    if (!sh.last) return;
    if (threadIdx.x == 0) arrivals[n] = 0;  // every block of image n has arrived: ready for the next launch
    __threadfence();
    if (grouped)
        finalize_image<V, true>(part, mean, var, n, HW, C, Cr, G, chunk, chunks, sh);
    else
        finalize_image<V, false>(part, mean, var, n, HW, C, Cr, G, chunk, chunks, sh);
}

#define NORM_STATS_PARAMS(T)                                                                               \
    (const T* __restrict__ x, float* __restrict__ part, float* __restrict__ mean, float* __restrict__ var, \
     int* __restrict__ arrivals, int N, int H, int W, int C, int ldx, int G, int chunk, int reps)

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_STATS_BLOCKS)
norm_nhwc_stats_f16 NORM_STATS_PARAMS(f16) {
    if (reps > 1) {  // the flat view, as dualtrack.kernels.norm planned it (flat_reps)
        norm_stats<f16, 8>(x, part, mean, var, arrivals, H * W / reps, C * reps, C, C * reps, G, chunk);
        return;
    }
    if (vec_ok(x, ldx, C, 8)) {
        norm_stats<f16, 8>(x, part, mean, var, arrivals, H * W, C, C, ldx, G, chunk);
        return;
    }
    norm_stats<f16, 1>(x, part, mean, var, arrivals, H * W, C, C, ldx, G, chunk);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_STATS_BLOCKS)
norm_nhwc_stats_f32 NORM_STATS_PARAMS(float) {
    if (reps > 1) {
        norm_stats<float, 4>(x, part, mean, var, arrivals, H * W / reps, C * reps, C, C * reps, G, chunk);
        return;
    }
    if (vec_ok(x, ldx, C, 4)) {
        norm_stats<float, 4>(x, part, mean, var, arrivals, H * W, C, C, ldx, G, chunk);
        return;
    }
    norm_stats<float, 1>(x, part, mean, var, arrivals, H * W, C, C, ldx, G, chunk);
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

// One channel vector of the apply pass: v = act(fma(v - mu, sc, be) (+ rv)) (+ rv), rv read only
// where the residual mode adds it.
template <int V>
__device__ __forceinline__ void apply_vec(float (&v)[V], const float (&rv)[V], const float (&mu)[V],
                                          const float (&sc)[V], const float (&be)[V], const NormEpilogue& ep) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const float t = fmaf(v[j] - mu[j], sc[j], be[j]);
        v[j] = ep.res == 1 ? t + rv[j] : t;
    }
    // One dispatch on the activation for the V values; the calls of the others are apply_stream_calls'.
    if (ep.act <= DT_ACT_LEAKYRELU) dt_activate_n(v, ep.act, ep.p0, ep.p1);
    if (ep.res == 2) {
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] += rv[j];
    }
}

// The apply pass's stream: from pixel p (of the flat pixel index over the batch), += pstep up to end,
// U pixels' loads (x, and r where a residual is added) issued before their math. The last step's
// loads past `end` are skipped rather than left to a one-at-a-time tail loop: a thread of a big
// launch streams only a few steps, and with a tail most of them ran one load in flight
// (bench/results/kernel_profile-11f2885-h100-a.json: 340 us against 275 of the one-load kernel).
template <typename T, int V, int U>
__device__ __forceinline__ void apply_stream(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                             long long p, long long end, long long pstep, int c, int ldx, int ldr,
                                             int ldy, const float (&mu)[V], const float (&sc)[V], const float (&be)[V],
                                             const NormEpilogue& ep) {
    for (; p < end; p += U * pstep) {
        Raw<T, V> xs[U], rs[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (p + u * pstep < end) xs[u].load(x + (p + u * pstep) * ldx + c);
        }
        if (ep.res != 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (p + u * pstep < end) rs[u].load(r + (p + u * pstep) * ldr + c);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (p + u * pstep < end) {
                float v[V], rv[V];
                xs[u].unpack(v);
                if (ep.res != 0) {
                    rs[u].unpack(rv);
                } else {
#pragma unroll
                    for (int j = 0; j < V; ++j) rv[j] = 0.0f;
                }
                apply_vec(v, rv, mu, sc, be, ep);
                store_f32s(y + (p + u * pstep) * ldy + c, v);
            }
        }
    }
}

// The apply stream of the activations dt_activate_rest computes (a call a value, whose registers come
// on top of the caller's live ones): the thread's folded statistics and its pixel's normalised values
// wait in shared memory, its own column (volatile: read back, not kept in registers), so that only the
// loop's addresses are held across the calls and the entry stays within NORM_APPLY_BLOCKS' register
// bound without spilling. Row k of the column (mu, sc, be, then the values) holds value j at
// (k V + j) NORM_THREADS.
// apply_stream_calls' shared memory: one array an entry (four rows of a 16-byte vector's channels a
// thread), whichever V it takes, so that NORM_APPLY_BLOCKS of them fit an SM of 100 KB (sm_86, sm_89).
template <typename T>
__device__ __forceinline__ float* apply_column() {
    __shared__ float s_col[4 * (16 / sizeof(T)) * NORM_THREADS];
    return s_col;
}

template <typename T, int V>
__device__ __forceinline__ void apply_stream_calls(const T* __restrict__ x, const T* __restrict__ r,
                                                   T* __restrict__ y, long long p, long long end, long long pstep,
                                                   int c, int ldx, int ldr, int ldy, const float (&mu)[V],
                                                   const float (&sc)[V], const float (&be)[V],
                                                   const NormEpilogue& ep) {
    static_assert(V <= 16 / sizeof(T), "the column holds a 16-byte vector's channels");
    volatile float* col = apply_column<T>() + threadIdx.x;
    volatile float* val = col + 3 * V * NORM_THREADS;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        col[j * NORM_THREADS] = mu[j];
        col[(V + j) * NORM_THREADS] = sc[j];
        col[(2 * V + j) * NORM_THREADS] = be[j];
    }
    for (; p < end; p += pstep) {
        float v[V], rv[V];
        load_f32s(v, x + p * ldx + c);
        if (ep.res == 1) {
            load_f32s(rv, r + p * ldr + c);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) rv[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float t = fmaf(v[j] - col[j * NORM_THREADS], col[(V + j) * NORM_THREADS],
                                 col[(2 * V + j) * NORM_THREADS]);
            val[j * NORM_THREADS] = ep.res == 1 ? t + rv[j] : t;
        }
#pragma unroll 1
        for (int j = 0; j < V; ++j) {
            val[j * NORM_THREADS] = dt_activate_rest(val[j * NORM_THREADS], ep.act, ep.p0, ep.p1);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = val[j * NORM_THREADS];
        if (ep.res == 2) {
            load_f32s(rv, r + p * ldr + c);
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] += rv[j];
        }
        store_f32s(y + p * ldy + c, v);
    }
}

// The apply pass. Grid (blocks, N): the blocks of image n = blockIdx.y stride over its H*W*C/V work
// items by a multiple of C/V, so a thread keeps one channel vector for the whole pass: its V channels'
// statistics, gamma and beta are read and folded (mean, rsqrt(var + eps) * gamma, beta) once, and the
// pass streams x (and r) in and y out alone: NORM_UNROLL pixels' loads in flight a thread, or
// NORM_UNROLL_RES pixels' of x and r (the registers of NORM_APPLY_BLOCKS blocks an SM), or one
// pixel's where the activation is a call.
// The launch (dualtrack.kernels.norm) gives an image at least C threads, so any V finds C/V. HW
// pixels of C channels: the tensor's, or its flat view (C = reps Cr, as the stats launch's), channel
// c of the layout being real channel c % Cr.
template <typename T, int V>
__device__ __forceinline__ void norm_apply(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                           const float* __restrict__ mean, const float* __restrict__ var,
                                           long long HW, int C, int Cr, int ldx, int ldr, int ldy, int G, int stat_n,
                                           float eps, const NormEpilogue& ep) {
    const int CV = C / V, cg = Cr / G;
    const long long n = blockIdx.y;
    const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long lanes = threads / CV * CV;  // the threads at work: a multiple of C/V
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= lanes) return;
    const int c = static_cast<int>(i % CV) * V;
    const long long pstep = lanes / CV;
    float mu[V], sc[V], be[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int cr = (c + j) % Cr;
        const long long s = n * stat_n + cr / cg;
        mu[j] = mean[s];
        sc[j] = rsqrtf(var[s] + eps) * (ep.gamma != nullptr ? ep.gamma[cr] : 1.0f);
        be[j] = ep.beta != nullptr ? ep.beta[cr] : 0.0f;
    }
    const long long p = n * HW + i / CV, end = (n + 1) * HW;
    if (ep.act > DT_ACT_LEAKYRELU) {
        apply_stream_calls<T, V>(x, r, y, p, end, pstep, c, ldx, ldr, ldy, mu, sc, be, ep);
    } else if (ep.res != 0) {
        apply_stream<T, V, NORM_UNROLL_RES>(x, r, y, p, end, pstep, c, ldx, ldr, ldy, mu, sc, be, ep);
    } else {
        apply_stream<T, V, NORM_UNROLL>(x, r, y, p, end, pstep, c, ldx, ldr, ldy, mu, sc, be, ep);
    }
}

// Whether an entry takes V channels a work item (uniform over the launch): 16-byte accesses of x,
// y and a residual.
__device__ __forceinline__ bool norm_vec(const void* x, const void* r, const void* y, int C, int ldx, int ldr,
                                         int ldy, int res, int V) {
    return vec_ok(x, ldx, C, V) && vec_ok(y, ldy, C, V) && (res == 0 || vec_ok(r, ldr, C, V));
}

// The flat view's copies of the C channels in a V-channel vector (V / C), where C divides V, every
// tensor is dense and 16-byte aligned and an image is whole vectors; else 1 (dualtrack.kernels.norm's
// flat_reps decides the same for the stats launch).
__device__ __forceinline__ int flat_reps(const void* x, const void* r, const void* y, long long HW, int C, int ldx,
                                         int ldr, int ldy, int res, int V) {
    const bool dense = ldx == C && ldy == C && (res == 0 || ldr == C);
    const bool ok = C < V && V % C == 0 && dense && HW % (V / C) == 0;
    return ok && aligned16(x) && aligned16(y) && (res == 0 || aligned16(r)) ? V / C : 1;
}

#define NORM_APPLY_PARAMS(T)                                                                                   \
    (const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y, const float* __restrict__ mean,      \
     const float* __restrict__ var, const float* __restrict__ gamma, const float* __restrict__ beta, int N,    \
     int H, int W, int C, int ldx, int ldr, int ldy, int G, int stat_n, int res, float eps, int act, float p0, \
     float p1)

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_APPLY_BLOCKS) norm_nhwc_f16 NORM_APPLY_PARAMS(f16) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    const long long HW = static_cast<long long>(H) * W;
    const int reps = flat_reps(x, r, y, HW, C, ldx, ldr, ldy, res, 8);
    if (reps > 1) {
        norm_apply<f16, 8>(x, r, y, mean, var, HW / reps, 8, C, 8, 8, 8, G, stat_n, eps, ep);
        return;
    }
    if (norm_vec(x, r, y, C, ldx, ldr, ldy, res, 8)) {
        norm_apply<f16, 8>(x, r, y, mean, var, HW, C, C, ldx, ldr, ldy, G, stat_n, eps, ep);
        return;
    }
    norm_apply<f16, 1>(x, r, y, mean, var, HW, C, C, ldx, ldr, ldy, G, stat_n, eps, ep);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_APPLY_BLOCKS) norm_nhwc_f32 NORM_APPLY_PARAMS(float) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    const long long HW = static_cast<long long>(H) * W;
    const int reps = flat_reps(x, r, y, HW, C, ldx, ldr, ldy, res, 4);
    if (reps > 1) {
        norm_apply<float, 4>(x, r, y, mean, var, HW / reps, 4, C, 4, 4, 4, G, stat_n, eps, ep);
        return;
    }
    if (norm_vec(x, r, y, C, ldx, ldr, ldy, res, 4)) {
        norm_apply<float, 4>(x, r, y, mean, var, HW, C, C, ldx, ldr, ldy, G, stat_n, eps, ep);
        return;
    }
    norm_apply<float, 1>(x, r, y, mean, var, HW, C, C, ldx, ldr, ldy, G, stat_n, eps, ep);
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
        const float shift = load_f32(src);  // channel 0: the mean as a deviation from it (layer_norm_regs)
        float sum = 0.0f;
        for (int c = lane * V; c < C; c += 32 * V) {
            float v[V];
            load_f32s(v, src + c);
#pragma unroll
            for (int j = 0; j < V; ++j) sum += v[j] - shift;
        }
        const float mu = fmaf(warp_sum(sum), inv_c, shift);
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

// Sums over the L lanes of a team, of P values at once (L a power of two up to 32, teams aligned
// within the warp; every lane of the warp calls it).
template <int P>
__device__ __forceinline__ void team_sums(float (&v)[P], int L) {
    for (int d = 1; d < L; d *= 2) {
#pragma unroll
        for (int q = 0; q < P; ++q) v[q] += __shfl_xor_sync(0xffffffffu, v[q], d);
    }
}

// The most channels the register path takes (LAYER_MAX_K vectors a lane of a warp-wide team).
#define LAYER_MAX_K 4
#define LAYER_MAX_C (LAYER_MAX_K * 32 * 8)
// LayerNorm blocks an SM holds: two at 256 threads (at most 128 registers: no spills with NVRTC 13.0
// for sm_90a and sm_120; compute_80's code spills under that bound, so it takes what it needs).
#if __CUDA_ARCH__ >= 900
#define NORM_LAYER_BLOCKS (512 / NORM_THREADS > 0 ? 512 / NORM_THREADS : 1)
#else
#define NORM_LAYER_BLOCKS 1
#endif

// LayerNorm over channels with the pixels in registers: a team of L lanes a pixel (L = C/V rounded
// up to a power of two, at most a warp), lane l holding vectors l, l + L, ... (K of them) packed, so
// x is read once: the mean, then the squared deviations from it (exact two-pass statistics), then
// the output, all from registers. A team takes P pixels a step (K * P = 4 vectors a lane in flight,
// the apply pass's depth); a warp's 32/L teams take 32/L neighbouring pixels at each of the P, and
// the warp steps uniformly (the shuffles see every lane), grid-stride over the pixels. gamma and beta
// (1 and 0 where null) sit in shared memory, loaded once a block: in registers they cost 64 at K = 4.
template <typename T, int V, int K, int P>
__device__ __forceinline__ void layer_norm_regs(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                                long long pixels, int C, int ldx, int ldr, int ldy, int L, float eps,
                                                const NormEpilogue& ep, float* __restrict__ s_g,
                                                float* __restrict__ s_b) {
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        s_g[c] = ep.gamma != nullptr ? ep.gamma[c] : 1.0f;
        s_b[c] = ep.beta != nullptr ? ep.beta[c] : 0.0f;
    }
    __syncthreads();
    const int cv = C / V, lane = threadIdx.x % L, team = (threadIdx.x % 32) / L, per_warp = 32 / L;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    const long long warp = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const float inv_c = 1.0f / static_cast<float>(C);
    for (long long base = warp * per_warp * P; base < pixels; base += warps * per_warp * P) {
        long long p[P];
        bool ok[P][K];
        Raw<T, V> xs[P][K];
#pragma unroll
        for (int q = 0; q < P; ++q) {
            p[q] = base + q * per_warp + team;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                ok[q][k] = p[q] < pixels && lane + k * L < cv;
                if (ok[q][k]) {
                    xs[q][k].load(x + p[q] * ldx + (lane + k * L) * V);
                } else {
                    xs[q][k] = Raw<T, V>{};  // zeros: lane 0's channel 0 is read for the shift below
                }
            }
        }
        // The mean as the pixel's channel 0 plus the mean deviation from it: a sum of values far from
        // 0 would lose their spread (mean 100, std 0.01: fp32's ulp of the sum is 0.001).
        float shift[P], mu[P], sq[P];
#pragma unroll
        for (int q = 0; q < P; ++q) {
            float v0[V];
            xs[q][0].unpack(v0);
            shift[q] = __shfl_sync(0xffffffffu, v0[0], team * L);  // lane 0 of the team: channel 0
            mu[q] = 0.0f;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (ok[q][k]) {
                    float v[V];
                    xs[q][k].unpack(v);
#pragma unroll
                    for (int j = 0; j < V; ++j) mu[q] += v[j] - shift[q];
                }
            }
        }
        team_sums(mu, L);
#pragma unroll
        for (int q = 0; q < P; ++q) {
            mu[q] = fmaf(mu[q], inv_c, shift[q]);
            sq[q] = 0.0f;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (ok[q][k]) {
                    float v[V];
                    xs[q][k].unpack(v);
#pragma unroll
                    for (int j = 0; j < V; ++j) sq[q] = fmaf(v[j] - mu[q], v[j] - mu[q], sq[q]);
                }
            }
        }
        team_sums(sq, L);
#pragma unroll
        for (int q = 0; q < P; ++q) {
            const float rstd = rsqrtf(sq[q] * inv_c + eps);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (!ok[q][k]) continue;
                const int c = (lane + k * L) * V;
                float v[V], rv[V];
                xs[q][k].unpack(v);
                if (ep.res != 0) load_f32s(rv, r + p[q] * ldr + c);  // here: 16 registers fewer held
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float t = fmaf((v[j] - mu[q]) * rstd, s_g[c + j], s_b[c + j]);
                    v[j] = ep.res == 1 ? t + rv[j] : t;
                }
                dt_activate_n(v, ep.act, ep.p0, ep.p1);
                if (ep.res == 2) {
#pragma unroll
                    for (int j = 0; j < V; ++j) v[j] += rv[j];
                }
                store_f32s(y + p[q] * ldy + c, v);
            }
        }
    }
}

// One LayerNorm entry's dispatch: teams of L = C/V rounded up to a power of two (at most 32) lanes,
// K = C/V / L vectors a lane from 1 to LAYER_MAX_K (and C within the shared gamma and beta), else a
// warp a pixel from L1.
template <typename T, int V>
__device__ __forceinline__ void layer_norm_any(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y,
                                               long long pixels, int C, int ldx, int ldr, int ldy, float eps,
                                               const NormEpilogue& ep) {
    __shared__ float s_g[LAYER_MAX_C], s_b[LAYER_MAX_C];  // one pair for every K: a launch takes one
    const int cv = C / V;
    int L = 1;
    while (L < cv && L < 32) L *= 2;
    switch (C <= LAYER_MAX_C ? (cv + L - 1) / L : 0) {
        case 1: layer_norm_regs<T, V, 1, 4>(x, r, y, pixels, C, ldx, ldr, ldy, L, eps, ep, s_g, s_b); return;
        case 2: layer_norm_regs<T, V, 2, 2>(x, r, y, pixels, C, ldx, ldr, ldy, L, eps, ep, s_g, s_b); return;
        case 3: layer_norm_regs<T, V, 3, 1>(x, r, y, pixels, C, ldx, ldr, ldy, L, eps, ep, s_g, s_b); return;
        case 4: layer_norm_regs<T, V, 4, 1>(x, r, y, pixels, C, ldx, ldr, ldy, L, eps, ep, s_g, s_b); return;
        default: layer_norm<T, V>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
    }
}

#define LAYER_NORM_PARAMS(T)                                                                               \
    (const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ y, const float* __restrict__ gamma, \
     const float* __restrict__ beta, int N, int H, int W, int C, int ldx, int ldr, int ldy, int res,       \
     float eps, int act, float p0, float p1)

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_LAYER_BLOCKS)
norm_nhwc_layer_f16 LAYER_NORM_PARAMS(f16) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    const long long pixels = static_cast<long long>(N) * H * W;
    if (norm_vec(x, r, y, C, ldx, ldr, ldy, res, 8)) {
        layer_norm_any<f16, 8>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
        return;
    }
    layer_norm_any<f16, 1>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS, NORM_LAYER_BLOCKS)
norm_nhwc_layer_f32 LAYER_NORM_PARAMS(float) {
    const NormEpilogue ep = {gamma, beta, res, act, p0, p1};
    const long long pixels = static_cast<long long>(N) * H * W;
    if (norm_vec(x, r, y, C, ldx, ldr, ldy, res, 4)) {
        layer_norm_any<float, 4>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
        return;
    }
    layer_norm_any<float, 1>(x, r, y, pixels, C, ldx, ldr, ldy, eps, ep);
}
