// The tensor-core tile of the implicit-GEMM convolutions: a swizzled shared-memory layout for a
// BM x BK A tile and a BN x BK B tile (both K-major), and one k-tile through mma.sync m16n8k16
// with ldmatrix fragments (fp16 in, fp32 accumulators). conv_nhwc.cu includes it; dualtrack.ptx
// hands it to NVRTC in memory with the other headers, so it is part of every PTX cache key.

#pragma once

#include "dualtrack_device.cuh"

namespace mma_tile {

// BM x BN output tile per block, BK-deep k-tiles, WARPS_M x WARPS_N warps, STAGES shared-memory
// stages, registers capped so that MIN_BLOCKS blocks fit on an SM (__launch_bounds__). Sizes are
// enumerators: namespace-scope constexpr variables would be emitted as .global symbols in the PTX.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_>
struct Tile {
    enum : int {
        BM = BM_,
        BN = BN_,
        BK = BK_,
        WARPS_M = WARPS_M_,
        WARPS_N = WARPS_N_,
        STAGES = STAGES_,
        MIN_BLOCKS = MIN_BLOCKS_,
        THREADS = 32 * WARPS_M * WARPS_N,
        WM = BM / WARPS_M,  // warp tile
        WN = BN / WARPS_N,
        MT = WM / 16,  // m16 tiles per warp
        NT = WN / 8,   // n8 tiles per warp
        CPR = BK / 8,  // 16-byte chunks per tile row
        // Tiles are unpadded, [rows][BK] halves, with the 16-byte chunks of each row XOR-swizzled
        // (swz below), so the 8 row addresses of one ldmatrix phase hit 8 distinct bank groups.
        A_STAGE = BM * BK,  // halves
        STAGE = (BM + BN) * BK,
        A_CH = BM * CPR / THREADS,  // 16-byte A chunks a thread copies per k-tile
        B_CH = BN * CPR / THREADS,
        PIPE = STAGES * STAGE,  // halves
    };
    static_assert(BM % (16 * WARPS_M) == 0 && BN % (16 * WARPS_N) == 0, "warp tile must be m16 x n16 multiples");
    static_assert(BK == 32 || BK == 64, "the swizzle is written for 64- and 128-byte tile rows");
    static_assert(STAGES >= 2, "cp.async pipeline needs two stages or more");
    static_assert(THREADS % CPR == 0 && (BM * CPR) % THREADS == 0 && (BN * CPR) % THREADS == 0, "vector loads");
    static_assert(THREADS % BK == 0 && (BM * BK) % THREADS == 0 && (BN * BK) % THREADS == 0, "scalar loads");

    // Physical 16-byte chunk of logical chunk q in tile row `row`. 64-byte rows (BK = 32): rows
    // 2j, 2j+1 share a 128-byte line, so XOR with bits 1-2 of the row; 128-byte rows: bits 0-2.
    static __device__ __forceinline__ int swz(int row, int q) {
        return BK == 32 ? (q ^ ((row >> 1) & 3)) : (q ^ (row & 7));
    }
    static __device__ __forceinline__ int at(int row, int q) { return row * BK + swz(row, q) * 8; }  // halves
};

// One stage's BK columns through the tensor cores: ldmatrix fragments, MT x NT mma per k16.
// `a_base`: shared address of the stage's A tile; its B tile follows at A_STAGE halves.
template <class CF>
__device__ __forceinline__ void mma_stage(unsigned a_base, float (&acc)[CF::MT][CF::NT][4], int wm, int wn,
                                          int lane) {
    const unsigned b_base = a_base + CF::A_STAGE * 2;
#pragma unroll
    for (int kk = 0; kk < CF::BK; kk += 16) {
        unsigned af[CF::MT][4];
        unsigned bf[CF::NT][2];
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt) {
            // lanes 0-15 address rows 0-15 at k, lanes 16-31 the same rows at k+8: matrices
            // (rows 0-7,k) (rows 8-15,k) (rows 0-7,k+8) (rows 8-15,k+8) = the mma A fragment.
            const int row = wm * CF::WM + mt * 16 + (lane & 15);
            ldmatrix_x4(af[mt], a_base + CF::at(row, kk / 8 + (lane >> 4)) * 2);
        }
#pragma unroll
        for (int nt = 0; nt < CF::NT; nt += 2) {
            // matrices (n 0-7,k) (n 0-7,k+8) (n 8-15,k) (n 8-15,k+8) = b0,b1 of two n8 tiles.
            const int row = wn * CF::WN + nt * 8 + (lane >> 4) * 8 + (lane & 7);
            unsigned r[4];
            ldmatrix_x4(r, b_base + CF::at(row, kk / 8 + ((lane >> 3) & 1)) * 2);
            bf[nt][0] = r[0];
            bf[nt][1] = r[1];
            bf[nt + 1][0] = r[2];
            bf[nt + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < CF::MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < CF::NT; ++nt) mma_16816(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
}

}  // namespace mma_tile
