/*
libnn's tensor-core main loop, written once for the kernel files that run a GEMM on mma.sync:
kernels/gemm.cu (gemm3_mma_*, x @ w.T) and kernels/conv2d.cu (conv3_igemm_*, the implicit GEMM). Each file
fills the pipeline's shared-memory tiles its own way (gemm3: rows of x and w; conv3: the im2col gather of
x and rows of w) and computes its own epilogue; what lies between is here.

The algorithm (CUTLASS's sm80 multistage mainloop, in the form both kernels were tuned with):
- The block's C tile is BM x BN, computed by WM x WN warps of WTM x WTN = (BM/WM) x (BN/WN), each as
  MI x NI mma.sync.m16n8k16 tiles (fp32 accumulate). The reduction is cut into k-tiles of BK (32 or 64).
- Shared memory holds STAGES k-tiles of A (BM rows) and B (BN rows), K-contiguous: rows of BK*2 bytes
  whose 16-byte chunks are XOR-swizzled (swz below) so that the loader's 16-byte stores and every 8-row
  phase of ldmatrix hit 8 distinct 16-byte bank groups.
- STAGES-1 k-tiles are requested before the loop; k-tile kt+STAGES-1 is requested when tile kt begins,
  into the stage tile kt-1 used. One cp.async group is committed per k-tile, empty or not, so that
  cp.async.wait_group STAGES-2 always means "tile kt+1 has landed"; one barrier per k-tile.
- ldmatrix.x4 fragments are double-buffered across the k16 steps of a k-tile and across k-tiles: the
  barrier for tile kt+1 is taken before the last k16 step of tile kt, and the first fragments of kt+1
  are loaded before that step's mmas, so they overlap.
- Blocks are rasterized in groups of GROUP_M M-tiles (grouped_tile): the blocks in flight share their A
  rows and B columns in L2.

The caller supplies load_tile(stage, kt): fill stage `stage` with k-tile kt (cp.async, or synchronous
stores for an unaligned path), called for kt = 0, 1, 2, ... in order, each call before the next, so a
loader may carry state from one k-tile to the next (conv3's (r, s, c)). It stores 16-byte chunk c of row
r at chunk swz<CH>(r, c) of that row: the ldmatrix offsets here assume that layout. When the loop ends
only empty cp.async groups remain: no copy outlives the call.

Limits: BK 32 or 64 (CH = BK/8 chunks per row), KS = BK/16 even (tile kt+1 starts in fragment buffer 0),
warp tiles multiples of 16x16, fp16 or bf16 operands, sm_80 or newer.

Everything is __forceinline__, and both files' kernels compile to the same cubins, byte for byte, as when
this loop was written out in each of them (sm_80 and sm_90 cubins and compute_90 PTX, NVRTC 13.5). That
took the order of the source too: with the k-tile count computed by the caller (before the ldmatrix
offsets) rather than here, gemm3's PTX and SASS changed, with the same registers. A change here changes
both kernels' inner loops, which proved sensitive (gemm3 slowed markedly with a larger epilogue, common.cuh):
compare the cubins before and after, or benchmark both (libnn bench linear, libnn bench conv).
*/
#pragma once

#include "common.cuh"

namespace libnn {

// 16-byte chunk c of smem row r (rows are BK*2 bytes). Only r&7 matters, and every row a thread touches
// differs from its first one by a multiple of 8, so each thread's swizzle term is a constant.
template <int CH>
__device__ __forceinline__ int swz(int r, int c) {
    static_assert(CH == 4 || CH == 8, "BK must be 32 or 64");
    if constexpr (CH == 8) return c ^ (r & 7);
    else return c ^ ((r >> 1) & 3);   // 64-byte rows: two rows share a 128-byte line
}

// The (M-tile, N-tile) this block computes, grouped rasterization: consecutive blocks (blockIdx.x
// fastest) walk GROUP_M M-tiles before moving to the next N-tile. m_tiles x n_tiles is the launch's grid
// in whichever orientation the kernel launches it.
template <int GROUP_M>
__device__ __forceinline__ void grouped_tile(int m_tiles, int n_tiles, int& tm, int& tn) {
    const int bid = blockIdx.y * gridDim.x + blockIdx.x;
    const int per = GROUP_M * n_tiles;
    const int fm = (bid / per) * GROUP_M;
    const int gs = imin(m_tiles - fm, GROUP_M);
    const int r = bid % per;
    tm = fm + r % gs;
    tn = r / gs;
}

// The main loop: zeroes acc, runs the pipeline over a reduction of k_len (ceil(k_len/BK) k-tiles) and
// leaves acc holding this warp's WTM x WTN tile of the block's BM x BN product (C fragment layout:
// acc[i][j][0..1] at row g, cols 2t and 2t+1 of mma tile (i, j), acc[i][j][2..3] at row g+8, g = lane/4,
// t = lane%4). The k-tile count is computed here, after the ldmatrix offsets and the zeroed accumulators,
// because that is where both kernels computed it (see above). sA_u / sB_u: shared-window addresses of
// [STAGES][BM][BK] and [STAGES][BN][BK] fp16/bf16. (wm, wn): this warp's place in the WM x WN grid.
// UNROLL_PROLOGUE: the STAGES-1 loads before the loop unrolled (gemm3, as it was tuned) or kept a rolled
// loop (conv3, as it was tuned; its load_tile inlines a long scalar path). The shared memory is still
// being read by other warps when this returns: a caller that reuses it takes a barrier first.
template <bool BF16, int BM, int BN, int BK, int WM, int WN, int STAGES, bool UNROLL_PROLOGUE, class LoadTile>
__device__ __forceinline__ void mma_mainloop(float (&acc)[BM / WM / 16][BN / WN / 8][4], u32 sA_u, u32 sB_u, int k_len,
                                             int wm, int wn, int lane, const LoadTile& load_tile) {
    constexpr int WTM = BM / WM, WTN = BN / WN;    // warp tile
    constexpr int MI = WTM / 16, NI = WTN / 8;     // mma tiles per warp
    constexpr int CH = BK / 8;                     // 16-byte chunks per smem row
    constexpr int KS = BK / 16;                    // k16 steps per k-tile
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile must be a multiple of 16x16");

    // ldmatrix.x4 source rows. A (16x16 per mma): lanes 0-15 -> rows 0-15 at k 0-7, lanes 16-31 -> rows
    // 0-15 at k 8-15, giving a0..a3 in mma order. B (two n8 tiles x k16): lanes 0-7 n 0-7/k 0-7 (b0 of
    // tile 0), 8-15 n 0-7/k 8-15 (b1 of tile 0), 16-23 n 8-15/k 0-7, 24-31 n 8-15/k 8-15.
    const int a_row = wm * WTM + (lane & 15);
    const int a_hc = lane >> 4;
    const int b_row = wn * WTN + ((lane >> 4) << 3) + (lane & 7);
    const int b_hc = (lane >> 3) & 1;
    u32 a_off[KS], b_off[KS];
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        a_off[kk] = (u32)((a_row * BK + swz<CH>(a_row, kk * 2 + a_hc) * 8) * 2);
        b_off[kk] = (u32)((b_row * BK + swz<CH>(b_row, kk * 2 + b_hc) * 8) * 2);
    }

#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    const int KT = (k_len + BK - 1) / BK;
    if constexpr (UNROLL_PROLOGUE) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < KT) load_tile(s, s);
            cp_async_commit();
        }
    } else {
#pragma unroll 1
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < KT) load_tile(s, s);
            cp_async_commit();
        }
    }

    u32 af[2][MI][4], bf[2][NI][2];
    auto load_frags = [&](int buf, int stage, int kk) {
        const u32 sa = sA_u + (u32)(stage * BM * BK * 2) + a_off[kk];
        const u32 sb = sB_u + (u32)(stage * BN * BK * 2) + b_off[kk];
#pragma unroll
        for (int i = 0; i < MI; i++)
            ldsm_x4(af[buf][i][0], af[buf][i][1], af[buf][i][2], af[buf][i][3], sa + (u32)(i * 16 * BK * 2));
#pragma unroll
        for (int j = 0; j < NI / 2; j++)
            ldsm_x4(bf[buf][2 * j][0], bf[buf][2 * j][1], bf[buf][2 * j + 1][0], bf[buf][2 * j + 1][1],
                    sb + (u32)(j * 16 * BK * 2));
    };
    static_assert(KS % 2 == 0, "tile kt+1 starts in fragment buffer 0");

    cp_async_wait<STAGES - 2>();   // tile 0 landed (this thread's copies) ...
    __syncthreads();               // ... and everyone's
    load_frags(0, 0, 0);

    int rs = 0, ws = STAGES - 1;   // stage being read, stage being refilled
    for (int kt = 0; kt < KT; kt++) {
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            if (kk == 0) {
                // stage ws was last read (by ldmatrix) before the previous barrier: safe to refill
                if (kt + STAGES - 1 < KT) load_tile(ws, kt + STAGES - 1);
                cp_async_commit();   // always commit, so the group count stays in step
                ws = (ws + 1 == STAGES) ? 0 : ws + 1;
            }
            if (kk + 1 < KS) {
                load_frags((kk + 1) & 1, rs, kk + 1);
            } else {
                cp_async_wait<STAGES - 2>();   // tile kt+1 landed for this thread ...
                __syncthreads();               // ... for all, and all are done reading stage rs's fragments
                rs = (rs + 1 == STAGES) ? 0 : rs + 1;
                if (kt + 1 < KT) load_frags(0, rs, 0);
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NI; j++) mma16816<BF16>(acc[i][j], af[kk & 1][i], bf[kk & 1][j]);
        }
    }
    cp_async_wait<0>();   // only empty groups remain; no copy outlives the block
}

}  // namespace libnn
