/*
RMS normalization over the last dimension, for inference (LLaMA's RMSNorm), in the style of llm.c
dev/cuda, with the residual add of a pre-norm decoder block fused in front of it:

    h[r, c] = x[r, c] + res[r, c]   (in fp32; h = x where res is null)
    y[r, c] = h[r, c] * rstd_r * w[c]
    rstd_r  = 1 / sqrt((1/N) sum_c h[r, c]^2 + eps)
    s[r, c] = h[r, c] rounded to T  (only where s is not null)

x, res, y and s are (M, N) row-major and contiguous; w is (N,); res, w and s may each be null (res:
plain RMS norm; w: 1; s: the sum is not written). I/O in fp32, fp16 or bf16 (raw 16-bit words,
converted with PTX), all arithmetic in fp32. It includes no CUDA toolkit header (only
kernels/row_norm.cuh, the row sum, register layout and group store it shares with
kernels/layer_norm.cu and kernels/embedding.cu); sm_80 or newer (cvt.rn.bf16.f32).

A pre-norm block carries h on to the next block and normalizes it here, so with s the kernels move
4 row-sized arrays (x, res, y, s) where an add kernel then an RMS norm moved 5. y is the
normalization of h in fp32, not of s rounded to T (for fp16/bf16 inputs h is then x + res exactly,
as layer_norm.cu's comment explains).

Numerics: one statistic, the sum of squares, taken in one pass: its terms are >= 0, so nothing
cancels and layer_norm.cu's pivot and second pass are not needed. A row sum is: each thread sums
its squares in order, a butterfly over the warp (__shfl_xor_sync), and for versions 2 and 3 the
block's warp sums in a fixed order through shared memory. The mean is that sum divided by N, per
row (div.full, 2 ulp: a 1/N computed once and held across the row loop was spilled to the stack by
CUDA 13's ptxas in rms1_warp_vec4_f16 on sm_80), and rstd is rsqrtf (2 ulp): about 1e-7 relative in
fp32. Limit: h^2 overflows fp32 for |h| > ~1.8e19, which fp32 and bf16 inputs can hold (fp16
cannot); such a row's sum is inf, rstd 0, and its y 0 (NaN where h itself is infinite).

Versions (libnn/ops/rms_norm.py picks one through libnn/ops/row_kernels.py, the scheme and LAUNCH
table layer_norm.cu and embedding.cu share; all take the same parameters, and each reads res and
writes s with the accesses it makes of x and y):

1) rms1_warp_{vec,sca}{1,2,4}_{f32,f16,bf16}, and rms1_warp_{vec,sca}8_f32
   One row per warp, 4 rows per 128-thread block, the row held in registers: lane l holds VPT
   groups of V consecutive elements (V = 4 fp32, 8 fp16/bf16: 16 bytes), group j at columns
   (32 j + l) V onwards. No shared memory, no barrier. N <= 32 VPT V: up to N = 1024.
2) rms2_block_vec{2,4,8}_*
   One row per block of blockDim.x threads (a multiple of 32, at most 512) in the same layout; for
   N <= blockDim.x VPT V, i.e. up to 16384 (fp32) and 32768 (fp16/bf16). 16-byte accesses only.
3) rms3_loop_*
   One row per 512-thread block, any N and alignment, element-wise: one strided pass for the sum of
   squares (writing s), one for the output, which reads x and res again (two passes where
   layer_norm.cu's loop takes three). For rows longer than version 2 holds, and rows longer than
   1024 that cannot be moved 16 bytes at a time (N % V != 0 or a misaligned pointer).

vec: 16-byte loads and stores of x, res, w, y and s (N % V == 0 and every pointer 16-byte aligned);
sca: the same groups element by element with a bounds check each (any N, any alignment).

LAUNCH (every kernel takes the same parameters; the table is layer_norm.cu's)
    (const T* x, const T* res, const T* w, T* y, T* s, long long M, int N, float eps)
    T = float (f32) or unsigned short (f16/bf16 bits); res, w and s may be null.
    On sm_90 and newer it is launched with programmatic stream serialization: it waits (pdl_wait) for the
    kernel ahead before its work, and lets the kernel after it start (pdl_launch_dependents).

    kernel         block                                                   grid
    rms1_warp_*    (128, 1, 1)                                             min(ceil(M / 4), 65535)
    rms2_block_*   (32 ceil(ceil(N / (VPT V)) / 32), 1, 1), at most 512    min(M, 65535)
    rms3_loop_*    (512, 1, 1)                                             min(M, 65535)

    Rows are grid-strided: any grid >= 1 is correct. Preconditions: 1 <= N < 2^31, M >= 0 (row
    offsets are 64-bit), eps > 0, y and s overlap neither each other nor x, res or w.
*/

#include "row_norm.cuh"

namespace rmsk {

using namespace libnn;

// h = x + res at column c of a row (x alone where the row's res is null), in fp32
template <class DT>
__device__ __forceinline__ float ld_h(const typename DT::T* xr, const typename DT::T* rr, i64 c) {
    return rr ? DT::ld(xr[c]) + DT::ld(rr[c]) : DT::ld(xr[c]);
}

// ---------------------------------------------------------------------------------------------------
// 1) and 2): the row in registers, VPT groups of V elements per thread
template <class DT, int VPT, bool VEC, bool ROW_IS_BLOCK>
__device__ __forceinline__ void rms_registers(const typename DT::T* __restrict__ x,
                                              const typename DT::T* __restrict__ res,
                                              const typename DT::T* __restrict__ w, typename DT::T* __restrict__ y,
                                              typename DT::T* __restrict__ sum, i64 M, int N, float eps) {
    typedef typename DT::T T;
    constexpr int V = DT::V;
    __shared__ float red[16];
    const RowThread<ROW_IS_BLOCK> me;
    for (i64 r = me.first; r < M; r += (i64)gridDim.x * me.rows_per_block) {
        const T* xr = x + r * N;
        const T* rr = res ? res + r * N : nullptr;
        T* yr = y + r * N;
        T* sr = sum ? sum + r * N : nullptr;
        float v[VPT][V];  // h, 0 outside the row
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const int c = (j * me.threads + me.t) * V;
            if constexpr (VEC) {
                if (c < N) {
                    const Pack<DT> px = *reinterpret_cast<const Pack<DT>*>(xr + c);
                    Pack<DT> pr, out;
                    if (rr) pr = *reinterpret_cast<const Pack<DT>*>(rr + c);
#pragma unroll
                    for (int e = 0; e < V; e++) {
                        const float h = rr ? DT::ld(px.e[e]) + DT::ld(pr.e[e]) : DT::ld(px.e[e]);
                        out.e[e] = DT::st(h);
                        v[j][e] = h;
                    }
                    if (sr) *reinterpret_cast<Pack<DT>*>(sr + c) = out;
                } else {
#pragma unroll
                    for (int e = 0; e < V; e++) v[j][e] = 0.f;
                }
            } else {
#pragma unroll
                for (int e = 0; e < V; e++) {
                    v[j][e] = 0.f;
                    if (c + e < N) {
                        v[j][e] = ld_h<DT>(xr, rr, c + e);
                        if (sr) sr[c + e] = DT::st(v[j][e]);
                    }
                }
            }
        }
        float q = 0.f;  // this thread's sum of squares, in order
#pragma unroll
        for (int j = 0; j < VPT; j++)
#pragma unroll
            for (int e = 0; e < V; e++) q += v[j][e] * v[j][e];
        const float rstd = rsqrtf(fdiv_full(row_sum<ROW_IS_BLOCK>(q, red), (float)N) + eps);
        // row_norm.cuh's LayerNorm store with mean 0 and no bias: y = h * rstd * w in fp32, rounded to T once
#pragma unroll
        for (int j = 0; j < VPT; j++)
            store_group<DT, VEC>(v[j], true, 0.f, rstd, w, nullptr, yr, (j * me.threads + me.t) * V, N);
    }
}

// ---------------------------------------------------------------------------------------------------
// 3) any N: two passes over the row in global memory
template <class DT>
__device__ __forceinline__ void rms_loop(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ res,
                                         const typename DT::T* __restrict__ w, typename DT::T* __restrict__ y,
                                         typename DT::T* __restrict__ sum, i64 M, int N, float eps) {
    typedef typename DT::T T;
    __shared__ float red[16];
    for (i64 r = blockIdx.x; r < M; r += gridDim.x) {
        const T* xr = x + r * N;
        const T* rr = res ? res + r * N : nullptr;
        T* yr = y + r * N;
        T* sr = sum ? sum + r * N : nullptr;
        float q = 0.f;
        for (i64 c = threadIdx.x; c < N; c += blockDim.x) {
            const float h = ld_h<DT>(xr, rr, c);
            if (sr) sr[c] = DT::st(h);
            q += h * h;
        }
        const float rstd = rsqrtf(fdiv_full(row_sum<true>(q, red), (float)N) + eps);
        for (i64 c = threadIdx.x; c < N; c += blockDim.x) {
            const float wv = w ? DT::ld(w[c]) : 1.f;
            yr[c] = DT::st(ld_h<DT>(xr, rr, c) * rstd * wv);
        }
    }
}

}  // namespace rmsk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define RMS_PARAMS(T)                                                                                  \
    const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w, T* __restrict__ y,    \
    T* __restrict__ s, long long M, int N, float eps

#define RMS_REGISTERS(name, BOUNDS, DT, VPT, VEC, ROW_IS_BLOCK)                                        \
    extern "C" __global__ void __launch_bounds__(BOUNDS) name(RMS_PARAMS(rmsk::DT::T)) {               \
        libnn::pdl_launch_dependents();   /* the GEMV after a norm streams its weight meanwhile */       \
        libnn::pdl_wait();                /* launched programmatically after a GEMV: x is its output */  \
        rmsk::rms_registers<rmsk::DT, VPT, VEC, ROW_IS_BLOCK>(x, res, w, y, s, M, N, eps);             \
    }
#define RMS1(SUFFIX, DT, VPT)                                                                          \
    RMS_REGISTERS(rms1_warp_vec##VPT##_##SUFFIX, 128, DT, VPT, true, false)                            \
    RMS_REGISTERS(rms1_warp_sca##VPT##_##SUFFIX, 128, DT, VPT, false, false)
#define RMS2(SUFFIX, DT, VPT) RMS_REGISTERS(rms2_block_vec##VPT##_##SUFFIX, 512, DT, VPT, true, true)
#define RMS3(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(512) rms3_loop_##SUFFIX(RMS_PARAMS(rmsk::DT::T)) {    \
        libnn::pdl_launch_dependents();                                                                \
        libnn::pdl_wait();                                                                             \
        rmsk::rms_loop<rmsk::DT>(x, res, w, y, s, M, N, eps);                                          \
    }
ROW_KERNELS(RMS1, RMS2, RMS3)
