/*
linear_fp8's custom path: y = act(sx * sw[n] * (xq @ wq.T) + bias + residual) for E4M3 codes xq (M, K) and
wq (N, K), row-major bytes, in the style of llm.c dev/cuda. The path libnn/ops/linear_fp8.py races against
cuBLASLt's FP8 GEMM; not tuned.

    xq  (M, K) E4M3 codes of x / sx (kernels/quantize_fp8.cu wrote them, and sx to x_scale[0])
    wq  (N, K) E4M3 codes of the weight; w_scale[0] (per tensor) or w_scale[n] (per output channel)
    y[m, n] = act(x_scale[0] * w_scale[n or 0] * sum_k e4m3(xq[m, k]) * e4m3(wq[n, k]) + bias[n] + residual[m, n])

Numerics (version 1's; version 3 sums on the tensor cores, as its paragraph says): each code is decoded
exactly to fp32 (a table of the 256 values in shared memory; 0x7f and 0xff are NaN, which propagates),
every product of two E4M3 values is exact in fp32 (4 significant bits each), and the products are summed
in fp32 by FFMA, in K order per thread. The scales, bias, residual and
activation (kernels/common.cuh's apply_act: none, relu, gelu, gelu_erf) are applied in fp32 and the result
rounded once to T (fp16 or bf16; raw 16-bit words converted with PTX, no toolkit header). bias and
residual are in T, or null.

Version 1: fp8_gemm1_tiled_{f16,bf16}
    A block computes a BM x BN tile of y with 256 threads (16 x 16), each a 4 x 4 grid of outputs spaced 16
    apart (rows ty + 16i, columns tx + 16j: a warp's stores are 16 consecutive columns). K is walked BK
    codes at a time: each thread decodes 8 codes of x's tile and 8 of w's into shared memory (fp32,
    k-major), with one 8-byte load where the 8 codes are in range and 8-byte aligned (K % 8 == 0 and the
    pointers 8-byte aligned), byte by byte with zeros past M, N and K otherwise.

Version 3: fp8_gemv3_{f16,bf16}, decode-sized M (M <= FP8_GEMV_MAX_M, M * gemv3_x_stride(K) <= FP8_GEMV3_XS_BYTES)
    One kernel for the whole call, on the FP8 tensor cores (at one row with K % 16 == 0 and w 16-byte
    aligned, kernels/gemv.cu's E4M3 kernel runs instead: it streams w faster on the H100). It quantises x
    itself to the codes kernels/quantize_fp8.cu writes (the same amax and scale; the quotient x / sx from the
    reciprocal with two FMA corrections, correctly rounded, and the hardware's E4M3 conversion where x is
    finite, e4m3_code otherwise: kernels/fp8.cuh), so a decode step launches no quantiser. Each block quantises all of x
    (a few KB at decode) into shared memory and then takes tiles of 16 rows of w, grid-strided; its 8 warps
    each take an eighth of K of every tile. A lane streams 16 codes of two rows of w per load (rows g and
    g + 8 of the tile, lane 4g + q: bytes 16q .. 16q + 15 of each 64-code chunk), two loads of U chunks in
    flight, and feeds them straight to mma.sync m16n8k32 e4m3 as the A operand (y^T = w x^T: the 16 rows
    of w are the mma's m, x's rows its n), with x's codes of the same 16 positions as B: a dot product sums
    over k in any order as long as A and B agree. The products of two E4M3 codes are exact; the tensor
    cores add them into fp32 accumulators, in another order than version 1's and possibly with fewer
    bits kept per addition (Hopper's FP8 matrix units are reported to truncate; not measured here): the
    tests bound the result by the dtype's tolerance against the float64 reference, not by fp32 rounding. The warps' sums
    meet in shared memory; version 1's epilogue follows. Two fusions for a decoder layer (rms_norm_linear):
    with gamma non-null, x is first RMS-normalised row by row (kernels/rms_norm.cu's formula; every row's
    sum of squares in one pass over x) and rounded to T, as rms_norm returns it, before it is quantised; with glu = 1, w holds
    gate rows 0..F-1 and up rows F..2F-1 (N = 2F), a tile takes 8 gate rows and their 8 up rows (rows g
    and g + 8 of the mma), and the epilogue writes y (M, F) = silu(gate) * up, each with its own scale and
    bias (residual null, act none). Version 2 (one warp per output, codes decoded to
    fp32 and FFMA, x quantised by div_rn and e4m3_code) ran at a third of the copy rate at a decode step's
    shapes; version 3 replaced it (benchmarks/RESULTS.md).

LAUNCH (version 1)
    (const unsigned char* xq, const unsigned char* wq, const float* x_scale, const float* w_scale,
     const T* bias, const T* residual, T* y, int M, int N, int K, int per_channel, int act)
    block (FP8_GEMM_THREADS, 1, 1), grid (ceil(M / FP8_GEMM_BM), ceil(N / FP8_GEMM_BN), 1), no dynamic
    shared memory. Preconditions: M, N, K >= 1; N <= 65535 * FP8_GEMM_BN; y does not overlap the inputs;
    element offsets are 64-bit.

LAUNCH (version 3)
    (const T* x, const unsigned char* wq, const float* w_scale, const T* bias, const T* residual, const T* gamma,
     T* y, int M, int N, int K, int per_channel, int act, float eps, int glu, const void* prefetch0,
     long long prefetch0_bytes, const void* prefetch1, long long prefetch1_bytes)
    block (FP8_GEMV3_THREADS, 1, 1), grid (min(ceil(N / FP8_GEMV3_ROWS), FP8_GEMV3_BLOCKS_PER_SM x SMs), 1, 1),
    dynamic shared memory M * gemv3_x_stride(K) bytes (gemv3_x_stride: K rounded up to FP8_GEMV3_CHUNK, then
    to 128, plus 64), at most FP8_GEMV3_XS_BYTES (with the static 8 KB, within 48 KB: no opt-in).
    Preconditions: 1 <= M <= FP8_GEMV_MAX_M, K >= 1, N >= 1 (even with glu); x (M, K), y and residual (M, N)
    row-major and contiguous (y (M, N / 2) with glu); gamma (K,) or null, eps > 0 with it; y does not overlap the inputs; sm_89 or newer. On sm_90 and newer it is launched with
    programmatic stream serialization: it loads its first codes of w, then waits (pdl_wait) for the kernel
    ahead, whose output x is, before it reads x (so w must be what no kernel in flight writes: where a call
    copies a strided w first, it is launched plainly, ops/linear.py read_in_place); rms_norm, layer_norm,
    swiglu, attention's zeroing kernel and attn3_combine let it start (pdl_launch_dependents). It lets the kernel after it start in turn once every block
    has quantised x (rms_norm, rope, kv_append and swiglu are launched programmatically and wait first).
    Behind its first loads it prefetches into L2 what the next GEMV reads first, as kernels/gemv.cu does
    (the prefetch ranges: common.cuh l2_prefetch_hint).
*/
#include "common.cuh"
#include "fp8.cuh"

constexpr int FP8_GEMM_THREADS = 256;
constexpr int FP8_GEMM_BM = 64;   // rows of y per block
constexpr int FP8_GEMM_BN = 64;   // columns of y per block
constexpr int FP8_GEMM_BK = 32;   // codes of K per step: BM * BK / 8 = one 8-code group per thread
constexpr int FP8_GEMV_MAX_M = 8;          // rows of x version 3 takes (a decode step's batch)
constexpr int FP8_GEMV3_THREADS = 256;     // 8 warps, each a share of K for the block's rows of w
constexpr int FP8_GEMV3_ROWS = 16;         // rows of w (columns of y) per block: the mma's m
constexpr int FP8_GEMV3_CHUNK = 64;        // codes of K per row of w that 4 lanes load at once (16 each)
constexpr int FP8_GEMV3_UNROLL = 2;        // chunks per row a lane has in each of its two loads in flight
constexpr int FP8_GEMV3_BLOCKS_PER_SM = 2; // blocks per SM the grid holds (every block quantises x once)
constexpr int FP8_GEMV3_X_CACHED = 2;      // groups of 8 values of x a thread keeps in registers while quantising
constexpr int FP8_GEMV3_XS_BYTES = 36864;  // dynamic shared memory for x's codes: M * gemv3_x_stride(K), at most

namespace fp8g {

using namespace libnn;

constexpr int PAD = 4;            // keeps the k-major tiles' rows off one bank
constexpr unsigned ACTS = ACT_LINEAR | (1u << ACT_GELU_ERF);

struct Smem {
    float lut[256];
    float xs[FP8_GEMM_BK][FP8_GEMM_BM + PAD];
    float ws[FP8_GEMM_BK][FP8_GEMM_BN + PAD];
};

// codes k0 .. k0+7 of row `row` of a (rows, K) matrix, decoded into tile[k - kt][r]; zeros outside it
__device__ __forceinline__ void load_group(const unsigned char* __restrict__ a, int rows, int K, bool vec, int row,
                                           int kt, int k0, int r, float (*tile)[FP8_GEMM_BM + PAD], const float* lut) {
    const int k = kt + k0;
    if (row < rows && vec && k + 8 <= K) {
        const u64 word = *reinterpret_cast<const u64*>(a + (i64)row * K + k);
#pragma unroll
        for (int j = 0; j < 8; j++) tile[k0 + j][r] = lut[(u32)(word >> (8 * j)) & 0xffu];
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        tile[k0 + j][r] = (row < rows && k + j < K) ? lut[a[(i64)row * K + k + j]] : 0.f;
}

template <class DT>
__device__ __forceinline__ void gemm1(const unsigned char* __restrict__ xq, const unsigned char* __restrict__ wq,
                                      const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                                      const typename DT::T* __restrict__ bias, const typename DT::T* __restrict__ residual,
                                      typename DT::T* __restrict__ y, int M, int N, int K, int per_channel, int act) {
    static_assert(FP8_GEMM_BM == FP8_GEMM_BN, "one load pattern serves both tiles");
    __shared__ Smem sm;
    const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    const int m0 = blockIdx.x * FP8_GEMM_BM, n0 = blockIdx.y * FP8_GEMM_BN;
    sm.lut[t] = e4m3_value((u32)t);   // FP8_GEMM_THREADS == 256: one code each
    const bool vec_x = (K & 7) == 0 && ((u64)xq & 7) == 0, vec_w = (K & 7) == 0 && ((u64)wq & 7) == 0;
    const int r = t >> 2, k0 = (t & 3) * 8;   // this thread's row of each tile and its 8 codes of K
    float acc[4][4] = {};
    __syncthreads();
    for (int kt = 0; kt < K; kt += FP8_GEMM_BK) {
        load_group(xq, M, K, vec_x, m0 + r, kt, k0, r, sm.xs, sm.lut);
        load_group(wq, N, K, vec_w, n0 + r, kt, k0, r, sm.ws, sm.lut);
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < FP8_GEMM_BK; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = sm.xs[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = sm.ws[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();   // every thread is done with the tiles before the next step overwrites them
    }
    const float sx = x_scale[0];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int n = n0 + tx + 16 * j;
        if (n >= N) continue;
        const float s = sx * w_scale[per_channel ? n : 0];
        const float b = bias ? DT::ld(bias[n]) : 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int m = m0 + ty + 16 * i;
            if (m >= M) continue;
            const i64 o = (i64)m * N + n;
            float v = acc[i][j] * s + b;
            if (residual) v += DT::ld(residual[o]);
            y[o] = DT::st(apply_act<ACTS>(v, act));
        }
    }
}

// ---- version 3 ------------------------------------------------------------------------------------------
// bytes between x's rows of codes in shared memory: K in whole chunks, rounded up to 128, plus 64, so that the
// 8 lanes of a quarter-warp (x's rows g and g + 1, 64 bytes each) read distinct banks
__device__ __forceinline__ int gemv3_x_stride(int K) {
    return ((((K + FP8_GEMV3_CHUNK - 1) / FP8_GEMV3_CHUNK) * FP8_GEMV3_CHUNK + 127) & ~127) + 64;
}

// d += a . b on the FP8 tensor cores: m16n8k32, E4M3 a (16 x 32, row-major) and b (32 x 8), fp32 d
__device__ __forceinline__ void mma_e4m3(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();   // FP8 refuses GPUs below sm_89 before launching
#endif
}

// 16 codes of `row` from k (zeros past K): one 16-byte load where `vec` (then K % 16 == 0), bytes otherwise
__device__ __forceinline__ u32x4 load16(const unsigned char* __restrict__ row, int k, int K, bool vec) {
    if (vec) return k < K ? *reinterpret_cast<const u32x4*>(row + k) : u32x4{0u, 0u, 0u, 0u};
    u32 v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < 16; j++)
        if (k + j < K) v[j >> 2] |= (u32)row[k + j] << (8 * (j & 3));
    return u32x4{v[0], v[1], v[2], v[3]};
}

// a lane's codes of chunks c .. c + U - 1 (those before `end`) of its two rows of w
template <int U>
__device__ __forceinline__ void load_chunks(u32x4* a, u32x4* b, const unsigned char* row0, const unsigned char* row1,
                                            int c, int end, int q, int K, bool vec) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int k = (c + u) * FP8_GEMV3_CHUNK + 16 * q;
        const bool live = c + u < end;
        a[u] = load16(row0, live ? k : K, K, vec);
        b[u] = load16(row1, live ? k : K, K, vec);
    }
}

// acc += those chunks' products: two mmas per chunk, each taking 8 of the lane's 16 codes per row of w and
// x's codes at the same 8 positions (row g of x; zeros for rows past M); acc holds two sums (acc[0..3] for
// even chunks, acc[4..7] for odd), so that consecutive mmas do not wait for each other
template <int U>
__device__ __forceinline__ void mma_chunks(float* acc, const u32x4* a, const u32x4* b, const unsigned char* xs,
                                           int c, int end, int g, int q, int M, int S) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        if (c + u >= end) break;
        const u32x4 xv = g < M ? *reinterpret_cast<const u32x4*>(xs + g * S + (c + u) * FP8_GEMV3_CHUNK + 16 * q)
                               : u32x4{0u, 0u, 0u, 0u};
        float* d = acc + 4 * (u & 1);
        mma_e4m3(d, a[u].a, b[u].a, a[u].b, b[u].b, xv.a, xv.b);
        mma_e4m3(d, a[u].c, b[u].c, a[u].d, b[u].d, xv.c, xv.d);
    }
}

// x[m, k .. k + 7] in fp32, zeros past K: one 16-byte load where `vec` (K % 8 == 0, x 16-byte aligned)
template <class DT>
__device__ __forceinline__ void load8(const typename DT::T* __restrict__ x, int m, int k, int K, bool vec, float* v) {
    const typename DT::T* p = x + (i64)m * K + k;
    if (vec && k + 8 <= K) {
        const u32x4 w = *reinterpret_cast<const u32x4*>(p);
        const u32 words[4] = {w.a, w.b, w.c, w.d};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = DT::ld((typename DT::T)(words[i] & 0xffffu));
            v[2 * i + 1] = DT::ld((typename DT::T)(words[i] >> 16));
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = k + i < K ? DT::ld(p[i]) : 0.f;
}

// 1 / sqrt((1/K) sum_k x[m, k]^2 + eps) of each row m < M into rstd (kernels/rms_norm.cu's formula: the mean
// by div.full, rsqrtf) from each thread's sums of squares by row, ss: the warps' sums through shared memory,
// added in a fixed order. Ends with a __syncthreads().
__device__ __forceinline__ void rstd_of_sums(const float (&ss)[FP8_GEMV_MAX_M], int M, int K, float eps, float* rstd) {
    constexpr int WARPS = FP8_GEMV3_THREADS / 32;
    __shared__ float sums[FP8_GEMV_MAX_M][WARPS];
    const int t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < FP8_GEMV_MAX_M; r++) {
        const float s = warp_sum(ss[r]);
        if ((t & 31) == 0) sums[r][t >> 5] = s;
    }
    __syncthreads();
    if (t < M) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sum += sums[t][w];
        rstd[t] = rsqrtf(fdiv_full(sum, (float)K) + eps);
    }
    __syncthreads();
}

// ss[m] += the squares of v (8 values of row m): registers indexed by constants, no local memory
__device__ __forceinline__ void add_squares(float (&ss)[FP8_GEMV_MAX_M], const float* v, int m) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 8; e++) s = fmaf(v[e], v[e], s);
#pragma unroll
    for (int r = 0; r < FP8_GEMV_MAX_M; r++)
        if (r == m) ss[r] += s;
}

// v (x[m, k .. k + 7]) RMS-normalised and rounded to T, as rms_norm returns it; zeros past K
template <class DT>
__device__ __forceinline__ void normalise8(const typename DT::T* __restrict__ gamma, const float* rstd, int m, int k,
                                           int K, float* v) {
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = k + e < K ? DT::ld(DT::st(v[e] * rstd[m] * DT::ld(gamma[k + e]))) : 0.f;
}

// x[m, k .. k + 7] as load8 gives it, or with gamma its RMS normalisation (normalise8)
template <class DT>
__device__ __forceinline__ void load8_normed(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ gamma,
                                             const float* rstd, int m, int k, int K, bool vec, float* v) {
    load8<DT>(x, m, k, K, vec, v);
    if (gamma) normalise8<DT>(gamma, rstd, m, k, K, v);
}

// group i of x' (8 values of row i / groups from 8 (i % groups)), as load8_normed reads it
template <class DT>
__device__ __forceinline__ void load_group(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ gamma,
                                           const float* rstd, int i, int groups, int K, bool vec, float* v) {
    const int m = i / groups;
    load8_normed<DT>(x, gamma, rstd, m, 8 * (i - m * groups), K, vec, v);
}

// amax and finite updated with 8 values
__device__ __forceinline__ void take_max(const float* v, float& amax, bool& finite) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
        amax = fmaxf(amax, finite_abs(v[e]));
        finite &= fabsf(v[e]) <= F32_MAX;
    }
}

// the codes of 8 values v / sx into dst (8 bytes): the fast quotient and conversion where `fast`, else div_rn and
// e4m3_code (quantize_x)
__device__ __forceinline__ void write_codes(const float* v, bool fast, float sx, float r, unsigned char* dst) {
    u32 codes[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float* u = v + 4 * h;
        if (fast) {
            codes[h] = e4m3x2_code(div_by_reciprocal(u[0], sx, r), div_by_reciprocal(u[1], sx, r)) |
                       e4m3x2_code(div_by_reciprocal(u[2], sx, r), div_by_reciprocal(u[3], sx, r)) << 16;
        } else {
            codes[h] = 0u;
#pragma unroll
            for (int e = 0; e < 4; e++) codes[h] |= e4m3_code(div_rn(u[e], sx)) << (8 * e);
        }
    }
    *reinterpret_cast<uint2*>(dst) = make_uint2(codes[0], codes[1]);
}

// sx = max|x| / 448 (1 where that is 0) and x's codes e4m3(x / sx) into xs, M rows of S bytes, zeros past K:
// kernels/quantize_fp8.cu's codes; with gamma, x is first RMS-normalised row by row (normalise8; every row's
// sum of squares in one pass over x, the threads taking the rows' groups of 8 as they lie in xs, S / 8 a row).
// Where x is finite and sx >= 2^-100 (every block decides alike) the quotient is div_by_reciprocal's and the
// codes e4m3x2_code's, a few instructions a value; div_rn and e4m3_code otherwise. A thread takes the groups
// of 8 values t, t + THREADS, ... (group i: row i / (S / 8), its codes at xs + 8 i). Where it has at most
// CACHED of them (M * S <= CACHED * 8 * THREADS: K up to 3968 at M = 1 with FP8_GEMV3_X_CACHED 2) it keeps
// them in registers from its one read of x to the codes, else it reads x again in each pass (two or three
// trips to L2, each on the critical path of a decode step). Why 2 and not 5, which covers K = 8192: the
// measurements in benchmarks/RESULTS.md, nineteenth session. Ends with a __syncthreads().
template <class DT, int CACHED>
__device__ __forceinline__ float quantize_x(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ gamma,
                                            float eps, unsigned char* xs, int M, int K, int S, float* red) {
    constexpr int T = FP8_GEMV3_THREADS;
    __shared__ float rstd[FP8_GEMV_MAX_M];
    const int t = threadIdx.x, groups = S / 8, total = M * groups;   // 8 codes at a time; S is a multiple of 64
    const bool vec = (K & 7) == 0 && ((u64)x & 15) == 0, cached = total <= CACHED * T;   // uniform
    float kept[CACHED][8];
    float ss[FP8_GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < FP8_GEMV_MAX_M; r++) ss[r] = 0.f;
    if (cached) {
#pragma unroll
        for (int c = 0; c < CACHED; c++) {
            const int i = t + c * T, m = i / groups, k = 8 * (i - m * groups);
#pragma unroll
            for (int e = 0; e < 8; e++) kept[c][e] = 0.f;
            if (i >= total) continue;
            load8<DT>(x, m, k, K, vec, kept[c]);   // (zeros past K)
            if (gamma) add_squares(ss, kept[c], m);
        }
        if (gamma) {
            rstd_of_sums(ss, M, K, eps, rstd);
#pragma unroll
            for (int c = 0; c < CACHED; c++) {
                const int i = t + c * T, m = i / groups, k = 8 * (i - m * groups);
                if (i < total) normalise8<DT>(gamma, rstd, m, k, K, kept[c]);
            }
        }
    } else if (gamma) {
        for (int i = t; i < total; i += T) {
            const int m = i / groups, k = 8 * (i - m * groups);
            float v[8];
            load8<DT>(x, m, k, K, vec, v);
            add_squares(ss, v, m);
        }
        rstd_of_sums(ss, M, K, eps, rstd);
    }
    // both passes take the values kept in registers (constant indices: no local memory), or read them again
    float amax = 0.f;
    bool finite = true;
    if (cached) {
#pragma unroll
        for (int c = 0; c < CACHED; c++)
            if (t + c * T < total) take_max(kept[c], amax, finite);
    } else {
#pragma unroll 2
        for (int i = t; i < total; i += T) {
            float v[8];
            load_group<DT>(x, gamma, rstd, i, groups, K, vec, v);
            take_max(v, amax, finite);
        }
    }
    float sx = div_rn(block_max(amax, red), E4M3_MAX);
    if (!(sx > 0.f)) sx = 1.f;
    const bool fast = __syncthreads_and(finite) && sx >= 0x1p-100f;
    const float r = div_rn(1.f, sx);
    if (cached) {
#pragma unroll
        for (int c = 0; c < CACHED; c++)
            if (t + c * T < total) write_codes(kept[c], fast, sx, r, xs + 8 * (t + c * T));
    } else {
#pragma unroll 2
        for (int i = t; i < total; i += T) {
            float v[8];
            load_group<DT>(x, gamma, rstd, i, groups, K, vec, v);
            write_codes(v, fast, sx, r, xs + 8 * i);
        }
    }
    __syncthreads();
    return sx;
}

// the codes of item j of this warp (chunks c .. c + U - 1 of its share of K, for one tile of 16 rows of w)
// (a tile's rows are 16 consecutive rows of w; with glu 8 gate rows f and their up rows F + f, F = N / 2)
template <int U>
__device__ __forceinline__ void load_item(u32x4* a, u32x4* b, const unsigned char* __restrict__ wq, int j,
                                          int items, int groups, int begin, int end, int g, int q, int N, int K,
                                          bool vec, int glu) {
    const int tile = blockIdx.x + (j / groups) * gridDim.x, c = begin + (j % groups) * U;
    i64 r0, r1;   // rows past the output's: the last, unused
    if (glu) {
        const int F = N / 2, f = imin(tile * 8 + g, F - 1);
        r0 = f;
        r1 = F + f;
    } else {
        r0 = imin(tile * FP8_GEMV3_ROWS + g, N - 1);
        r1 = imin(tile * FP8_GEMV3_ROWS + g + 8, N - 1);
    }
    load_chunks<U>(a, b, wq + r0 * K, wq + r1 * K, c, j < items ? end : c, q, K, vec);
}

template <class DT, int U>
__device__ __forceinline__ void gemv3(const typename DT::T* __restrict__ x, const unsigned char* __restrict__ wq,
                                      const float* __restrict__ w_scale, const typename DT::T* __restrict__ bias,
                                      const typename DT::T* __restrict__ residual,
                                      const typename DT::T* __restrict__ gamma, typename DT::T* __restrict__ y,
                                      int M, int N, int K, int per_channel, int act, float eps, int glu,
                                      const void* prefetch0, i64 prefetch0_bytes, const void* prefetch1,
                                      i64 prefetch1_bytes) {
    constexpr int WARPS = FP8_GEMV3_THREADS / 32;
    extern __shared__ __align__(16) unsigned char xcodes[];   // x's codes, M rows of S bytes
    __shared__ float part[2][WARPS][4][32];   // each warp's sums of a tile (two tiles: one barrier per tile)
    __shared__ float red[WARPS];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = lane >> 2, q = lane & 3;
    const int S = gemv3_x_stride(K);
    // with glu a tile is 8 outputs f: rows f (gate) and F + f (up) of w; y (M, F)
    const int outputs = glu ? N / 2 : N, tile_outputs = glu ? 8 : FP8_GEMV3_ROWS;
    // every warp takes the same share of K of every tile in U-chunk groups: item j = (tile j / groups, group)
    const int chunks = (K + FP8_GEMV3_CHUNK - 1) / FP8_GEMV3_CHUNK, share = (chunks + WARPS - 1) / WARPS;
    const int begin = imin(chunks, warp * share), end = imin(chunks, begin + share);
    const int groups = (share + U - 1) / U, tiles = (outputs + tile_outputs - 1) / tile_outputs;
    const int items = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * groups;
    const bool vec = (K & 15) == 0 && ((u64)wq & 15) == 0;
    // in the epilogue thread t < 128 finishes accumulator i = t / 32 of lane l = t % 32: y^T[row (l >> 2) +
    // 8 (i >> 1)][x's row 2 (l & 3) + (i & 1)]; with glu threads t < 64 finish output row (l >> 2) of the
    // tile from accumulators i (gate) and i + 2 (up)
    const int l = t & 31, i = t >> 5, m = 2 * (l & 3) + (i & 1);
    const int row = glu ? (l >> 2) : (l >> 2) + 8 * (i >> 1), finishers = glu ? 2 * 32 : 4 * 32;
    // two buffers, both in flight while x is quantised and while a tile's results are written
    u32x4 a0[U], b0[U], a1[U], b1[U];
    load_item<U>(a0, b0, wq, 0, items, groups, begin, end, g, q, N, K, vec, glu);
    load_item<U>(a1, b1, wq, 1, items, groups, begin, end, g, q, N, K, vec, glu);
    if (lane == 0)   // behind this kernel's first loads: DRAM serves them first
        l2_prefetch_hint(prefetch0, prefetch0_bytes, prefetch1, prefetch1_bytes, blockIdx.x * WARPS + warp,
                         gridDim.x * WARPS);
    pdl_wait();   // launched programmatically: x is the kernel ahead's output, and y may be what it reads
    const float sx = quantize_x<DT, FP8_GEMV3_X_CACHED>(x, gamma, eps, xcodes, M, K, S, red);
    pdl_launch_dependents();   // every block is past its wait: the next kernel (a norm, rope, swiglu) may start
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // this thread's output's sx * w_scale and bias + residual (with glu: the gate's, then the up's), read early
    float scale[2] = {0.f, 0.f}, shift[2] = {0.f, 0.f};
    // the products of item j, then the next item into its buffer, then (after a tile's last group) its
    // results: every warp reaches the barrier together
    auto step = [&](u32x4* a, u32x4* b, int j) {
        const int tile = j / groups, group = j % groups;
        const int n = (blockIdx.x + tile * gridDim.x) * tile_outputs + row;
        const bool writes = t < finishers && n < outputs && m < M;
        if (group == 0 && writes) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h && !glu) break;
                const int wrow = n + h * outputs;
                scale[h] = sx * w_scale[per_channel ? wrow : 0];
                shift[h] = (bias ? DT::ld(bias[wrow]) : 0.f) + (residual ? DT::ld(residual[(i64)m * N + n]) : 0.f);
            }
        }
        mma_chunks<U>(acc, a, b, xcodes, begin + group * U, end, g, q, M, S);
        load_item<U>(a, b, wq, j + 2, items, groups, begin, end, g, q, N, K, vec, glu);
        if (group != groups - 1) return;
        float (*p)[4][32] = part[tile & 1];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            p[warp][e][lane] = acc[e] + acc[4 + e];
            acc[e] = acc[4 + e] = 0.f;
        }
        __syncthreads();
        if (!writes) return;
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            sum[0] += p[w][i][l];
            if (glu) sum[1] += p[w][i + 2][l];
        }
        const float v = sum[0] * scale[0] + shift[0];
        y[(i64)m * outputs + n] = DT::st(glu ? apply_act<1u << ACT_SILU>(v, ACT_SILU) * (sum[1] * scale[1] + shift[1])
                                             : apply_act<ACTS>(v, act));
    };
    for (int j = 0; j < items; j += 2) {
        step(a0, b0, j);
        if (j + 1 < items) step(a1, b1, j + 1);
    }
}

}  // namespace fp8g

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define FP8_GEMM_PARAMS(T) const unsigned char* __restrict__ xq, const unsigned char* __restrict__ wq, \
    const float* __restrict__ x_scale, const float* __restrict__ w_scale, const T* __restrict__ bias,  \
    const T* __restrict__ residual, T* __restrict__ y, int M, int N, int K, int per_channel, int act

#define FP8_GEMM1(SUFFIX, DT)                                                                            \
    extern "C" __global__ void __launch_bounds__(FP8_GEMM_THREADS)                                       \
        fp8_gemm1_tiled_##SUFFIX(FP8_GEMM_PARAMS(libnn::DT::T)) {                                        \
        fp8g::gemm1<libnn::DT>(xq, wq, x_scale, w_scale, bias, residual, y, M, N, K, per_channel, act); \
    }

#define FP8_GEMV_PARAMS(T) const T* __restrict__ x, const unsigned char* __restrict__ wq,                   \
    const float* __restrict__ w_scale, const T* __restrict__ bias, const T* __restrict__ residual,        \
    const T* __restrict__ gamma, T* __restrict__ y, int M, int N, int K, int per_channel, int act, float eps, int glu, \
    const void* prefetch0, long long prefetch0_bytes, const void* prefetch1, long long prefetch1_bytes

#define FP8_GEMV3(SUFFIX, DT)                                                                            \
    extern "C" __global__ void __launch_bounds__(FP8_GEMV3_THREADS, FP8_GEMV3_BLOCKS_PER_SM)             \
        fp8_gemv3_##SUFFIX(FP8_GEMV_PARAMS(libnn::DT::T)) {                                              \
        fp8g::gemv3<libnn::DT, FP8_GEMV3_UNROLL>(x, wq, w_scale, bias, residual, gamma, y, M, N, K, per_channel, \
                                                  act, eps, glu, prefetch0, prefetch0_bytes, prefetch1,          \
                                                  prefetch1_bytes);                                              \
    }

FP8_GEMM1(f16, dt_f16)
FP8_GEMM1(bf16, dt_bf16)
FP8_GEMV3(f16, dt_f16)
FP8_GEMV3(bf16, dt_bf16)
