// Depthwise convolution (ONNX Conv with group == C, K = M*C: channel multiplier M, weights
// (K, 1, R, S)), NHWC, bias and an activation fused:
//   y[n,ho,wo,k] = act(bias[k] + sum_{r,s} x[n, ho*sh - pt + r*dh, wo*sw - pl + s*dw, k / M] * w[r,s,k])
// for any R x S kernel (1..7 a side: ConvNeXt's 7x7, 1xk / kx1 factorised ones), strides sh/sw >= 1,
// dilations dh/dw >= 1 and top/left padding pt, pl (taps outside the image read 0; the output size
// Ho x Wo comes from the caller, so bottom/right padding is implied). Output channel k reads input
// channel k / M (ONNX's group k / M of one input channel). act, p0, p1: dt_activate
// (dualtrack_activations.cuh, generated from dualtrack.contract.activations).
//
// Memory-bound (R*S FMAs per output element): work items are output pixel x channel, channel
// fastest, so a warp reads neighbouring channels of one tap (coalesced) and the R*S taps of
// neighbouring output pixels overlap in L1. fp16 with M = 1, C and the strides multiples of 8 (and
// 16-byte aligned pointers) takes 8 channels an item (16-byte loads and stores); else one. Weights
// are packed RSK (w[(r*S + s)*K + k], the activation dtype) so they coalesce the same way; bias fp32
// or null; fp32 accumulation, one rounding. The tap loops are unrolled for the square 3x3 and 5x5
// kernels of MobileNets; other sizes loop (the loads, not the loop, bound this kernel).
// No toolkit #include: see conv3x3_nhwc.cu. The block size comes from dualtrack.kernels as -D macros.

#if !defined(DWCONV_THREADS) || !defined(DW_ROW)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

#include "dualtrack_device.cuh"

struct DwProblem {
    int N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, M, act;
    float p0, p1;
};

// Every element (pixel, channel) is one work item, or with V = 8 (the fp16 vector path, M = 1) every
// 8 neighbouring channels of one output pixel, so each tap is one 16-byte load of x and one of w and
// the result one 16-byte store (needs C, ldx, ldy multiples of 8 and x, w, y 16-byte aligned:
// dwconv_vec8). Per channel the same fmaf chain either way (bias first, taps in r, s order), so the
// two paths give bit-identical results. A grid-stride loop covers the items, so any grid is correct
// and the host's grid only sets how many items a thread takes (dualtrack.kernels.dwconv sizes it
// for the vector path when C and the strides allow it). RT > 0: an RT x RT kernel, unrolled.
template <typename T, int RT, int V>
__device__ __forceinline__ void dwconv(const T* __restrict__ x, const T* __restrict__ w,
                                       const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    const int R = RT > 0 ? RT : p.R, S = RT > 0 ? RT : p.S;
    const int K = p.C * p.M;
    const int KV = K / V;
    const long long total = static_cast<long long>(p.N) * p.Ho * p.Wo * KV;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, p.Ho, p.Wo, KV);
        const int k = o.c * V, ho = o.h, wo = o.w;
        const int c = k / p.M;                  // V > 1 only with M == 1: channels k..k+V-1 of x
        const long long n = o.n, pix = o.p;    // image, output pixel

        const int h0 = ho * p.sh - p.pt, w0 = wo * p.sw - p.pl;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = bias != nullptr ? bias[k + j] : 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int h = h0 + r * p.dh;
            if (h < 0 || h >= p.H) continue;
            const T* row = x + ((n * p.H + h) * p.W) * static_cast<long long>(p.ldx) + c;
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int wi = w0 + s * p.dw;
                if (wi < 0 || wi >= p.W) continue;
                float xv[V], wv[V];
                load_f32s(xv, row + static_cast<long long>(wi) * p.ldx);
                load_f32s(wv, w + (r * S + s) * K + k);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = fmaf(xv[j], wv[j], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = dt_activate(acc[j], p.act, p.p0, p.p1);
        store_f32s(y + pix * p.ldy + k, acc);
    }
}

// Stride 1, dilation 1 along W (ConvNeXt's 7x7, MobileNet's 3x3 and 5x5): a work item is DW_ROW
// neighbouring output pixels of one row, so the S + DW_ROW - 1 input pixels of a kernel row are loaded
// once for all of them and each weight once a row, instead of every tap of every output loading both
// (the loads, not the FMAs, bounded the per-pixel path). Per output the same fmaf chain as dwconv
// (bias first, taps in r, s order, out-of-image taps skipped): bit-identical results. The host's grid
// (dualtrack.kernels.dwconv) counts items of DW_ROW pixels where this path runs.
template <typename T, int RT, int V>
__device__ __forceinline__ void dwconv_rows(const T* __restrict__ x, const T* __restrict__ w,
                                            const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    constexpr int B = DW_ROW, S = RT, TAPS = RT + DW_ROW - 1;
    const int K = p.C, KV = K / V, WB = (p.Wo + B - 1) / B;
    const long long total = static_cast<long long>(p.N) * p.Ho * WB * KV;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const NhwcIndex o = nhwc_index(idx, p.Ho, WB, KV);
        const int k = o.c * V, ho = o.h, wo0 = o.w * B;
        const long long n = o.n;
        const int h0 = ho * p.sh - p.pt, w0 = wo0 - p.pl;
        float acc[B][V];
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int j = 0; j < V; ++j) acc[b][j] = bias != nullptr ? bias[k + j] : 0.0f;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            const int h = h0 + r * p.dh;
            if (h < 0 || h >= p.H) continue;
            const T* row = x + ((n * p.H + h) * p.W) * static_cast<long long>(p.ldx) + k;
            float wv[S][V];
#pragma unroll
            for (int s = 0; s < S; ++s) load_f32s(wv[s], w + (r * S + s) * K + k);
#pragma unroll
            for (int i = 0; i < TAPS; ++i) {
                const int wi = w0 + i;
                if (wi < 0 || wi >= p.W) continue;
                float xv[V];
                load_f32s(xv, row + static_cast<long long>(wi) * p.ldx);
                // Input pixel i is tap s = i - b of output b: ascending s for each output, as dwconv.
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const int s = i - b;
                    if (s < 0 || s >= S) continue;
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[b][j] = fmaf(xv[j], wv[s][j], acc[b][j]);
                }
            }
        }
        const long long pix = (n * p.Ho + ho) * static_cast<long long>(p.Wo) + wo0;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (wo0 + b >= p.Wo) break;
#pragma unroll
            for (int j = 0; j < V; ++j) acc[b][j] = dt_activate(acc[b][j], p.act, p.p0, p.p1);
            store_f32s(y + (pix + b) * p.ldy + k, acc[b]);
        }
    }
}

// Whether the fp16 vector path applies (uniform over the launch, so no divergence).
__device__ __forceinline__ bool dwconv_vec8(const f16* x, const f16* w, const f16* y, const DwProblem& p) {
    return p.M == 1 && p.C % 8 == 0 && p.ldx % 8 == 0 && p.ldy % 8 == 0 && aligned16(x) && aligned16(w) &&
           aligned16(y);
}

// Whether dwconv_rows takes the launch: a square 3, 5 or 7 kernel, stride and dilation 1 along W, no
// channel multiplier (dualtrack.kernels.dwconv's `row_path` says the same for the grid).
__device__ __forceinline__ bool dwconv_row_path(const DwProblem& p) {
    return p.M == 1 && p.R == p.S && (p.R == 3 || p.R == 5 || p.R == 7) && p.sw == 1 && p.dw == 1;
}

template <typename T, int V>
__device__ __forceinline__ void dwconv_any(const T* __restrict__ x, const T* __restrict__ w,
                                           const float* __restrict__ bias, T* __restrict__ y, const DwProblem& p) {
    const bool square = p.R == p.S;
    if (dwconv_row_path(p)) {
        if (p.R == 3) {
            dwconv_rows<T, 3, V>(x, w, bias, y, p);
        } else if (p.R == 5) {
            dwconv_rows<T, 5, V>(x, w, bias, y, p);
        } else {
            dwconv_rows<T, 7, V>(x, w, bias, y, p);
        }
    } else if (square && p.R == 3) {
        dwconv<T, 3, V>(x, w, bias, y, p);
    } else if (square && p.R == 5) {
        dwconv<T, 5, V>(x, w, bias, y, p);
    } else {
        dwconv<T, 0, V>(x, w, bias, y, p);
    }
}

// The epilogue's activation with GELU (erf and tanh forms: SegFormer's Mix-FFN puts one after each of
// its depthwise 3x3s) inlined: dt_activate calls it out of line, with the other rare ones, and a 3x3's
// nine FMAs an output are no match for a call and erff.
__device__ __forceinline__ float dw_activate(float v, const DwProblem& p) {
    if (p.act == DT_ACT_GELU) return dt_act_gelu(v, p.p0, p.p1);
    if (p.act == DT_ACT_GELU_TANH) return dt_act_gelu_tanh(v, p.p0, p.p1);
    return dt_activate(v, p.act, p.p0, p.p1);
}

// ---- The tiled path (fp16, dilation 1, stride 1 or 2 the same both ways, no channel multiplier:
// ConvNeXt's 7x7, SegFormer's and MobileNet's 3x3 / 5x5 of either stride, the factorised 1xk / kx1).
// The paths above read every tap from global memory through L1, one thread's taps one after another:
// on an H100 ConvNeXt-tiny's 18 depthwise 7x7 layers took 1.81 ms at batch 8, latency-bound. Here a
// block first copies the input patch its TH x DW_TILE_W output pixels x DW_TILE_C channels need
// (((TH - 1) * SD + R) x ((DW_TILE_W - 1) * SD + S) pixels at stride SD, zeros outside the image and
// past C) into shared memory as fp32: a thread's 16-byte loads are issued together (a stride-2 patch's
// in up to two rounds) before the first is converted, and each element is converted once (an fp16 patch
// converted at each of its R * S uses measured 2x slower on the H100: the conversions, not the FMAs,
// bound it). Then each thread computes DW_TILE_B neighbouring outputs of one row for two channels,
// sliding the kernel row along a window of (B - 1) * SD + S patch pixels (one 8-byte shared load each;
// output b's tap s is pixel b * SD + s) with its channels' R x S weights in registers. Per output the
// same fmaf chain as the paths above (bias first, taps in r, s order); a tap outside the image adds
// 0 * w instead of being skipped, so results match them up to the sign of a zero. Two entries:
// DW_TILE_H rows (a bigger patch per block: less halo), and DW_TILE_H_SHORT rows (twice the blocks, for
// launches too small to fill the GPU otherwise); at stride 2 each takes half its rows, so its patch has
// about the stride-1 rows and twice the columns (a 7x7's tall patch: 21 x 37 pixels, 97 KiB: two blocks
// a Hopper SM, and within the 99 KiB an sm_120 block may take). The host
// (dualtrack.kernels.dwconv.DwConvSpec.tile_path, tile_launch, tile_choice) takes them only where those
// conditions hold and x, w, y are 16-byte aligned with C, ldx, ldy multiples of 8; the grid is (output
// tiles x N, channel blocks), the dynamic shared memory the patch (over 48 KiB for the larger ones: the
// runtime opts in).
#if defined(DW_TILE_H)
namespace dwtile {  // an enum, not constexpr ints: NVRTC emits namespace-scope constants as device globals
enum : int { TW = DW_TILE_W, TC = DW_TILE_C, B = DW_TILE_B, THREADS = DW_TILE_THREADS };
enum : int { PAIRS = TC / 2, SLOTS = THREADS / PAIRS, CHUNKS = TC / 8 };
enum : int { MAXK = 7 };  // R, S at most (dualtrack.kernels.dwconv.MAX_KERNEL)
static_assert(TC % 8 == 0 && THREADS % PAIRS == 0 && TW % B == 0, "dwconv tile sizes");
static_assert(DW_TILE_H % 2 == 0 && DW_TILE_H_SHORT % 2 == 0, "dwconv tile rows: halved at stride 2");
static_assert((DW_TILE_H / 2 * (TW / B)) % SLOTS == 0 && (DW_TILE_H_SHORT / 2 * (TW / B)) % SLOTS == 0,
              "dwconv strips");
}  // namespace dwtile

__device__ __forceinline__ float2 f16x2_to_f32x2(unsigned u) {
    return make_float2(f16_to_f32(static_cast<f16>(u & 0xffffu)), f16_to_f32(static_cast<f16>(u >> 16)));
}

// TH output rows a block at stride SD (1 or 2, both axes); RT, ST > 0: an RT x ST kernel, unrolled
// exactly; 0: p.R x p.S (1..7), unrolled to 7 with guards.
template <int TH, int SD, int RT, int ST>
__device__ __forceinline__ void dwconv_tile(const f16* __restrict__ x, const f16* __restrict__ w,
                                            const float* __restrict__ bias, f16* __restrict__ y, const DwProblem& p,
                                            float* __restrict__ patch) {
    using namespace dwtile;
    constexpr int RM = RT > 0 ? RT : MAXK, SM = ST > 0 ? ST : MAXK;
    constexpr int STRIPS = TH * (TW / B);
    constexpr int WIN = (B - 1) * SD + SM;  // patch pixels under a strip's B outputs
    // Loads a thread issues for the largest patch ((TH - 1) * SD + 7) x ((TW - 1) * SD + 7), in rounds.
    constexpr int LOADS = (((TH - 1) * SD + RM) * ((TW - 1) * SD + SM) * CHUNKS + THREADS - 1) / THREADS;
    // At most as many in flight as the entry's stride-1 patch has (its TH * SD rows): the stride-2
    // instances then need no more registers than the stride-1 ones the entry was sized for.
    constexpr int LOADS1 = ((TH * SD + MAXK - 1) * (TW + MAXK - 1) * CHUNKS + THREADS - 1) / THREADS;
    constexpr int ROUND = LOADS < LOADS1 ? LOADS : LOADS1;
    const int R = RT > 0 ? RT : p.R, S = ST > 0 ? ST : p.S;
    const int IW = (TW - 1) * SD + S, IH = (TH - 1) * SD + R;
    const int tiles_w = (p.Wo + TW - 1) / TW, tiles_h = (p.Ho + TH - 1) / TH;
    int t = blockIdx.x;
    const int wo0 = (t % tiles_w) * TW;
    t /= tiles_w;
    const int ho0 = (t % tiles_h) * TH;
    const long long n = t / tiles_h;
    const int c0 = blockIdx.y * TC;
    const int hi0 = ho0 * SD - p.pt, wi0 = wo0 * SD - p.pl;

    // The patch: pixel (r, c) at (r * IW + c) * TC floats; a piece outside the image or past C is zeros.
    const int items = IH * IW * CHUNKS;
#pragma unroll 1  // a round's stores before the next round's loads: ROUND registers of loads, not LOADS
    for (int u0 = 0; u0 < LOADS; u0 += ROUND) {
        uint4 v[ROUND];
#pragma unroll
        for (int u = 0; u < ROUND; ++u) {
            const int it = threadIdx.x + (u0 + u) * THREADS;
            const int px = it / CHUNKS, c = c0 + (it % CHUNKS) * 8;
            const int h = hi0 + px / IW, wi = wi0 + px % IW;
            v[u] = make_uint4(0u, 0u, 0u, 0u);
            if (it < items && h >= 0 && h < p.H && wi >= 0 && wi < p.W && c < p.C) {
                const long long at = ((n * p.H + h) * p.W + wi) * static_cast<long long>(p.ldx) + c;
                v[u] = *reinterpret_cast<const uint4*>(x + at);
            }
        }
#pragma unroll
        for (int u = 0; u < ROUND; ++u) {
            const int it = threadIdx.x + (u0 + u) * THREADS;
            if (it < items) {
                const float2 a = f16x2_to_f32x2(v[u].x), b = f16x2_to_f32x2(v[u].y);
                const float2 c = f16x2_to_f32x2(v[u].z), d = f16x2_to_f32x2(v[u].w);
                float4* dst = reinterpret_cast<float4*>(patch + it * 8);  // pixel * TC + chunk * 8
                dst[0] = make_float4(a.x, a.y, b.x, b.y);
                dst[1] = make_float4(c.x, c.y, d.x, d.y);
            }
        }
    }

    // This thread's two channels k, k + 1 (C % 8 == 0: a pair is wholly in or past C).
    const int pair = threadIdx.x % PAIRS, slot = threadIdx.x / PAIRS;
    const int k = c0 + 2 * pair;
    const bool live = k < p.C;
    float2 wt[RM][SM];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int s = 0; s < SM; ++s)
            wt[r][s] = live && r < R && s < S ? f16x2_to_f32x2(*reinterpret_cast<const unsigned*>(w + (r * S + s) * p.C + k))
                                              : make_float2(0.0f, 0.0f);
    const float2 b0 = live && bias != nullptr ? make_float2(bias[k], bias[k + 1]) : make_float2(0.0f, 0.0f);
    __syncthreads();
    if (!live) return;  // no barrier below

    for (int j = slot; j < STRIPS; j += SLOTS) {
        const int orow = j / (TW / B), ocol = (j % (TW / B)) * B;
        const int ho = ho0 + orow;
        if (ho >= p.Ho || wo0 + ocol >= p.Wo) continue;
        float2 acc[B];
#pragma unroll
        for (int b = 0; b < B; ++b) acc[b] = b0;
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            if (RT == 0 && r >= R) break;
            const float* row = patch + ((orow * SD + r) * IW + ocol * SD) * TC + 2 * pair;
#pragma unroll
            for (int i = 0; i < WIN; ++i) {
                if (ST == 0 && i >= (B - 1) * SD + S) break;
                const float2 xv = *reinterpret_cast<const float2*>(row + i * TC);
                // Patch pixel i is tap s = i - b * SD of output b: ascending s for each output.
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const int s = i - b * SD;
                    if (s < 0 || s >= SM || (ST == 0 && s >= S)) continue;
                    acc[b].x = fmaf(xv.x, wt[r][s].x, acc[b].x);
                    acc[b].y = fmaf(xv.y, wt[r][s].y, acc[b].y);
                }
            }
        }
        f16* out = y + ((n * p.Ho + ho) * p.Wo + wo0 + ocol) * static_cast<long long>(p.ldy) + k;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (wo0 + ocol + b >= p.Wo) break;
            const unsigned lo = f32_to_f16(dw_activate(acc[b].x, p));
            const unsigned hi = f32_to_f16(dw_activate(acc[b].y, p));
            *reinterpret_cast<unsigned*>(out + b * static_cast<long long>(p.ldy)) = lo | (hi << 16);
        }
    }
}

// SQUARE3: the 3x3 entries' one instance; else every window, the 3x3 too (where DwConvSpec.tile3 is
// off, the host's default until the 3x3 entries are measured on a GPU). Apart, the 3x3's registers are its
// own: inlined beside the 7x7's 49 weight pairs it runs at the 7x7's 214 registers a thread on sm_90a, two
// 128-thread blocks an SM.
template <int TH, int SD, bool SQUARE3>
__device__ __forceinline__ void dwconv_tile_kernel(const f16* __restrict__ x, const f16* __restrict__ w,
                                                   const float* __restrict__ bias, f16* __restrict__ y,
                                                   const DwProblem& p, float* __restrict__ patch) {
    if (SQUARE3) {
        if (p.R != 3 || p.S != 3) __trap();  // a host bug, stopped loudly
        dwconv_tile<TH, SD, 3, 3>(x, w, bias, y, p, patch);
    } else if (p.R == 3 && p.S == 3) {
        dwconv_tile<TH, SD, 3, 3>(x, w, bias, y, p, patch);
    } else if (p.R == 5 && p.S == 5) {
        dwconv_tile<TH, SD, 5, 5>(x, w, bias, y, p, patch);
    } else if (p.R == 7 && p.S == 7) {
        dwconv_tile<TH, SD, 7, 7>(x, w, bias, y, p, patch);
    } else {
        dwconv_tile<TH, SD, 0, 0>(x, w, bias, y, p, patch);
    }
}

// TH: the entry's rows at stride 1; stride 2 takes TH / 2 (the host's DwConvSpec.tile_rows).
template <int TH, bool SQUARE3>
__device__ __forceinline__ void dwconv_tile_any(const f16* __restrict__ x, const f16* __restrict__ w,
                                                const float* __restrict__ bias, f16* __restrict__ y,
                                                const DwProblem& p, float* __restrict__ patch) {
    // The host's conditions (DwConvSpec.tile_path); a launch that breaks them is a host bug, stopped loudly.
    if (p.M != 1 || p.sh != p.sw || (p.sh != 1 && p.sh != 2) || p.dh != 1 || p.dw != 1 || p.R > dwtile::MAXK ||
        p.S > dwtile::MAXK || p.C % 8 != 0)
        __trap();
    if (p.sh == 1) {
        dwconv_tile_kernel<TH, 1, SQUARE3>(x, w, bias, y, p, patch);
    } else {
        dwconv_tile_kernel<TH / 2, 2, SQUARE3>(x, w, bias, y, p, patch);
    }
}
#endif  // DW_TILE_H

// ---- The column path (fp16, a 3x3 kernel, stride 1 or 2 the same both ways, dilation 1, no channel
// multiplier, C, ldx, ldy multiples of 8 and x, w, y 16-byte aligned: SegFormer's Mix-FFN and
// MobileNet's 3x3s). The tiles above convert their patch to fp32 in shared memory and give a thread
// two channels: on an H100 SegFormer-b2's Mix-FFN 3x3s (256..2048 channels) ran at about a third of
// the memory's rate. Here nothing is staged: a thread owns 8 neighbouring channels (16-byte loads and
// stores) of one output column and TH output rows, with its channels' 9 weights in registers (fp32),
// and walks the (TH - 1) * SD + 3 input rows once, top to bottom: each row's three taps (one 16-byte
// load each, the neighbouring columns' threads reading the same pixels through L1) go into every
// output row whose window holds that row, so an output's accumulator lives for three input rows and
// each input row is read from memory once a block. A block is (channel vectors, columns): threadIdx.x
// the vector, so a warp reads one pixel's channels (or several whole pixels) in one stretch. Per output
// the same fmaf chain as the paths above (bias first, taps in r, s order; a tap outside the image adds
// 0 * w, as the tiles do). The host (dualtrack.kernels.dwconv.DwConvSpec.cols_path, cols_launch,
// cols_choice) takes it where those conditions hold; the grid is (column strips x row tiles x N,
// channel blocks), the block (vectors a block, columns), at most DW_COLS_THREADS threads.
#if defined(DW_COLS_H)
static_assert(DW_COLS_H % 2 == 0 && DW_COLS_H_SHORT % 2 == 0, "dwconv column rows: halved at stride 2");

template <int TH, int SD>
__device__ __forceinline__ void dwconv_cols(const f16* __restrict__ x, const f16* __restrict__ w,
                                            const float* __restrict__ bias, f16* __restrict__ y, const DwProblem& p) {
    constexpr int R = 3, S = 3, V = 8, ROWS = (TH - 1) * SD + R;
    const int cols = blockDim.y;
    const int tiles_w = (p.Wo + cols - 1) / cols, tiles_h = (p.Ho + TH - 1) / TH;
    int t = blockIdx.x;
    const int wo = (t % tiles_w) * cols + threadIdx.y;
    t /= tiles_w;
    const int ho0 = (t % tiles_h) * TH;
    const long long n = t / tiles_h;
    const int k = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (k >= p.C || wo >= p.Wo) return;  // no barrier in this path

    float wt[R][S][V];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int s = 0; s < S; ++s) load_f32s(wt[r][s], w + (r * S + s) * p.C + k);
    float acc[TH][V];
#pragma unroll
    for (int b = 0; b < TH; ++b)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[b][j] = bias != nullptr ? bias[k + j] : 0.0f;

    const int hi0 = ho0 * SD - p.pt, wi0 = wo * SD - p.pl;
    const f16* base = x + n * p.H * p.W * static_cast<long long>(p.ldx) + k;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int h = hi0 + i;
        if (h < 0 || h >= p.H) continue;  // the row's taps add 0 * w: skipped, results up to a zero's sign
        const f16* row = base + static_cast<long long>(h) * p.W * p.ldx;
        float xv[S][V];
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int wi = wi0 + s;
            if (wi >= 0 && wi < p.W) {
                load_f32s(xv[s], row + static_cast<long long>(wi) * p.ldx);
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) xv[s][j] = 0.0f;
            }
        }
        // Input row i is kernel row r = i - b * SD of output row b: ascending r for each output.
#pragma unroll
        for (int b = 0; b < TH; ++b) {
            const int r = i - b * SD;
            if (r < 0 || r >= R) continue;
#pragma unroll
            for (int s = 0; s < S; ++s)
#pragma unroll
                for (int j = 0; j < V; ++j) acc[b][j] = fmaf(xv[s][j], wt[r][s][j], acc[b][j]);
        }
    }
#pragma unroll
    for (int b = 0; b < TH; ++b) {
        const int ho = ho0 + b;
        if (ho >= p.Ho) break;
#pragma unroll
        for (int j = 0; j < V; ++j) acc[b][j] = dw_activate(acc[b][j], p);
        store_f32s(y + ((n * p.Ho + ho) * p.Wo + wo) * static_cast<long long>(p.ldy) + k, acc[b]);
    }
}

// TH: the entry's rows at stride 1; stride 2 takes TH / 2 (the host's DwConvSpec.cols_rows).
template <int TH>
__device__ __forceinline__ void dwconv_cols_any(const f16* __restrict__ x, const f16* __restrict__ w,
                                                const float* __restrict__ bias, f16* __restrict__ y,
                                                const DwProblem& p) {
    // The host's conditions (DwConvSpec.cols_path); a launch that breaks them is a host bug, stopped loudly.
    if (p.M != 1 || p.R != 3 || p.S != 3 || p.sh != p.sw || (p.sh != 1 && p.sh != 2) || p.dh != 1 ||
        p.dw != 1 || !dwconv_vec8(x, w, y, p))
        __trap();
    if (p.sh == 1) {
        dwconv_cols<TH, 1>(x, w, bias, y, p);
    } else {
        dwconv_cols<TH / 2, 2>(x, w, bias, y, p);
    }
}
#endif  // DW_COLS_H

#define DWCONV_PARAMS(T)                                                                                    \
    const T *__restrict__ x, const T *__restrict__ w, const float *__restrict__ bias, T *__restrict__ y,   \
        int N, int H, int W, int C, int Ho, int Wo, int ldx, int ldy, int R, int S, int sh, int sw, int dh, \
        int dw, int pt, int pl, int M, int act, float p0, float p1

#define DWCONV_PROBLEM DwProblem{N, H, W, C, Ho, Wo, ldx, ldy, R, S, sh, sw, dh, dw, pt, pl, M, act, p0, p1}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS) dwconv_nhwc_f16(DWCONV_PARAMS(f16)) {
    const DwProblem p = DWCONV_PROBLEM;
    if (dwconv_vec8(x, w, y, p)) {
        dwconv_any<f16, 8>(x, w, bias, y, p);
    } else {
        dwconv_any<f16, 1>(x, w, bias, y, p);
    }
}

extern "C" __global__ void __launch_bounds__(DWCONV_THREADS) dwconv_nhwc_f32(DWCONV_PARAMS(float)) {
    dwconv_any<float, 1>(x, w, bias, y, DWCONV_PROBLEM);
}

#if defined(DW_TILE_H)
extern "C" __global__ void __launch_bounds__(DW_TILE_THREADS) dwconv_nhwc_f16_tile(DWCONV_PARAMS(f16)) {
    extern __shared__ float4 dw_patch[];  // float4: 16-byte aligned for the patch's vector stores
    dwconv_tile_any<DW_TILE_H, false>(x, w, bias, y, DWCONV_PROBLEM, reinterpret_cast<float*>(dw_patch));
}

extern "C" __global__ void __launch_bounds__(DW_TILE_THREADS) dwconv_nhwc_f16_tile_short(DWCONV_PARAMS(f16)) {
    extern __shared__ float4 dw_patch[];
    dwconv_tile_any<DW_TILE_H_SHORT, false>(x, w, bias, y, DWCONV_PROBLEM, reinterpret_cast<float*>(dw_patch));
}

extern "C" __global__ void __launch_bounds__(DW_TILE_THREADS) dwconv_nhwc_f16_tile3(DWCONV_PARAMS(f16)) {
    extern __shared__ float4 dw_patch[];
    dwconv_tile_any<DW_TILE_H, true>(x, w, bias, y, DWCONV_PROBLEM, reinterpret_cast<float*>(dw_patch));
}

extern "C" __global__ void __launch_bounds__(DW_TILE_THREADS) dwconv_nhwc_f16_tile3_short(DWCONV_PARAMS(f16)) {
    extern __shared__ float4 dw_patch[];
    dwconv_tile_any<DW_TILE_H_SHORT, true>(x, w, bias, y, DWCONV_PROBLEM, reinterpret_cast<float*>(dw_patch));
}
#endif

#if defined(DW_COLS_H)
extern "C" __global__ void __launch_bounds__(DW_COLS_THREADS, DW_COLS_MIN_BLOCKS) dwconv_nhwc_f16_cols(DWCONV_PARAMS(f16)) {
    dwconv_cols_any<DW_COLS_H>(x, w, bias, y, DWCONV_PROBLEM);
}

extern "C" __global__ void __launch_bounds__(DW_COLS_THREADS, DW_COLS_MIN_BLOCKS) dwconv_nhwc_f16_cols_short(DWCONV_PARAMS(f16)) {
    dwconv_cols_any<DW_COLS_H_SHORT>(x, w, bias, y, DWCONV_PROBLEM);
}
#endif
