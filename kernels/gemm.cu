/*
Kernels for a linear layer's forward pass, y = act(x @ w.T + b + r), in the style of llm.c dev/cuda.

    x    (M, K) row-major, row stride exactly K
    w    (N, K) row-major, row stride exactly K   (nn.Linear weight layout: both operands K-contiguous, "TN")
    bias (N,)   or a null pointer (no bias)
    r    (M, N) row-major, row stride exactly N, or a null pointer: the residual (a skip connection)
    y    (M, N) row-major, row stride exactly N

    y[m,n] = act( sum_k x[m,k]*w[n,k] + bias[n] + r[m,n] )

The residual is added before the activation (the ResNet convention, and the order of cuBLASLt's
epilogue, act(A*B + beta*C + bias)). Accumulation is always fp32; bias, residual and activation are
applied in fp32 and the result is rounded to the output dtype once. act (runtime int) is libnn's
activation code (kernels/common.cuh): 0 none, 1 relu, 3 gelu, the tanh approximation
0.5*v*(1+tanh(sqrt(2/pi)*(v+0.044715*v^3))) (what cuBLASLt's GELU epilogue computes), 5 gelu_erf, the
exact 0.5*v*(1+erf(v/sqrt(2))). Each kernel compiles only some of them (ACTS below); a code it does not
compile is the identity.
M, N, K may be any positive ints: all edges are bounds-checked or zero-filled, nothing outside the tensors
is read or written. fp16/bf16 are passed as raw 16-bit storage (unsigned short).

It includes no CUDA toolkit header (only libnn's kernels/common.cuh, kernels/ffma_tile.cuh and
kernels/mma_pipeline.cuh) so that NVRTC from any pip wheel compiles it without a CUDA toolkit;
conversions, cp.async, ldmatrix and mma are inline PTX. It needs sm_80 or newer (cvt.rn.bf16.f32,
cp.async, bf16 mma). Compiled by libnn with
-Xptxas=-v -I kernels/ -arch=sm_XX.

Versions (their speeds on the H100 against cuBLAS: benchmarks/RESULTS.md, linear):

1) gemm1_naive_{f32,f16,bf16}
   One thread per output element, a plain dot product over K. The obviously-correct baseline; slow
   (w rows are read strided across the warp). No alignment requirement.

2) gemm2_tiled_f32
   SIMT fp32 (plain FFMA, no tf32). 128x128 block tile, BK=16, 256 threads, 8x8 outputs per thread
   held as two 4x4 quads 64 rows/cols apart (so a warp's float4 shared loads are conflict-free and
   mostly broadcast). Tiles are staged K-major ("transposed") in shared memory, rows padded to 132
   floats to spread the transposing stores over the banks (2-way conflicts remain, on 16 stores per
   thread per tile); double-buffered shared memory plus a register prefetch of the next tile, one
   barrier per k-tile; 2 blocks/SM on sm_90, 1 on sm_80 (GEMM2_MINB). Global loads are float4 when K%4==0 and
   x,w are 16-byte aligned, otherwise guarded scalar loads (slower) -- the kernel checks this itself
   (uniform branch), the launcher does nothing.
   The main loop (thread layout, double buffer, FFMAs) is kernels/ffma_tile.cuh's, shared with conv2d.cu's
   conv4; this file has gemm2's loader (gload, sstore) and epilogue.

3) gemm3_mma_{f16,bf16}
   Tensor cores through mma.sync.m16n8k16 (fp32 accumulate), fed by ldmatrix.x4 from shared memory.
   Default tile 128x256x32, 8 warps as 2(M) x 4(N), 64x64 per warp (128 fp32 accumulators per thread),
   4-stage cp.async (16-byte, .cg, zero-fill for out-of-range rows / k) pipeline, one barrier per
   k-tile. ldmatrix fragments are double-buffered across k16 steps and across k-tiles (the barrier for
   tile kt+1 is taken before the last k16 step of tile kt, as in CUTLASS's multistage mainloop).
   Shared rows are BK*2 = 64 bytes; 16-byte chunks are XOR-swizzled (chunk ^ ((row>>1)&3); for BK=64,
   chunk ^ (row&7)) so both the cp.async stores and every 8-row ldmatrix phase hit 8 distinct 16-byte
   bank groups. Blocks are rasterized in groups of 8 M-tiles (the kernel remaps blockIdx itself) so the
   blocks in flight share their A rows and B columns in L2. The main loop (pipeline, swizzle, fragments,
   mmas) and the rasterization are kernels/mma_pipeline.cuh's, shared with conv2d.cu's conv3; this file
   has gemm3's loader (load_tile) and epilogue.
   The default tile stays because none of the others tried (128x128 4 warps, 256x128, BK=64, 3/5
   stages) was clearly faster at 4096^3 or 8192^3.
   Alignment: the 16-byte cp.async path is used only when K%8==0 and x,w are 16-byte aligned; otherwise
   the same pipeline is filled with guarded scalar loads, synchronously: correct for any K but several times
   slower -- for large unaligned problems a launcher does better to copy x and w into K-padded (multiple of 8, zero-filled) buffers and run the aligned path. The kernel picks the
   path itself.

Compile-time tuning knobs (defaults are what the LAUNCH table assumes; leave them alone in the library):
-DGEMM3_BM/BN/BK/WM/WN/STAGES (BK 32 or 64), -DGEMM2_BK (8 or 16), -DGEMM2_MINB (blocks/SM bound).

Activations compiled (the epilogue is inlined for every accumulator a thread holds: gemm3 compiled with
all five of common.cuh's activations ran markedly slower, see ACT_LINEAR there):
    gemm1_naive_*                 none, relu, gelu, gelu_erf
    gemm2_tiled_f32, gemm3_mma_*  none, relu, gelu
    gemm3_mma_gelu_erf_*          none, gelu_erf   (the same kernel as gemm3_mma_*, erf in its epilogue)

LAUNCH (all kernels take the same parameters, no extra ones). libnn/ops/linear.py packs them by the names of
GEMM_PARAMS below and computes this table from the constants GEMM1_BX/BY, G2_THREADS/BM/BN and GEMM3_*
(libnn/runtime/contracts.py reads them; tests/test_kernel_contracts.py checks both against the PTX):
    (const T* x, const T* w, const T* bias_or_null, const T* residual_or_null, T* y, int M, int N, int K,
     int act)
    T = float (f32) or unsigned short (f16/bf16 bits)

    kernel              block        grid                              dynamic smem   notes
    gemm1_naive_*       (32, 8, 1)   (ceil(N/32),  ceil(M/8),   1)     0              M <= 524280 (grid.y <= 65535)
    gemm2_tiled_f32     (256, 1, 1)  (ceil(N/128), ceil(M/128), 1)     0              33792 B static smem
    gemm3_mma_*         (256, 1, 1)  (ceil(N/256), ceil(M/128), 1)     98304          > 48 KB: set the kernel's
                                                                                      max dynamic smem attribute
                                                                                      (cudaFuncAttributeMaxDynamic-
                                                                                      SharedMemorySize / CuPy
                                                                                      max_dynamic_shared_size_bytes)
                                                                                      to 98304 before launching
    General form for gemm3: block = 32*WM*WN, grid = (ceil(N/BN), ceil(M/BM)), smem = STAGES*(BM+BN)*BK*2.
    gemm2/gemm3: M <= 65535*128 (grid.y). No alignment precondition for any kernel: y stores are
    vectorized only where the address allows it, x/w vector loads are chosen in-kernel as described
    above. y must not alias x, w, bias or the residual.
*/

#include "common.cuh"
#include "ffma_tile.cuh"
#include "mma_pipeline.cuh"

namespace gk {

using namespace libnn;

// ---------------------------------------------------------------------------------------------------
// The activations each kernel compiles (a mask of kernels/common.cuh's codes): gelu_erf gets kernels of
// its own, so that the kernels for the other activations keep their registers.
enum : unsigned { ACTS_FUSED = ACT_LINEAR, ACTS_ERF = (1u << 0) | (1u << 5), ACTS_NAIVE = ACT_LINEAR | (1u << 5) };

// The one epilogue every kernel uses: bias, residual and activation in fp32, round once, bounds-checked
// store of y[m,n] (and y[m,n+1] when pair). A pair is read from the residual and written to y as one
// 2-element access where the address allows (r and y have the same row stride, so they agree on it
// unless one of them is misaligned).
template <class DT, unsigned ACTS>
__device__ __forceinline__ void epilogue(typename DT::T* y, const typename DT::T* bias, const typename DT::T* res,
                                         int M, int N, int m, int n, float v0, float v1, bool pair, int act) {
    typedef typename DT::T T;
    struct alignas(2 * sizeof(T)) T2 { T a, b; };
    if (m >= M || n >= N) return;
    const bool two = pair && n + 1 < N;
    if (bias) {
        v0 += DT::ld(bias[n]);
        if (two) v1 += DT::ld(bias[n + 1]);
    }
    const i64 at = (i64)m * N + n;
    if (res) {
        const T* q = res + at;
        if (two && ((u64)q & (2 * sizeof(T) - 1)) == 0) {
            const T2 t = *reinterpret_cast<const T2*>(q);
            v0 += DT::ld(t.a);
            v1 += DT::ld(t.b);
        } else {
            v0 += DT::ld(q[0]);
            if (two) v1 += DT::ld(q[1]);
        }
    }
    T* p = y + at;
    const T o0 = DT::st(apply_act<ACTS>(v0, act));
    if (!two) { p[0] = o0; return; }
    const T o1 = DT::st(apply_act<ACTS>(v1, act));
    if (((u64)p & (2 * sizeof(T) - 1)) == 0) {
        T2 t; t.a = o0; t.b = o1;
        *reinterpret_cast<T2*>(p) = t;
    } else {
        p[0] = o0; p[1] = o1;
    }
}

// ---------------------------------------------------------------------------------------------------
// 1) naive
template <class DT>
__device__ __forceinline__ void gemm1_body(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ w,
                                           const typename DT::T* __restrict__ bias, const typename DT::T* __restrict__ res,
                                           typename DT::T* __restrict__ y, int M, int N, int K, int act) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const typename DT::T* xr = x + (i64)m * K;
    const typename DT::T* wr = w + (i64)n * K;
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc += DT::ld(xr[k]) * DT::ld(wr[k]);
    epilogue<DT, ACTS_NAIVE>(y, bias, res, M, N, m, n, acc, 0.f, false, act);
}

// ---------------------------------------------------------------------------------------------------
// 2) tiled SIMT fp32
#define GEMM1_BX 32   // gemm1's block: any shape works (it reads blockDim); this one is its launch's
#define GEMM1_BY 8
#define G2_THREADS 256
#define G2_BM 128
#define G2_BN 128
#ifndef GEMM2_BK
#define GEMM2_BK 16   // faster than 8 on the H100 (fewer barriers per FFMA; benchmarks/RESULTS.md, linear)
#endif
#ifndef GEMM2_MINB
// blocks/SM bound. sm_90: 2 (128 registers), although NVRTC 13.0's ptxas may spill 16 B there with the
// residual epilogue: uncapped (1 block/SM) ran slower on the H100 (benchmarks/RESULTS.md, gemm2 register
// cap), and tests/test_kernels_compile.py accepts exactly that spill. sm_80: 1, where the cap spilled.
#define GEMM2_MINB (__CUDA_ARCH__ >= 900 ? 2 : 1)
#endif
#define G2_BK GEMM2_BK
#define G2_LD (128 + 4)   // pad: a warp's transposing stores (rows x k-quads) spread over the banks

typedef FfmaSmem<G2_BK, G2_LD> g2_smem;

template <bool AL>
__device__ __forceinline__ void gemm2_body(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ bias, const float* __restrict__ res,
                                           float* __restrict__ y, int M, int N, int K, int act, g2_smem& sm) {
    static_assert(G2_BK == 8 || G2_BK == 16, "GEMM2_BK must be 8 or 16");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int ty, tx;
    ffma_thread(warp, lane, ty, tx);
    const int m0 = blockIdx.y * G2_BM, n0 = blockIdx.x * G2_BN;

    // loader: LPR threads share a tile row, each takes 4 consecutive k; NP passes cover the 128 rows
    constexpr int LPR = G2_BK / 4, RPP = G2_THREADS / LPR, NP = 128 / RPP;
    const int lr = tid / LPR, lk = (tid % LPR) * 4;
    bool xok[NP], wok[NP];
    const float* xp[NP];
    const float* wp[NP];
#pragma unroll
    for (int p = 0; p < NP; p++) {
        xok[p] = m0 + lr + p * RPP < M;
        wok[p] = n0 + lr + p * RPP < N;
        xp[p] = x + (xok[p] ? (i64)(m0 + lr + p * RPP) * K : 0);
        wp[p] = w + (wok[p] ? (i64)(n0 + lr + p * RPP) * K : 0);
    }

    float ra[NP][4], rb[NP][4];
    auto gload = [&](int k0) {
        const int k = k0 + lk;
#pragma unroll
        for (int p = 0; p < NP; p++) {
            if constexpr (AL) {   // K % 4 == 0: a quad is entirely inside or outside K
                f32x4 va = {0.f, 0.f, 0.f, 0.f}, vb = {0.f, 0.f, 0.f, 0.f};
                if (xok[p] && k < K) va = *reinterpret_cast<const f32x4*>(xp[p] + k);
                if (wok[p] && k < K) vb = *reinterpret_cast<const f32x4*>(wp[p] + k);
                ra[p][0] = va.x; ra[p][1] = va.y; ra[p][2] = va.z; ra[p][3] = va.w;
                rb[p][0] = vb.x; rb[p][1] = vb.y; rb[p][2] = vb.z; rb[p][3] = vb.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ra[p][i] = (xok[p] && k + i < K) ? xp[p][k + i] : 0.f;
                    rb[p][i] = (wok[p] && k + i < K) ? wp[p][k + i] : 0.f;
                }
            }
        }
    };
    auto sstore = [&](int buf) {
#pragma unroll
        for (int p = 0; p < NP; p++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                sm.A[buf][lk + i][lr + p * RPP] = ra[p][i];
                sm.B[buf][lk + i][lr + p * RPP] = rb[p][i];
            }
    };

    float acc[8][8];
    ffma_mainloop(acc, sm, K, ty, tx, gload, sstore);

#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int m = m0 + ffma_row(i, ty);
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            const int n = n0 + ffma_col(j, tx);
            epilogue<dt_f32, ACTS_FUSED>(y, bias, res, M, N, m, n, acc[i][j], acc[i][j + 1], true, act);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 3) tensor cores: mma.sync m16n8k16 + ldmatrix + multi-stage cp.async
#ifndef GEMM3_BM
#define GEMM3_BM 128
#endif
#ifndef GEMM3_BN
#define GEMM3_BN 256
#endif
#ifndef GEMM3_BK
#define GEMM3_BK 32
#endif
#ifndef GEMM3_WM
#define GEMM3_WM 2
#endif
#ifndef GEMM3_WN
#define GEMM3_WN 4
#endif
#ifndef GEMM3_STAGES
#define GEMM3_STAGES 4
#endif
#define GEMM3_THREADS (32 * GEMM3_WM * GEMM3_WN)
#define GEMM3_GROUP_M 8

extern __shared__ u32x4 dsmem[];   // u32x4: 16-byte aligned, as cp.async needs

template <class DT, unsigned ACTS, int BM, int BN, int BK, int WM, int WN, int STAGES, bool AL>
__device__ __forceinline__ void gemm3_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                           const u16* __restrict__ bias, const u16* __restrict__ res,
                                           u16* __restrict__ y, int M, int N, int K, int act) {
    constexpr int NT = 32 * WM * WN;
    constexpr int WTM = BM / WM, WTN = BN / WN;    // warp tile
    constexpr int MI = WTM / 16, NI = WTN / 8;     // mma tiles per warp
    constexpr int CH = BK / 8;                     // 16-byte chunks per smem row
    constexpr int RS = NT / CH;                    // loader row step
    constexpr int A_IT = BM * CH / NT, B_IT = BN * CH / NT;
    static_assert(NT % CH == 0 && RS % 8 == 0 && BM % RS == 0 && BN % RS == 0, "loader shape");
    static_assert(A_IT >= 1 && B_IT >= 1, "loader shape");

    u16* sA = reinterpret_cast<u16*>(dsmem);      // [STAGES][BM][BK]
    u16* sB = sA + STAGES * BM * BK;               // [STAGES][BN][BK]
    const u32 sA_u = smem_addr(sA), sB_u = smem_addr(sB);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;

    int tm, tn;   // grid = (N-tiles, M-tiles)
    grouped_tile<GEMM3_GROUP_M>(gridDim.y, gridDim.x, tm, tn);
    const int m0 = tm * BM, n0 = tn * BN;

    // loader: thread owns chunk column lc of rows lr0 + i*RS
    const int lr0 = tid / CH, lc = tid % CH;
    const int lsw = swz<CH>(lr0, lc);
    const u32 a_dst0 = (u32)((lr0 * BK + lsw * 8) * 2);   // byte offset within a stage

    auto load_tile = [&](int stage, int kt) {
        const int k = kt * BK + lc * 8;
        if constexpr (AL) {   // K % 8 == 0: a chunk is entirely inside or outside K
            const bool kok = k < K;
#pragma unroll
            for (int i = 0; i < A_IT; i++) {
                const int gm = m0 + lr0 + i * RS;
                const bool ok = kok && gm < M;
                const u16* src = ok ? x + ((i64)gm * K + k) : x;
                cp_async16(sA_u + (u32)(stage * BM * BK * 2) + a_dst0 + (u32)(i * RS * BK * 2), src, ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < B_IT; i++) {
                const int gn = n0 + lr0 + i * RS;
                const bool ok = kok && gn < N;
                const u16* src = ok ? w + ((i64)gn * K + k) : w;
                cp_async16(sB_u + (u32)(stage * BN * BK * 2) + a_dst0 + (u32)(i * RS * BK * 2), src, ok ? 16 : 0);
            }
        } else {
            // Rows not 16-byte aligned: guarded scalar loads, synchronous. (Issuing them after the
            // first k16 step's mmas instead was measured: no gain, more registers.)
            auto gather = [&](const u16* base, int rows, int g) {
                u32 p[4] = {0u, 0u, 0u, 0u};
                if (g < rows) {
                    const u16* src = base + (i64)g * K;
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        if (k + e < K) p[e >> 1] |= (u32)src[k + e] << ((e & 1) * 16);
                }
                u32x4 v; v.a = p[0]; v.b = p[1]; v.c = p[2]; v.d = p[3];
                return v;
            };
            u32x4 va[A_IT], vb[B_IT];
#pragma unroll
            for (int i = 0; i < A_IT; i++) va[i] = gather(x, M, m0 + lr0 + i * RS);
#pragma unroll
            for (int i = 0; i < B_IT; i++) vb[i] = gather(w, N, n0 + lr0 + i * RS);
            char* a_st = reinterpret_cast<char*>(sA) + stage * BM * BK * 2 + a_dst0;
            char* b_st = reinterpret_cast<char*>(sB) + stage * BN * BK * 2 + a_dst0;
#pragma unroll
            for (int i = 0; i < A_IT; i++) *reinterpret_cast<u32x4*>(a_st + i * RS * BK * 2) = va[i];
#pragma unroll
            for (int i = 0; i < B_IT; i++) *reinterpret_cast<u32x4*>(b_st + i * RS * BK * 2) = vb[i];
        }
    };

    float acc[MI][NI][4];
    mma_mainloop<DT::bf16 != 0, BM, BN, BK, WM, WN, STAGES, true>(acc, sA_u, sB_u, K, wm, wn, lane, load_tile);

    // C fragment: c0,c1 at (row g, cols 2t,2t+1), c2,c3 at row g+8
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; i++) {
        const int m = m0 + wm * WTM + i * 16 + g;
#pragma unroll
        for (int j = 0; j < NI; j++) {
            const int n = n0 + wn * WTN + j * 8 + t * 2;
            epilogue<DT, ACTS>(y, bias, res, M, N, m, n, acc[i][j][0], acc[i][j][1], true, act);
            epilogue<DT, ACTS>(y, bias, res, M, N, m + 8, n, acc[i][j][2], acc[i][j][3], true, act);
        }
    }
}

template <class DT, unsigned ACTS>
__device__ __forceinline__ void gemm3_entry(const u16* __restrict__ x, const u16* __restrict__ w,
                                            const u16* __restrict__ bias, const u16* __restrict__ res,
                                            u16* __restrict__ y, int M, int N, int K, int act) {
    const bool al = (K & 7) == 0 && (((u64)x | (u64)w) & 15) == 0;
    if (al)
        gemm3_body<DT, ACTS, GEMM3_BM, GEMM3_BN, GEMM3_BK, GEMM3_WM, GEMM3_WN, GEMM3_STAGES, true>(x, w, bias, res, y, M, N, K, act);
    else
        gemm3_body<DT, ACTS, GEMM3_BM, GEMM3_BN, GEMM3_BK, GEMM3_WM, GEMM3_WN, GEMM3_STAGES, false>(x, w, bias, res, y, M, N, K, act);
}

}  // namespace gk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define GEMM_PARAMS(T) const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, \
                       const T* __restrict__ residual, T* __restrict__ y, int M, int N, int K, int act

#define GEMM1(name, DT)                                                                   \
    extern "C" __global__ void name(GEMM_PARAMS(gk::DT::T)) {                             \
        gk::gemm1_body<gk::DT>(x, w, bias, residual, y, M, N, K, act);                    \
    }
GEMM1(gemm1_naive_f32, dt_f32)
GEMM1(gemm1_naive_f16, dt_f16)
GEMM1(gemm1_naive_bf16, dt_bf16)

extern "C" __global__ void __launch_bounds__(G2_THREADS, GEMM2_MINB) gemm2_tiled_f32(GEMM_PARAMS(float)) {
    __shared__ gk::g2_smem sm;
    const bool al = (K & 3) == 0 && ((((gk::u64)x) | ((gk::u64)w)) & 15) == 0;
    if (al) gk::gemm2_body<true>(x, w, bias, residual, y, M, N, K, act, sm);
    else gk::gemm2_body<false>(x, w, bias, residual, y, M, N, K, act, sm);
}

#define GEMM3(name, DT, ACTS)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMM3_THREADS, 1) name(GEMM_PARAMS(gk::u16)) { \
        gk::gemm3_entry<gk::DT, gk::ACTS>(x, w, bias, residual, y, M, N, K, act);         \
    }
GEMM3(gemm3_mma_f16, dt_f16, ACTS_FUSED)
GEMM3(gemm3_mma_bf16, dt_bf16, ACTS_FUSED)
GEMM3(gemm3_mma_gelu_erf_f16, dt_f16, ACTS_ERF)
GEMM3(gemm3_mma_gelu_erf_bf16, dt_bf16, ACTS_ERF)
