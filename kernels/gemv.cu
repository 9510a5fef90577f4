/*
linear's, linear_fp8's and rms_norm_linear's GEMV path: a decode step's matrix-vector products at batch 1,
streaming w once at close to the copy rate, with the fusions a decoder layer wants around its GEMMs (version
3: version 2 (version 1 plus the L2 prefetch of the next kernel's weight) plus E4M3 weights; the figures are
in benchmarks/RESULTS.md, fourteenth, sixteenth and twenty-first sessions):

    x         (K,) one row; with `gamma`, RMS-normalised first (below)
    w         (N, K) row-major, contiguous: T values (nn.Linear's weight; a stacked QKV or gate_up weight), or
              E4M3 codes (gemv_*e4m3_*), W[n, k] = w_scale[n or 0] * e4m3(w[n, k])
    y[n]      = act(sum_k x'[k] W[n, k] + bias[n] + residual[n])              gemv_*
    y[f]      = silu(v[f]) * v[F + f],  v = x' @ W.T + bias,  F = N / 2         gemv_glu_* (SwiGLU)
    x'[k]     = x[k] where gamma is null; else (x[k] * rstd * gamma[k]) rounded to T,
                rstd = 1 / sqrt((1/K) sum_k x[k]^2 + eps)        (kernels/rms_norm.cu's formula: rsqrtf, the
                mean by div.full; the sum of squares in another order, so not always the same bits)
    E4M3:     x' is quantised as linear_fp8 quantises x (kernels/quantize_fp8.cu's amax, scale sx and codes,
              computed as linear_fp8.cu's version 3 computes them), and the sum is
              sx * w_scale[n or 0] * sum_k e4m3(x'q[k]) * e4m3(w[n, k])

Algorithm (a bandwidth kernel in the style of llm.c dev/cuda, not a tiled GEMM): each warp takes whole
rows of w, grid-strided (with GLU the pair of rows f and F + f, so that the gate and up sums meet in one
warp), and walks a row in batches of B 16-byte chunks per lane (lane l: chunks 32 (b B + u) + l), with
non-caching loads, two batches in flight (the next row's first batch loads while a row finishes). x'
sits in shared memory in fp32, staged once per block. Products are summed in fp32 by FFMA in chunk order
per lane and the lanes' sums by a butterfly (__shfl_xor_sync): a fixed order, so results repeat bit for
bit. The epilogue (bias, residual, activation; or SwiGLU) is in fp32, rounded once to T. No tensor
cores: at one row the GEMV is bound by w's bytes, which FFMA keeps up with; at 2 and 4 rows (an earlier
draft) the FFMA and shared-memory reads of x' were the bound, and cuBLASLt won, so M = 1 only.
E4M3 weights: a chunk is 16 codes, widened by the hardware's conversion (cvt.rn.f16x2.e4m3x2, sm_89 and
newer) to fp16 and then fp32, exactly; x's codes are staged as their values (exact in fp32), in four
planes of float4 so that the lanes' reads of x do not collide in the banks (stage_x_e4m3). Every product
of two E4M3 values is exact in fp32; the sums are as above, two per lane (even and odd words of a chunk).
A row's scale is read with its last batch, so that it costs no round trip after the data it goes with.
Both stagings read gamma's first group before the wait and x from L2 once. The tensor cores (mma.sync on the lanes' own codes) were slower
here: benchmarks/RESULTS.md, twenty-first session. This replaced linear_fp8.cu's version 3 at one row.

Activations (kernels/common.cuh's codes): none, relu, gelu (tanh), gelu_erf. NaN propagates (an inf or NaN
in x' makes every E4M3 output NaN: E4M3 has no infinity, and neither takes part in sx).
T: fp16 or bf16 (raw 16-bit words converted with PTX; no CUDA toolkit header); sm_80 or newer, E4M3 sm_89.

LAUNCH (gemv_{,glu_}{f16,bf16}: GEMV_PARAMS; gemv_{,glu_}e4m3_{f16,bf16}: GEMV_E4M3_PARAMS, the same plus
the weight's scales)
    (const T* x, const T* w, const T* bias, const T* residual, const T* gamma, T* y, int N, int K,
     float eps, int act, const void* prefetch0, long long prefetch0_bytes, const void* prefetch1,
     long long prefetch1_bytes)
    (const T* x, const unsigned char* w, const float* w_scale, int per_channel, const T* bias, const T* residual,
     const T* gamma, T* y, int N, int K, float eps, int act, <the same four prefetch parameters>)
    block (GEMV_THREADS, 1, 1), grid (min(ceil(R / GEMV_WARPS), GEMV_BLOCKS_PER_SM x SMs), 1, 1), R = N rows
    (N / 2 row pairs with GLU); dynamic shared memory 4 * K bytes (above 48 KB the launcher opts in).
    Preconditions: N >= 1 (even with GLU), 8 <= K <= GEMV_MAX_K, K % 8 == 0 (E4M3: K % 16 == 0); w
    16-byte aligned; x and gamma 16-byte aligned (E4M3: read value by value where either is not); bias,
    residual and gamma may be null (residual null and act none with GLU); w_scale (N,) with per_channel,
    else (1,); y (R,) overlaps no input. On sm_90 and newer it is launched with programmatic stream
    serialization: it loads its first two batches of w, then waits (pdl_wait) for the kernel ahead, whose
    output x is, and lets the kernel after it start once every block has staged x'. So w (and gamma and
    w_scale, read before the wait too) must be what no kernel in flight writes (a weight), as for
    linear_fp8.cu's GEMV: a kernel ahead may still be running when w is first read. Where a call copies
    one of them first (it came strided), the launchers launch plainly (ops/linear.py read_in_place).
    Behind its first loads, on sm_90 and newer, the grid's warps prefetch into L2 the byte ranges
    [prefetch0, + prefetch0_bytes) and [prefetch1, + prefetch1_bytes) (common.cuh l2_prefetch_hint: null
    or 0 bytes, nothing): what the next GEMV reads first, which no kernel in flight may write either.
*/
#include "common.cuh"
#include "fp8.cuh"

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;
constexpr int GEMV_CHUNKS = 8;          // 16-byte chunks of w a lane has in each of its two batches in flight
constexpr int GEMV_BLOCKS_PER_SM = 2;   // the launch bound (<= 128 registers) and the grid's blocks per SM
constexpr int GEMV_MAX_K = 24576;       // x' in fp32 shared memory, 4 * K bytes: two blocks fit an sm_90 SM
static_assert(2 * 4 * GEMV_MAX_K <= 227 * 1024, "two blocks' x' fit in an sm_90 SM's shared memory");

namespace gemvk {

using namespace libnn;

// 16 bytes of w, not kept in L1 (each is read once)
__device__ __forceinline__ u32x4 ld_stream(const void* p) {
    u32x4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
    return v;
}

template <class DT>
__device__ __forceinline__ void unpack8(const u32x4& v, float* f) {
    const u32 words[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int e = 0; e < 8; e++) f[e] = DT::ld((typename DT::T)(words[e / 2] >> (16 * (e & 1))));
}

// 1 / sqrt((1/K) sum of squares + eps) (kernels/rms_norm.cu's formula: the mean by div.full, rsqrtf) from each
// thread's share ss: the warps' sums through `red` (GEMV_WARPS floats), added in a fixed order
__device__ __forceinline__ float block_rstd(float ss, int K, float eps, float* red) {
    const int t = threadIdx.x;
    ss = warp_sum(ss);
    if ((t & 31) == 0) red[t >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int w = 0; w < GEMV_WARPS; w++) ss += red[w];
    return rsqrtf(fdiv_full(ss, (float)K) + eps);
}

// x' into xs (K floats): x, or its RMS normalisation rounded to T; returns 1 (x's scale, as
// stage_x_e4m3 returns its own). gamma0 is gamma's group t (this thread's first), read before the kernel
// ahead finished; with gamma the first pass leaves x in this thread's slots of xs, where the second reads it
// (x is read from L2 once). Ends with a __syncthreads().
template <class DT>
__device__ __forceinline__ float stage_x(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ gamma,
                                        float* xs, int K, float eps, u32x4 gamma0) {
    __shared__ float red[GEMV_WARPS];
    const int t = threadIdx.x, groups = K / 8;
    float rstd = 1.f;
    if (gamma) {
        float ss = 0.f;
        for (int i = t; i < groups; i += GEMV_THREADS) {
            float f[8];
            unpack8<DT>(*reinterpret_cast<const u32x4*>(x + 8 * i), f);
#pragma unroll
            for (int e = 0; e < 8; e++) ss = fmaf(f[e], f[e], ss);
            float4* d = reinterpret_cast<float4*>(xs + 8 * i);
            d[0] = make_float4(f[0], f[1], f[2], f[3]);
            d[1] = make_float4(f[4], f[5], f[6], f[7]);
        }
        rstd = block_rstd(ss, K, eps, red);
    }
    for (int i = t; i < groups; i += GEMV_THREADS) {
        float f[8];
        float4* d = reinterpret_cast<float4*>(xs + 8 * i);
        if (gamma) {
            const float4 lo = d[0], hi = d[1];
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            float g[8];
            unpack8<DT>(i == t ? gamma0 : *reinterpret_cast<const u32x4*>(gamma + 8 * i), g);
#pragma unroll
            for (int e = 0; e < 8; e++) f[e] = DT::ld(DT::st(v[e] * rstd * g[e]));
        } else {
            unpack8<DT>(*reinterpret_cast<const u32x4*>(x + 8 * i), f);
        }
        d[0] = make_float4(f[0], f[1], f[2], f[3]);
        d[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
    return 1.f;
}

// batch `b` of row `row` (chunks 32 (b B + u) + lane, u < B; zeros past the row) into buf; E is w's element
// (16-bit values, or bytes of E4M3 codes), CODES of them to a chunk
template <int B, class E>
__device__ __forceinline__ void load_batch(u32x4* buf, const E* __restrict__ w, i64 row, int b, int chunks, int K,
                                           int lane, bool live) {
    constexpr int CODES = 16 / sizeof(E);
#pragma unroll
    for (int u = 0; u < B; u++) {
        const int c = 32 * (b * B + u) + lane;
        buf[u] = live && c < chunks ? ld_stream(w + row * K + CODES * c) : u32x4{0u, 0u, 0u, 0u};
    }
}

// acc + the dot product of batch b's chunks with x'
template <class DT, int B>
__device__ __forceinline__ float fma_batch(float acc, const u32x4* buf, const float* xs, int b, int chunks, int lane) {
#pragma unroll
    for (int u = 0; u < B; u++) {
        const int c = 32 * (b * B + u) + lane;
        if (c >= chunks) break;
        float wf[8];
        unpack8<DT>(buf[u], wf);
        const float4* xv = reinterpret_cast<const float4*>(xs + 8 * c);
        const float4 x0 = xv[0], x1 = xv[1];
        acc = fmaf(wf[0], x0.x, acc); acc = fmaf(wf[1], x0.y, acc); acc = fmaf(wf[2], x0.z, acc);
        acc = fmaf(wf[3], x0.w, acc); acc = fmaf(wf[4], x1.x, acc); acc = fmaf(wf[5], x1.y, acc);
        acc = fmaf(wf[6], x1.z, acc); acc = fmaf(wf[7], x1.w, acc);
    }
    return acc;
}

// ---- E4M3 weights -------------------------------------------------------------------------------------
// x's quantised values sit in xs in four planes of float4: plane q holds x'[16 c + 4 q .. 16 c + 4 q + 3] at
// float4 index q * chunks + c, so that the lanes of a warp, which read chunks c, c + 1, ..., read consecutive
// 16-byte words of a plane (no bank conflict; in x's own order the lanes' reads lie 64 bytes apart)
__device__ __forceinline__ float4* e4m3_plane_slot(float* xs, int chunks, int k) {
    return reinterpret_cast<float4*>(xs) + ((k >> 2) & 3) * chunks + (k >> 4);
}

// the values of two E4M3 codes (the low 16 bits of `two`, the lower code first): exact
__device__ __forceinline__ void e4m3x2_values(u32 two, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    u32 h;
    asm("{ .reg .b16 c; cvt.u16.u32 c, %1; cvt.rn.f16x2.e4m3x2 %0, c; }" : "=r"(h) : "r"(two));
    lo = f16_to_f32((u16)(h & 0xffffu));
    hi = f16_to_f32((u16)(h >> 16));
#else
    lo = e4m3_value(two & 0xffu);
    hi = e4m3_value((two >> 8) & 0xffu);
#endif
}

// acc + the dot product of batch b's chunks of 16 codes with x's values (two sums, even and odd words of a
// chunk, so that consecutive FMAs do not wait for each other)
template <int B>
__device__ __forceinline__ float fma_batch_e4m3(float acc, const u32x4* buf, const float* xs, int b, int chunks,
                                                int lane) {
    float odd = 0.f;
#pragma unroll
    for (int u = 0; u < B; u++) {
        const int c = 32 * (b * B + u) + lane;
        if (c >= chunks) break;
        const u32 words[4] = {buf[u].a, buf[u].b, buf[u].c, buf[u].d};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float4 xv = reinterpret_cast<const float4*>(xs)[q * chunks + c];
            float w0, w1, w2, w3;
            e4m3x2_values(words[q], w0, w1);
            e4m3x2_values(words[q] >> 16, w2, w3);
            float& s = q & 1 ? odd : acc;
            s = fmaf(w0, xv.x, s); s = fmaf(w1, xv.y, s); s = fmaf(w2, xv.z, s); s = fmaf(w3, xv.w, s);
        }
    }
    return acc + odd;
}

// 8 values of x from k (16-byte aligned where `vec`, else read one by one)
template <class DT>
__device__ __forceinline__ void load8(const typename DT::T* __restrict__ p, bool vec, float* f) {
    if (vec) {
        unpack8<DT>(*reinterpret_cast<const u32x4*>(p), f);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) f[e] = DT::ld(p[e]);
}

// x' quantised as kernels/quantize_fp8.cu quantises a tensor (the same amax, scale and codes; linear_fp8.cu's
// quantize_x computes them alike), the codes' values into xs (e4m3_plane_slot's layout); returns the scale sx.
// x' is x, or with gamma its RMS normalisation rounded to T (stage_x's); gamma0 is gamma's group t (this
// thread's first), read before the kernel ahead finished. x is read from L2 once: each pass leaves its values
// (x, then x') in this thread's own slots of xs, where the next pass reads them, so the passes meet only at
// the norm's and the amax's barriers. Ends with a __syncthreads().
template <class DT>
__device__ __forceinline__ float stage_x_e4m3(const typename DT::T* __restrict__ x,
                                              const typename DT::T* __restrict__ gamma, float* xs, int K, float eps,
                                              u32x4 gamma0) {
    __shared__ float red[GEMV_WARPS], top[GEMV_WARPS];
    const int t = threadIdx.x, groups = K / 8, chunks = K / 16;
    const bool vec = ((u64)x & 15) == 0 && ((u64)gamma & 15) == 0;   // gamma: null, or 16-byte aligned
    float rstd = 1.f;
    if (gamma) {   // x into this thread's slots of xs on the way: the second pass reads it there, not from L2
        float ss = 0.f;
        for (int i = t; i < groups; i += GEMV_THREADS) {
            float f[8];
            load8<DT>(x + 8 * i, vec, f);
#pragma unroll
            for (int e = 0; e < 8; e++) ss = fmaf(f[e], f[e], ss);
            *e4m3_plane_slot(xs, chunks, 8 * i) = make_float4(f[0], f[1], f[2], f[3]);
            *e4m3_plane_slot(xs, chunks, 8 * i + 4) = make_float4(f[4], f[5], f[6], f[7]);
        }
        rstd = block_rstd(ss, K, eps, red);
    }
    float amax = 0.f;
    bool finite = true;
    for (int i = t; i < groups; i += GEMV_THREADS) {
        float f[8];
        if (gamma) {
            const float4 lo = *e4m3_plane_slot(xs, chunks, 8 * i), hi = *e4m3_plane_slot(xs, chunks, 8 * i + 4);
            float g[8];
            if (i == t && vec) unpack8<DT>(gamma0, g);
            else load8<DT>(gamma + 8 * i, vec, g);
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int e = 0; e < 8; e++) f[e] = DT::ld(DT::st(v[e] * rstd * g[e]));
        } else {
            load8<DT>(x + 8 * i, vec, f);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            amax = fmaxf(amax, finite_abs(f[e]));
            finite &= fabsf(f[e]) <= F32_MAX;
        }
        *e4m3_plane_slot(xs, chunks, 8 * i) = make_float4(f[0], f[1], f[2], f[3]);
        *e4m3_plane_slot(xs, chunks, 8 * i + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
    float sx = div_rn(block_max(amax, top), E4M3_MAX);
    if (!(sx > 0.f)) sx = 1.f;
    const bool fast = __syncthreads_and(finite) && sx >= 0x1p-100f;
    const float r = div_rn(1.f, sx);
    for (int i = t; i < groups; i += GEMV_THREADS) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float4* slot = e4m3_plane_slot(xs, chunks, 8 * i + 4 * h);
            const float4 v = *slot;
            u32 codes;
            if (fast) {
                codes = e4m3x2_code(div_by_reciprocal(v.x, sx, r), div_by_reciprocal(v.y, sx, r)) |
                        e4m3x2_code(div_by_reciprocal(v.z, sx, r), div_by_reciprocal(v.w, sx, r)) << 16;
            } else {
                codes = e4m3_code(div_rn(v.x, sx)) | e4m3_code(div_rn(v.y, sx)) << 8 |
                        e4m3_code(div_rn(v.z, sx)) << 16 | e4m3_code(div_rn(v.w, sx)) << 24;
            }
            float4 q;
            e4m3x2_values(codes, q.x, q.y);
            e4m3x2_values(codes >> 16, q.z, q.w);
            *slot = q;
        }
    }
    __syncthreads();
    return sx;
}

// RW rows of w per warp item: 1, or 2 with GLU (rows f and F + f); w holds T values, or with E4M3 codes whose
// row n is scaled by w_scale[n] (per_channel) or w_scale[0]
template <class DT, bool GLU, class E>
__device__ __forceinline__ void gemv(const typename DT::T* __restrict__ x, const E* __restrict__ w,
                                     const float* __restrict__ w_scale, int per_channel,
                                     const typename DT::T* __restrict__ bias, const typename DT::T* __restrict__ residual,
                                     const typename DT::T* __restrict__ gamma, typename DT::T* __restrict__ y,
                                     int N, int K, float eps, int act, const void* prefetch0, i64 prefetch0_bytes,
                                     const void* prefetch1, i64 prefetch1_bytes) {
    constexpr bool E4M3 = sizeof(E) == 1;
    constexpr int RW = GLU ? 2 : 1, B = GEMV_CHUNKS / RW, CODES = 16 / sizeof(E);
    extern __shared__ __align__(16) float xs[];
    const int lane = threadIdx.x & 31, warps = gridDim.x * GEMV_WARPS;
    const int gw = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int R = N / RW, chunks = K / CODES, batches = (chunks + 32 * B - 1) / (32 * B);
    const int items = gw < R ? ((R - 1 - gw) / warps + 1) * batches : 0;
    // item j: batch j % batches of this warp's row j / batches (rows gw, gw + warps, ...)
    // with E4M3 codes each buffer also holds its rows' scales, read with their last batch: the epilogue that
    // uses them follows that batch's products without a round trip of its own
    auto load = [&](u32x4* buf, float* scale, int j) {
        const i64 row = gw + (i64)(j / batches) * warps;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            load_batch<B>(buf + r * B, w, row + (i64)r * R, j % batches, chunks, K, lane, j < items);
            if (E4M3 && j < items && j % batches == batches - 1) scale[r] = w_scale[per_channel ? row + r * R : 0];
        }
    };
    u32x4 buf0[RW * B], buf1[RW * B];
    float scale0[RW] = {}, scale1[RW] = {};
    load(buf0, scale0, 0);
    load(buf1, scale1, 1);
    if (lane == 0)   // behind this kernel's first loads: DRAM serves them first
        l2_prefetch_hint(prefetch0, prefetch0_bytes, prefetch1, prefetch1_bytes, gw, warps);
    u32x4 gamma0 = {0u, 0u, 0u, 0u};
    if (gamma && (int)threadIdx.x < K / 8 && ((u64)gamma & 15) == 0)
        gamma0 = *reinterpret_cast<const u32x4*>(gamma + 8 * threadIdx.x);
    pdl_wait();   // x is the kernel ahead's output, and y may be what it reads
    const float sx = E4M3 ? stage_x_e4m3<DT>(x, gamma, xs, K, eps, gamma0) : stage_x<DT>(x, gamma, xs, K, eps, gamma0);
    pdl_launch_dependents();
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) acc[r] = 0.f;
    auto step = [&](u32x4* buf, float* scale, int j) {
        const int b = j % batches;
#pragma unroll
        for (int r = 0; r < RW; r++)
            acc[r] = E4M3 ? fma_batch_e4m3<B>(acc[r], buf + r * B, xs, b, chunks, lane)
                          : fma_batch<DT, B>(acc[r], buf + r * B, xs, b, chunks, lane);
        float row_scale[RW];
#pragma unroll
        for (int r = 0; r < RW; r++) row_scale[r] = E4M3 ? sx * scale[r] : 1.f;
        load(buf, scale, j + 2);
        if (b != batches - 1) return;
        const int n = gw + (j / batches) * warps;
        float v[RW];
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const float sum = warp_sum(acc[r]);
            v[r] = (E4M3 ? sum * row_scale[r] : sum) + (bias ? DT::ld(bias[n + r * R]) : 0.f);
            acc[r] = 0.f;
        }
        if (lane != 0) return;
        if (GLU) y[n] = DT::st(apply_act<1u << ACT_SILU>(v[0], ACT_SILU) * v[RW - 1]);
        else y[n] = DT::st(apply_act<ACT_LINEAR | 1u << ACT_GELU_ERF>(v[0] + (residual ? DT::ld(residual[n]) : 0.f), act));
    };
    for (int j = 0; j < items; j += 2) {
        step(buf0, scale0, j);
        if (j + 1 < items) step(buf1, scale1, j + 1);
    }
}

}  // namespace gemvk

#define GEMV_PARAMS(T) const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,          \
    const T* __restrict__ residual, const T* __restrict__ gamma, T* __restrict__ y, int N, int K, float eps, int act, \
    const void* prefetch0, long long prefetch0_bytes, const void* prefetch1, long long prefetch1_bytes

#define GEMV_E4M3_PARAMS(T) const T* __restrict__ x, const unsigned char* __restrict__ w,                   \
    const float* __restrict__ w_scale, int per_channel, const T* __restrict__ bias,                           \
    const T* __restrict__ residual, const T* __restrict__ gamma, T* __restrict__ y, int N, int K, float eps, int act, \
    const void* prefetch0, long long prefetch0_bytes, const void* prefetch1, long long prefetch1_bytes

#define GEMV(NAME, DT, GLU)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_BLOCKS_PER_SM) NAME(GEMV_PARAMS(libnn::DT::T)) { \
        gemvk::gemv<libnn::DT, GLU>(x, w, nullptr, 0, bias, residual, gamma, y, N, K, eps, act, prefetch0,      \
                                    prefetch0_bytes, prefetch1, prefetch1_bytes);                              \
    }

#define GEMV_E4M3(NAME, DT, GLU)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_BLOCKS_PER_SM) NAME(GEMV_E4M3_PARAMS(libnn::DT::T)) { \
        gemvk::gemv<libnn::DT, GLU>(x, w, w_scale, per_channel, bias, residual, gamma, y, N, K, eps, act, \
                                          prefetch0, prefetch0_bytes, prefetch1, prefetch1_bytes);             \
    }

GEMV(gemv_f16, dt_f16, false)
GEMV(gemv_glu_f16, dt_f16, true)
GEMV(gemv_bf16, dt_bf16, false)
GEMV(gemv_glu_bf16, dt_bf16, true)
GEMV_E4M3(gemv_e4m3_f16, dt_f16, false)
GEMV_E4M3(gemv_glu_e4m3_f16, dt_f16, true)
GEMV_E4M3(gemv_e4m3_bf16, dt_bf16, false)
GEMV_E4M3(gemv_glu_e4m3_bf16, dt_bf16, true)
