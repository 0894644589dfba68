// The general conv's `_stem` entries (conv_nhwc_f16_stem, _stem_narrow): fp16 convolutions of few
// input channels (C <= 8, group 1: an RGB or grayscale first layer, 7x7 stride 2 and the like) on
// the tensor cores. The implicit GEMM's tiles gather such a layer's A tile element by element, once
// per tap (R*S times per input byte); here a block owns TP output rows x 32 output columns x BN
// output channels, stages the input patch those pixels read ONCE in shared memory, and builds the
// mma.sync m16n8k16 A fragments from the patch through a per-k offset table.
//
// Shared memory (dynamic; ConvStem.shared_bytes in dualtrack.kernels.conv_stem computes the same):
//   region  the patch, [PH][PW][CP] halves, CP = C rounded up to even (channels past C are zero),
//           PH = (TP-1)*sh + (R-1)*dh + 1, PW = 31*sw + (S-1)*dw + 1; after the MMAs the same bytes
//           hold the epilogue tile, [BM][EPN+8] fp32 (EPN = 32 channels a pass);
//   weights [BN][KP+8] halves: the block's BN filters with k = (r*S + s)*CP + c, zero past C, past
//           R*S*CP (KP: that rounded up to 16) and past K; rows padded by 16 bytes so the B
//           fragments' 4-byte loads hit 32 distinct banks;
//   table   [KP/2] ints: for the k pair (2j, 2j+1) (same tap, channels c, c+1: CP is even) its word
//           offset in the patch from an output pixel's (0,0) tap. Pairs past R*S*CP point at the
//           (0,0) tap itself: their weights are zero, and that input is one the true sum reads, so
//           a non-finite input spreads exactly as it does in the reference.
// A block loads its weights and table once and walks output tiles (grid-stride over grid.x);
// grid.y walks the K tiles. Several blocks an SM overlap one block's patch loads with another's
// MMAs. Epilogue (conv_nhwc's, in passes of 32 channels): accumulators plus bias through an fp32
// tile, then the residual, the activation and one rounding a chunk of 8 channels, 16-byte accesses
// where the strides and pointers allow.
//
// Included by conv_nhwc.cu after its convg namespace (convg::Problem is the ABI's argument list).

#pragma once

namespace stem {

// TP output rows a block (one warp each, two m16 tiles of its 32 columns), BN output channels.
template <int TP_, int BN_, int MIN_BLOCKS_>
struct Tile {
    enum : int {
        TP = TP_,
        TQ = 32,
        BM = TP_ * 32,
        BN = BN_,
        NT = BN_ / 8,  // n8 tiles a warp (each warp computes all BN channels of its row)
        MT = 2,        // m16 tiles a warp
        THREADS = 32 * TP_,
        EPN = BN_ < 32 ? BN_ : 32,  // channels an epilogue pass
        EPP = EPN + 8,              // epilogue tile row, floats
        MIN_BLOCKS = MIN_BLOCKS_,
    };
    static_assert(BN_ % 8 == 0 && BN_ % EPN == 0, "BN is whole n8 tiles and epilogue passes");
};

// The shared-memory layout of one launch (byte offsets of the weights and the table).
struct Layout {
    int CP, KK, KP, KPS, PH, PW, weights, table;
};

__device__ __forceinline__ int round_up(int v, int m) { return (v + m - 1) / m * m; }

template <class T>
__device__ __forceinline__ Layout layout(const convg::Problem& p) {
    Layout L;
    L.CP = p.C + (p.C & 1);
    L.KK = p.R * p.S * L.CP;
    L.KP = round_up(L.KK, 16);
    L.KPS = L.KP + 8;
    L.PH = (T::TP - 1) * p.sh + (p.R - 1) * p.dh + 1;
    L.PW = (T::TQ - 1) * p.sw + (p.S - 1) * p.dw + 1;
    const int patch = L.PH * L.PW * L.CP * 2, epi = T::BM * T::EPP * 4;
    L.weights = round_up(patch > epi ? patch : epi, 16);
    L.table = L.weights + T::BN * L.KPS * 2;
    return L;
}

// The block's filters n0 .. n0+BN-1 from KRSC (R*S*C a filter) into [BN][KPS], zero-padded.
template <class T>
__device__ __forceinline__ void load_weights(const f16* __restrict__ w, const convg::Problem& p, const Layout& L,
                                             int n0, f16* ws) {
    for (int i = threadIdx.x; i < T::BN * L.KP; i += T::THREADS) {
        const int n = i / L.KP, k = i - n * L.KP;
        const int tap = k / L.CP, c = k - tap * L.CP;
        const int kn = n0 + n;
        f16 v = 0;
        if (kn < p.K && k < L.KK && c < p.C) v = w[static_cast<long long>(kn) * p.Kg + tap * p.C + c];
        ws[n * L.KPS + k] = v;
    }
}

template <class T>
__device__ __forceinline__ void build_table(const convg::Problem& p, const Layout& L, int* table) {
    const int cw = L.CP / 2;
    for (int j = threadIdx.x; j < L.KP / 2; j += T::THREADS) {
        const int k = 2 * j;
        int off = 0;
        if (k < L.KK) {
            const int tap = k / L.CP, c = k - tap * L.CP;
            const int r = tap / p.S, s = tap - r * p.S;
            off = (r * p.dh * L.PW + s * p.dw) * cw + c / 2;
        }
        table[j] = off;
    }
}

// The patch of image n from input row h0, column w0 (zero outside the image and past C), a pixel a
// thread at a time: its C channels are neighbours in memory, so a warp's loads share cache lines.
// LOADS pixels' loads are issued before any is stored, so their latencies overlap.
template <class T>
__device__ __forceinline__ void load_patch(const f16* __restrict__ x, const convg::Problem& p, const Layout& L, int n,
                                           int h0, int w0, unsigned* patch) {
    enum : int { LOADS = 4 };
    const int cw = L.CP / 2;
    const int pixels = L.PH * L.PW;
    for (int i0 = threadIdx.x; i0 < pixels; i0 += LOADS * T::THREADS) {
        unsigned v[LOADS][4];  // CP <= 8: at most 4 words a pixel
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = i0 + u * T::THREADS;
            const int ph = i / L.PW, pw = i - ph * L.PW;
            const int h = h0 + ph, wc = w0 + pw;
            const bool in = i < pixels && static_cast<unsigned>(h) < static_cast<unsigned>(p.H) &&
                            static_cast<unsigned>(wc) < static_cast<unsigned>(p.W);
            const long long at = in ? (static_cast<long long>(n) * p.H + h) * p.W + wc : 0;
            const f16* src = x + at * p.ldx;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int c = 2 * q;
                const f16 lo = (in && c < p.C) ? src[c] : f16(0);
                const f16 hi = (in && c + 1 < p.C) ? src[c + 1] : f16(0);
                v[u][q] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
            }
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = i0 + u * T::THREADS;
            if (i >= pixels) break;
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (q < cw) patch[i * cw + q] = v[u][q];
        }
    }
}

// acc += the tile's GEMM: warp wm's row of 32 pixels x BN channels over KP columns.
template <class T>
__device__ __forceinline__ void tile_mma(const unsigned* patch, const f16* ws, const int* table, const Layout& L,
                                         const convg::Problem& p, float (&acc)[T::MT][T::NT][4]) {
    const int lane = threadIdx.x & 31, wm = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int cw = L.CP / 2;
    // Word offset of the (0,0) tap of this lane's pixels: tile row wm, columns mt*16 + g (+8).
    int base[T::MT][2];
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            base[mt][half] = (wm * p.sh * L.PW + (mt * 16 + g + 8 * half) * p.sw) * cw;
    const unsigned* wsw = reinterpret_cast<const unsigned*>(ws);
    const int row_w = L.KPS / 2;  // words a weight row
    for (int kk = 0; kk < L.KP / 16; ++kk) {
        // A fragment (row-major 16x16): a0 (row g, k pair tig), a1 (row g+8), a2/a3 the same at k+8.
        const int o0 = table[kk * 8 + tig], o1 = table[kk * 8 + 4 + tig];
        unsigned a[T::MT][4];
#pragma unroll
        for (int mt = 0; mt < T::MT; ++mt) {
            a[mt][0] = patch[base[mt][0] + o0];
            a[mt][1] = patch[base[mt][1] + o0];
            a[mt][2] = patch[base[mt][0] + o1];
            a[mt][3] = patch[base[mt][1] + o1];
        }
#pragma unroll
        for (int nt = 0; nt < T::NT; ++nt) {
            // B fragment (col-major 16x8): b0 = (k pair tig, n g), b1 = the same at k+8.
            const unsigned* wr = wsw + (nt * 8 + g) * row_w + kk * 8 + tig;
            const unsigned b0 = wr[0], b1 = wr[4];
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt) mma_16816(acc[mt][nt], a[mt], b0, b1);
        }
    }
}

// One 16-byte chunk out: v (8 channels from k, fp32 sums with bias) plus the residual, through the
// activation, rounded once; 16-byte accesses where the strides and pointers allow, else element-wise.
__device__ __forceinline__ void store_chunk(float (&v)[8], const f16* __restrict__ res, f16* __restrict__ y,
                                            const convg::Problem& p, long long pix, int k, bool vec_r, bool vec_y) {
    const bool full = k + 8 <= p.K;
    if (res != nullptr) {
        const f16* rp = res + (pix * p.ldr + k);
        if (vec_r && full) {
            float r[8];
            load_f16x8(r, rp);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] += r[e];
        } else {
            for (int e = 0; e < 8 && k + e < p.K; ++e) v[e] += f16_to_f32(rp[e]);
        }
    }
    dt_activate_n(v, p.act, p.p0, p.p1);
    f16* dst = y + (pix * p.ldy + k);
    if (vec_y && full) {
        store_f16x8(dst, v);
    } else {
        for (int e = 0; e < 8 && k + e < p.K; ++e) dst[e] = f32_to_f16(v[e]);
    }
}

// The tile's epilogue in passes of EPN channels: accumulators plus bias into the fp32 tile (rows of
// EPN + 8 floats: conflict-free float2 stores), then chunks of 8 channels out through store_chunk.
template <class T>
__device__ __forceinline__ void epilogue(const float (&acc)[T::MT][T::NT][4], const float* __restrict__ bias,
                                         const f16* __restrict__ res, f16* __restrict__ y, const convg::Problem& p,
                                         int n, int op0, int oq0, int n0, float* tile) {
    const int lane = threadIdx.x & 31, wm = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    enum : int { CHUNKS = T::EPN / 8 };
    const bool vec_y = p.ldy % 8 == 0 && aligned16(y);
    const bool vec_r = res != nullptr && p.ldr % 8 == 0 && aligned16(res);
    for (int pass = 0; pass < T::BN / T::EPN; ++pass) {
        if (pass > 0) __syncthreads();  // the previous pass's stores have read the tile
#pragma unroll
        for (int nt = 0; nt < T::NT; ++nt) {
            if (nt * 8 / T::EPN != pass) continue;  // a condition, not a loop bound: acc stays in registers
            const int col = nt * 8 + tig * 2;
            const int k = n0 + col;
            const float b0 = (bias != nullptr && k < p.K) ? bias[k] : 0.f;
            const float b1 = (bias != nullptr && k + 1 < p.K) ? bias[k + 1] : 0.f;
            const int local = col - pass * T::EPN;
#pragma unroll
            for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = wm * T::TQ + mt * 16 + g + 8 * half;
                    *reinterpret_cast<float2*>(tile + row * T::EPP + local) =
                        make_float2(acc[mt][nt][2 * half] + b0, acc[mt][nt][2 * half + 1] + b1);
                }
        }
        __syncthreads();
        for (int u = threadIdx.x; u < T::BM * CHUNKS; u += T::THREADS) {
            const int row = u / CHUNKS, q8 = (u - row * CHUNKS) * 8;
            const int o_p = op0 + row / T::TQ, o_q = oq0 + row % T::TQ;
            const int k = n0 + pass * T::EPN + q8;
            if (o_p >= p.P || o_q >= p.Q || k >= p.K) continue;
            float v[8];
            const float4 lo = *reinterpret_cast<const float4*>(tile + row * T::EPP + q8);
            const float4 hi = *reinterpret_cast<const float4*>(tile + row * T::EPP + q8 + 4);
            v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
            const long long pix = (static_cast<long long>(n) * p.P + o_p) * p.Q + o_q;
            store_chunk(v, res, y, p, pix, k, vec_r, vec_y);
        }
    }
}

template <class T>
__device__ __forceinline__ void conv(const f16* __restrict__ x, const f16* __restrict__ w,
                                     const float* __restrict__ bias, const f16* __restrict__ res, f16* __restrict__ y,
                                     const convg::Problem& p, unsigned char* smem) {
    const Layout L = layout<T>(p);
    unsigned* patch = reinterpret_cast<unsigned*>(smem);
    float* tile = reinterpret_cast<float*>(smem);  // the epilogue's, once the MMAs have read the patch
    f16* ws = reinterpret_cast<f16*>(smem + L.weights);
    int* table = reinterpret_cast<int*>(smem + L.table);
    const int n0 = blockIdx.y * T::BN;
    load_weights<T>(w, p, L, n0, ws);
    build_table<T>(p, L, table);
    const int tiles_p = (p.P + T::TP - 1) / T::TP, tiles_q = (p.Q + T::TQ - 1) / T::TQ;
    const int tiles = p.N * tiles_p * tiles_q;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int tq = t % tiles_q, rest = t / tiles_q;
        const int tp = rest % tiles_p, n = rest / tiles_p;
        const int op0 = tp * T::TP, oq0 = tq * T::TQ;
        __syncthreads();  // weights and table written (first tile); the last tile's stores have read the tile
        load_patch<T>(x, p, L, n, op0 * p.sh - p.pt, oq0 * p.sw - p.pl, patch);
        __syncthreads();
        float acc[T::MT][T::NT][4];
#pragma unroll
        for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
        tile_mma<T>(patch, ws, table, L, p, acc);
        __syncthreads();  // every warp has read the patch: the epilogue tile overwrites it
        epilogue<T>(acc, bias, res, y, p, n, op0, oq0, n0, tile);
    }
}

}  // namespace stem
