/*
libnn's SIMT fp32 register-tile main loop (plain FFMA, no tf32), written once for the kernel files that
run an fp32 GEMM on the CUDA cores: kernels/gemm.cu (gemm2_tiled_f32, x @ w.T) and kernels/conv2d.cu
(conv4_igemm_f32, the implicit GEMM). Each file loads its k-tiles its own way (gemm2: rows of x and w;
conv4: the im2col gather of x and rows of w) and computes its own epilogue; what lies between is here.

The algorithm (both kernels as they were tuned):
- The block's C tile is 128 x 128, 256 threads, 8 x 8 outputs per thread held as two 4 x 4 quads 64
  rows and 64 columns apart: thread (ty, tx), 16 x 16 of them, owns rows ffma_row(i, ty), i < 8, and
  columns ffma_col(j, tx), j < 8, of the tile. A warp covers 4 (rows) x 8 (cols) threads, so per k it
  reads 8 distinct A float4s and 16 B float4s from shared memory: conflict-free and mostly broadcast.
- Shared memory (FfmaSmem) holds two k-tiles of A and of B, K-major ("transposed"): A[buf][k][row],
  rows padded to LD floats (128 + 4) so that the loaders' transposing stores spread over the banks.
- Double-buffered shared memory plus a register prefetch: while k-tile kt is multiplied out of buffer
  kt&1, k-tile kt+1 is loaded from global memory into registers (gload), and stored into the other
  buffer (sstore) after the FFMAs; one barrier per k-tile.

The caller supplies gload(k0): load the k-tile starting at reduction index k0 into its registers, called
for k0 = 0, BK, 2 BK, ... in order, so a loader may carry state from one k-tile to the next (conv4's
(r, s, c)); and sstore(buf): store those registers into buffer buf of the shared tiles.

Everything is __forceinline__, and both files' kernels compile to the same cubins, byte for byte, as when
this loop was written out in each of them (sm_80 and sm_90 cubins and compute_90 PTX, NVRTC 13.5; gemm2
with GEMM2_BK=8 and GEMM2_MINB=1/2 too). A change here changes both kernels' inner loops: compare the
cubins before and after, or benchmark both (libnn bench linear, libnn bench conv).
*/
#pragma once

#include "common.cuh"

namespace libnn {

// Two k-tiles (double buffer) of A and B, BK x LD floats each, K-major.
template <int BK, int LD>
struct alignas(16) FfmaSmem {
    float A[2][BK][LD];
    float B[2][BK][LD];
};

// This thread's place (ty, tx) in the 16 x 16 thread grid: a warp covers 4 (rows) x 8 (cols) threads.
__device__ __forceinline__ void ffma_thread(int warp, int lane, int& ty, int& tx) {
    ty = (warp >> 1) * 4 + (lane >> 3);   // 0..15
    tx = (warp & 1) * 8 + (lane & 7);     // 0..15
}

// The tile row of acc[i][.] and the tile column of acc[.][j] (j and j+1..j+3 up to the quad's end are
// consecutive columns).
__device__ __forceinline__ int ffma_row(int i, int ty) { return (i >> 2) * 64 + ty * 4 + (i & 3); }
__device__ __forceinline__ int ffma_col(int j, int tx) { return (j >> 2) * 64 + tx * 4 + (j & 3); }

// The main loop: zeroes acc, runs over a reduction of k_len (ceil(k_len/BK) k-tiles) and leaves acc
// holding this thread's 8 x 8 outputs. Each k-tile ends with a barrier, so when this returns no thread
// reads the shared tiles any more.
template <int BK, int LD, class GLoad, class SStore>
__device__ __forceinline__ void ffma_mainloop(float (&acc)[8][8], const FfmaSmem<BK, LD>& sm, int k_len, int ty,
                                              int tx, const GLoad& gload, const SStore& sstore) {
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.f;

    const int KT = (k_len + BK - 1) / BK;
    gload(0);
    sstore(0);
    __syncthreads();
    for (int kt = 0; kt < KT; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < KT) gload((kt + 1) * BK);   // in flight while we compute
#pragma unroll
        for (int k = 0; k < BK; k++) {
            const f32x4 a0 = *reinterpret_cast<const f32x4*>(&sm.A[buf][k][ty * 4]);
            const f32x4 a1 = *reinterpret_cast<const f32x4*>(&sm.A[buf][k][64 + ty * 4]);
            const f32x4 b0 = *reinterpret_cast<const f32x4*>(&sm.B[buf][k][tx * 4]);
            const f32x4 b1 = *reinterpret_cast<const f32x4*>(&sm.B[buf][k][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] += a[i] * b[j];
        }
        // the other buffer was last read in iteration kt-1, which ended with a barrier
        if (kt + 1 < KT) sstore(buf ^ 1);
        __syncthreads();
    }
}

}  // namespace libnn
