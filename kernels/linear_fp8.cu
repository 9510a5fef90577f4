/*
linear_fp8's custom path: y = act(sx * sw[n] * (xq @ wq.T) + bias + residual) for E4M3 codes xq (M, K) and
wq (N, K), row-major bytes, in the style of llm.c dev/cuda. The path libnn/ops/linear_fp8.py races against
cuBLASLt's FP8 GEMM; not tuned.

    xq  (M, K) E4M3 codes of x / sx (kernels/quantize_fp8.cu wrote them, and sx to x_scale[0])
    wq  (N, K) E4M3 codes of the weight; w_scale[0] (per tensor) or w_scale[n] (per output channel)
    y[m, n] = act(x_scale[0] * w_scale[n or 0] * sum_k e4m3(xq[m, k]) * e4m3(wq[n, k]) + bias[n] + residual[m, n])

Numerics: each code is decoded exactly to fp32 (a table of the 256 values in shared memory; 0x7f and 0xff
are NaN, which propagates), every product of two E4M3 values is exact in fp32 (4 significant bits each),
and the products are summed in fp32 by FFMA, in K order per thread. The scales, bias, residual and
activation (kernels/common.cuh's apply_act: none, relu, gelu, gelu_erf) are applied in fp32 and the result
rounded once to T (fp16 or bf16; raw 16-bit words converted with PTX, no toolkit header). bias and
residual are in T, or null.

Version 1: fp8_gemm1_tiled_{f16,bf16}
    A block computes a BM x BN tile of y with 256 threads (16 x 16), each a 4 x 4 grid of outputs spaced 16
    apart (rows ty + 16i, columns tx + 16j: a warp's stores are 16 consecutive columns). K is walked BK
    codes at a time: each thread decodes 8 codes of x's tile and 8 of w's into shared memory (fp32,
    k-major), with one 8-byte load where the 8 codes are in range and 8-byte aligned (K % 8 == 0 and the
    pointers 8-byte aligned), byte by byte with zeros past M, N and K otherwise.

Version 2: fp8_gemv2_{f16,bf16}, decode-sized M (M <= FP8_GEMV_MAX_M, M * Kp <= FP8_GEMV_MAX_MKP, with Kp
    K rounded up to FP8_GEMV_RUN)
    One kernel for the whole call: it quantises x itself, as kernels/quantize_fp8.cu does (the same amax,
    scale and codes, from kernels/fp8.cuh), so a decode step launches no quantiser. Every block reads all
    of x once (M * K elements, a few KB at decode) into shared memory, reducing max|x| on the way,
    computes sx and replaces each value by e4m3(x / sx) decoded to fp32, kept permuted (xs_slot) so that the warp's reads are free of bank conflicts;
    then each warp owns output columns n (grid-strided) and streams row n of wq once, 16 codes per lane
    and load, four 512-byte warp loads in flight (where K % 16 == 0 and wq is 16-byte aligned; byte
    loads otherwise), decoded with cvt.rn.f16x2.e4m3x2 (sm_89+; the exact arithmetic decode below
    that, never run: FP8 refuses older GPUs), and sums the M dot products in fp32 across the warp. The
    epilogue is version 1's. The sums run in another order than version 1's: results agree to fp32
    rounding, not bit for bit.

LAUNCH (version 1)
    (const unsigned char* xq, const unsigned char* wq, const float* x_scale, const float* w_scale,
     const T* bias, const T* residual, T* y, int M, int N, int K, int per_channel, int act)
    block (FP8_GEMM_THREADS, 1, 1), grid (ceil(M / FP8_GEMM_BM), ceil(N / FP8_GEMM_BN), 1), no dynamic
    shared memory. Preconditions: M, N, K >= 1; N <= 65535 * FP8_GEMM_BN; y does not overlap the inputs;
    element offsets are 64-bit.

LAUNCH (version 2)
    (const T* x, const unsigned char* wq, const float* w_scale, const T* bias, const T* residual, T* y,
     int M, int N, int K, int per_channel, int act)
    block (FP8_GEMM_THREADS, 1, 1), grid (min(ceil(N / (FP8_GEMM_THREADS / 32)), FP8_GEMV_BLOCKS_PER_SM x SMs), 1, 1),
    dynamic shared memory 4 * M * Kp bytes (with the kernel's 32 static bytes, at most 48 KB: no opt-in).
    Preconditions: 1 <= M <= FP8_GEMV_MAX_M, M * Kp <= FP8_GEMV_MAX_MKP, K >= 1, N >= 1; x (M, K) and y (M, N) row-major and contiguous; y does not overlap the inputs.
*/
#include "common.cuh"
#include "fp8.cuh"

constexpr int FP8_GEMM_THREADS = 256;
constexpr int FP8_GEMM_BM = 64;   // rows of y per block
constexpr int FP8_GEMM_BN = 64;   // columns of y per block
constexpr int FP8_GEMM_BK = 32;   // codes of K per step: BM * BK / 8 = one 8-code group per thread
constexpr int FP8_GEMV_MAX_M = 8;          // rows of x version 2 takes (a decode step's batch)
constexpr int FP8_GEMV_MAX_MKP = 11776;    // M * Kp (K rounded up to 512): 4 * M * Kp bytes + 32 <= 48 KB
constexpr int FP8_GEMV_RUN = 512;          // codes a warp loads at once (Kp's multiple)
constexpr int FP8_GEMV_BLOCKS_PER_SM = 2;  // every block quantises all of x: few blocks, columns grid-strided

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

// codes c (two, low byte first) decoded to fp32
__device__ __forceinline__ void e4m3x2_values(u32 c, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((u16)c));
    lo = f16_to_f32((u16)(h & 0xffffu));
    hi = f16_to_f32((u16)(h >> 16));
#else
    lo = e4m3_value(c & 0xffu);
    hi = e4m3_value((c >> 8) & 0xffu);
#endif
}

// Slot of x's value k in shared memory (rows padded to Kp, a multiple of 512): permuted so that the 4
// values a lane multiplies with word j of its 16-byte load of codes 512c + 16l .. +15 sit in 16-byte slot
// l of a run of 32 such slots, consecutive across the warp (no bank conflicts):
// k = 512c + 16l + 4j + e  ->  512c + 128j + 4l + e
__device__ __forceinline__ int xs_slot(int k) {
    return (k & ~511) | ((k & 12) << 5) | ((k & 496) >> 2) | (k & 3);
}

// acc[m] += the 4 codes of word w times x's values at xv + m * Kp (4 consecutive floats)
template <int MAX_M>
__device__ __forceinline__ void dot4(u32 w, const float* __restrict__ xv, int M, int Kp, float* acc) {
    float v0, v1, v2, v3;
    e4m3x2_values(w, v0, v1);
    e4m3x2_values(w >> 16, v2, v3);
#pragma unroll
    for (int m = 0; m < MAX_M; m++) {
        if (m >= M) break;
        const f32x4 x4 = *reinterpret_cast<const f32x4*>(xv + m * Kp);
        acc[m] = fmaf(v0, x4.x, fmaf(v1, x4.y, fmaf(v2, x4.z, fmaf(v3, x4.w, acc[m]))));
    }
}

template <class DT>
__device__ __forceinline__ void gemv2(const typename DT::T* __restrict__ x, const unsigned char* __restrict__ wq,
                                      const float* __restrict__ w_scale, const typename DT::T* __restrict__ bias,
                                      const typename DT::T* __restrict__ residual, typename DT::T* __restrict__ y,
                                      int M, int N, int K, int per_channel, int act) {
    extern __shared__ float xs[];   // e4m3(x / sx), M rows of Kp slots (xs_slot)
    __shared__ float red[FP8_GEMM_THREADS / 32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int Kp = (K + 511) & ~511;
    // x read once, into its slots (the loads independent of each other: unrolled, several in flight),
    // max|x| on the way; then each thread quantises the slots it wrote
    float amax = 0.f;
    for (int m = 0; m < M; m++) {
#pragma unroll 4
        for (int k = t; k < K; k += blockDim.x) {
            const float v = DT::ld(x[(i64)m * K + k]);
            xs[m * Kp + xs_slot(k)] = v;
            amax = fmaxf(amax, finite_abs(v));
        }
    }
    float sx = div_rn(block_max(amax, red), E4M3_MAX);
    if (!(sx > 0.f)) sx = 1.f;
    for (int m = 0; m < M; m++)
        for (int k = t; k < K; k += blockDim.x) {
            float& slot = xs[m * Kp + xs_slot(k)];
            slot = e4m3_value(e4m3_code(div_rn(slot, sx)));
        }
    __syncthreads();
    const bool vec = (K & 15) == 0 && ((u64)wq & 15) == 0;
    for (int n = blockIdx.x * (FP8_GEMM_THREADS / 32) + warp; n < N; n += gridDim.x * (FP8_GEMM_THREADS / 32)) {
        const unsigned char* row = wq + (i64)n * K;
        float acc[FP8_GEMV_MAX_M] = {};
        if (vec) {
            // four 512-code runs at a time: four coalesced 512-byte warp loads in flight, then their products
            for (int c0 = 0; c0 < K; c0 += 4 * 512) {
                u32x4 w[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {   // zeros past K (a conditional load spilled w under ptxas 13.0)
                    const int k = c0 + 512 * u + 16 * lane;
                    w[u] = k < K ? *reinterpret_cast<const u32x4*>(row + k) : u32x4{0u, 0u, 0u, 0u};
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    if (c0 + 512 * u + 16 * lane >= K) continue;
                    const float* xv = xs + c0 + 512 * u + 4 * lane;
                    dot4<FP8_GEMV_MAX_M>(w[u].a, xv, M, Kp, acc);
                    dot4<FP8_GEMV_MAX_M>(w[u].b, xv + 128, M, Kp, acc);
                    dot4<FP8_GEMV_MAX_M>(w[u].c, xv + 256, M, Kp, acc);
                    dot4<FP8_GEMV_MAX_M>(w[u].d, xv + 384, M, Kp, acc);
                }
            }
        } else {
            for (int k = lane; k < K; k += 32) {
                const float v = e4m3_value(row[k]);
                const int slot = xs_slot(k);
#pragma unroll
                for (int m = 0; m < FP8_GEMV_MAX_M; m++) {
                    if (m >= M) break;
                    acc[m] = fmaf(v, xs[m * Kp + slot], acc[m]);
                }
            }
        }
        const float s = sx * w_scale[per_channel ? n : 0];
        const float b = bias ? DT::ld(bias[n]) : 0.f;
#pragma unroll
        for (int m = 0; m < FP8_GEMV_MAX_M; m++) {
            if (m >= M) break;
            float sum = acc[m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                const i64 o = (i64)m * N + n;
                float v = sum * s + b;
                if (residual) v += DT::ld(residual[o]);
                y[o] = DT::st(apply_act<ACTS>(v, act));
            }
        }
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
    T* __restrict__ y, int M, int N, int K, int per_channel, int act

#define FP8_GEMV2(SUFFIX, DT)                                                                            \
    extern "C" __global__ void __launch_bounds__(FP8_GEMM_THREADS, FP8_GEMV_BLOCKS_PER_SM)               \
        fp8_gemv2_##SUFFIX(FP8_GEMV_PARAMS(libnn::DT::T)) {                                              \
        fp8g::gemv2<libnn::DT>(x, wq, w_scale, bias, residual, y, M, N, K, per_channel, act);           \
    }

FP8_GEMM1(f16, dt_f16)
FP8_GEMM1(bf16, dt_bf16)
FP8_GEMV2(f16, dt_f16)
FP8_GEMV2(bf16, dt_bf16)
