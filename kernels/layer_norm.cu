/*
Layer normalization over the last dimension, for inference, in the style of llm.c dev/cuda, with
the residual add of a post-LN transformer block fused in front of it:

    h[r, c] = x[r, c] + res[r, c]   (in fp32; h = x where res is null)
    y[r, c] = (h[r, c] - mean_r) * rstd_r * w[c] + b[c]
    mean_r  = (1/N) sum_c h[r, c],   rstd_r = 1 / sqrt((1/N) sum_c (h[r, c] - mean_r)^2 + eps)
    s[r, c] = h[r, c] rounded to T  (only where s is not null)

x, res, y and s are (M, N) row-major and contiguous; w and b are (N,); res, w, b and s may each be
null (res: plain layer norm; w, b: 1 and 0; s: the sum is not written). I/O in fp32, fp16 or bf16
(raw 16-bit words, converted with PTX), all arithmetic in fp32. It includes no CUDA toolkit header
(only libnn's kernels/common.cuh, and kernels/row_norm.cuh, the row sum and normalization it shares
with kernels/embedding.cu); sm_80 or newer (cvt.rn.bf16.f32).

The residual is read in the same pass as x, so versions 1 and 2 move 3 (4 with s) row-sized arrays
where an add kernel then a layer norm moved 5 (x, res, the sum written and read again, y). The row
is normalized from h in fp32, not from s rounded to T: for fp16/bf16 inputs h is then exact (two
fp16 values' sum fits fp32's 24 bits while their magnitudes are within 2^12 of each other, bf16's
within 2^15), so y is the normalization of x + res itself, as the float64 reference computes it.

Numerics: two passes over the row, the mean first, then the variance as the mean of (h - mean)^2,
never E[h^2] - E[h]^2, which cancels when |mean| >> std (for h = 100 + N(0, 1) in fp32 that form
keeps two or three correct digits of the variance). The sums are taken of h - h[r, 0] (shifted
data: the row's first element is the pivot, mean = pivot + sum(h - pivot) / N), so that a large
common offset does not inflate the rounding of the mean's sum either. A row sum is: each thread sums
its elements in order, a butterfly over the warp (__shfl_xor_sync; every lane ends with the same
bits), and for versions 2 and 3 a sum of the block's warp sums in a fixed order through shared
memory. rstd is rsqrtf (2 ulp), 1/N a div.full (2 ulp): about 1e-7 relative in fp32.

Versions (the launcher, libnn/ops/layer_norm.py, picks one; all take the same parameters; each reads
res and writes s with the accesses it makes of x and y, so a residual changes no version's limits):

1) ln1_warp_{vec,sca}{1,2,4}_{f32,f16,bf16}, and ln1_warp_{vec,sca}8_f32
   One row per warp, 4 rows per 128-thread block, the row held in registers. Lane l holds VPT groups
   of V consecutive elements (V = 4 for fp32, 8 for fp16/bf16: 16 bytes), group j at columns
   (32 j + l) V ... (32 j + l) V + V - 1, so that each of a warp's VPT loads covers 512 contiguous
   bytes. No shared memory, no barrier. For N <= 32 VPT V, i.e. up to N = 1024 with the VPTs built.
2) ln2_block_vec{2,4,8}_*
   One row per block, the same register layout with blockDim.x threads (a multiple of 32, at most
   512) in place of 32; the launcher sizes the block to the row. For N <= blockDim.x VPT V: up to
   16384 (fp32) and 32768 (fp16/bf16) elements. 16-byte accesses only (see vec below).
3) ln3_loop_*
   One row per 512-thread block, any N and alignment, element-wise accesses: three strided passes
   over the row in global memory (sum, squared deviations, output), each reading x and res again
   (h is recomputed in fp32, not read back from s, so that every version normalizes the same h).
   The fallback beyond version 2's register capacity, and for rows longer than 1024 that version 2
   cannot take 16 bytes at a time (N % V != 0 or a misaligned pointer). On the H100 it is slower
   than cuDNN on those rows, while versions 1 and 2 match or beat cuDNN on large problems (figures:
   benchmarks/RESULTS.md, layer_norm). Keeping the row in shared memory for passes 2 and 3 was tried
   and measured slower: it leaves room for one 512-thread block per SM.

vec: 16-byte loads and stores of x, res, w, b, y and s; the launcher picks it only when N % V == 0
and every pointer is 16-byte aligned. sca: the same groups read and written one element at a time
with a bounds check each (any N, any alignment). Only version 1 is built both ways: each variant is
fully unrolled code, and NVRTC's time grows with it (building every VPT of versions 1 and 2 both
ways more than doubled the compile time per architecture), while long rows of odd length are rare
enough for version 3.

LAUNCH (every kernel takes the same parameters)
    (const T* x, const T* res, const T* w, const T* b, T* y, T* s, long long M, int N, float eps)
    T = float (f32) or unsigned short (f16/bf16 bits); res, w, b and s may be null.

    kernel         block                                                   grid
    ln1_warp_*     (128, 1, 1)                                             min(ceil(M / 4), 65535)
    ln2_block_*    (32 ceil(ceil(N / (VPT V)) / 32), 1, 1), at most 512    min(M, 65535)
    ln3_loop_*     (512, 1, 1)                                             min(M, 65535)

    Rows are grid-strided: any grid >= 1 is correct. Preconditions: 1 <= N < 2^31, M >= 0 (row
    offsets are 64-bit), eps > 0, y and s overlap neither each other nor x, res, w or b. Registers:
    version 2 with VPT = 8 holds 64 floats of the row per fp16/bf16 thread, within
    __launch_bounds__(512)'s 128, without spills. res and s are null-checked at run time rather than
    built as separate kernels (which would double NVRTC's time); that costs the kernels without a
    residual a few registers (ln2_block_vec4_f32 40 -> 64, ln2_block_vec8_f32 74 -> 114 on sm_80).
*/

#include "row_norm.cuh"

namespace lnk {

using namespace libnn;

// h = x + res at column c of a row (x alone where the row's res is null), in fp32
template <class DT>
__device__ __forceinline__ float ld_h(const typename DT::T* xr, const typename DT::T* rr, i64 c) {
    return rr ? DT::ld(xr[c]) + DT::ld(rr[c]) : DT::ld(xr[c]);
}

// ---------------------------------------------------------------------------------------------------
// 1) and 2): the row in registers, VPT groups of V elements per thread
template <class DT, int VPT, bool VEC, bool ROW_IS_BLOCK>
__device__ __forceinline__ void ln_registers(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ res,
                                             const typename DT::T* __restrict__ w, const typename DT::T* __restrict__ b,
                                             typename DT::T* __restrict__ y, typename DT::T* __restrict__ sum, i64 M,
                                             int N, float eps) {
    typedef typename DT::T T;
    constexpr int V = DT::V;
    __shared__ float red[16];
    const RowThread<ROW_IS_BLOCK> me;
    const int threads = me.threads, t = me.t, rows_per_block = me.rows_per_block;
    const i64 first = me.first;
    const float inv_n = fdiv_full(1.f, (float)N);
    for (i64 r = first; r < M; r += (i64)gridDim.x * rows_per_block) {
        const T* xr = x + r * N;
        const T* rr = res ? res + r * N : nullptr;
        T* yr = y + r * N;
        T* sr = sum ? sum + r * N : nullptr;
        const float pivot = ld_h<DT>(xr, rr, 0);
        float v[VPT][V];  // h - pivot, 0 outside the row
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const int c = (j * threads + t) * V;
            if constexpr (VEC) {
                if (c < N) {
                    const Pack<DT> px = *reinterpret_cast<const Pack<DT>*>(xr + c);
                    // the sum's pack is built whether or not s is wanted: a separate conditional pass
                    // over v for s spilled ln2_block_vec4_bf16 past its 64 registers on sm_80
                    Pack<DT> pr, out;
                    if (rr) pr = *reinterpret_cast<const Pack<DT>*>(rr + c);
#pragma unroll
                    for (int e = 0; e < V; e++) {
                        const float h = rr ? DT::ld(px.e[e]) + DT::ld(pr.e[e]) : DT::ld(px.e[e]);
                        out.e[e] = DT::st(h);
                        v[j][e] = h - pivot;
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
                        const float h = ld_h<DT>(xr, rr, c + e);
                        if (sr) sr[c + e] = DT::st(h);
                        v[j][e] = h - pivot;
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < V; e++) s += v[j][e];
        }
        const float mean = row_sum<ROW_IS_BLOCK>(s, red) * inv_n;  // the mean of h - pivot
        const float rstd = row_rstd<VPT, V, ROW_IS_BLOCK>(v, mean, threads, t, N, inv_n, eps, red);
#pragma unroll
        for (int j = 0; j < VPT; j++)
            store_group<DT, VEC>(v[j], true, mean, rstd, w, b, yr, (j * threads + t) * V, N);
    }
}

// ---------------------------------------------------------------------------------------------------
// 3) any N: three passes over the row in global memory
template <class DT>
__device__ __forceinline__ void ln_loop(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ res,
                                        const typename DT::T* __restrict__ w, const typename DT::T* __restrict__ b,
                                        typename DT::T* __restrict__ y, typename DT::T* __restrict__ sum, i64 M, int N,
                                        float eps) {
    typedef typename DT::T T;
    __shared__ float red[16];
    const float inv_n = fdiv_full(1.f, (float)N);
    for (i64 r = blockIdx.x; r < M; r += gridDim.x) {
        const T* xr = x + r * N;
        const T* rr = res ? res + r * N : nullptr;
        T* yr = y + r * N;
        T* sr = sum ? sum + r * N : nullptr;
        const float pivot = ld_h<DT>(xr, rr, 0);
        float s = 0.f;
        for (i64 c = threadIdx.x; c < N; c += blockDim.x) {
            const float h = ld_h<DT>(xr, rr, c);
            if (sr) sr[c] = DT::st(h);
            s += h - pivot;
        }
        normalize_row_loop<DT>([&](i64 c) { return ld_h<DT>(xr, rr, c); }, s, pivot, w, b, yr, N, inv_n, eps, red);
    }
}

}  // namespace lnk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define LN_PARAMS(T)                                                                                   \
    const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w, const T* __restrict__ b,    \
    T* __restrict__ y, T* __restrict__ s, long long M, int N, float eps

#define LN_REGISTERS(name, BOUNDS, DT, VPT, VEC, ROW_IS_BLOCK)                                         \
    extern "C" __global__ void __launch_bounds__(BOUNDS) name(LN_PARAMS(lnk::DT::T)) {                 \
        libnn::pdl_launch_dependents();   /* the GEMV after a norm streams its weight meanwhile */       \
        lnk::ln_registers<lnk::DT, VPT, VEC, ROW_IS_BLOCK>(x, res, w, b, y, s, M, N, eps);                     \
    }
#define LN1(SUFFIX, DT, VPT)                                                                           \
    LN_REGISTERS(ln1_warp_vec##VPT##_##SUFFIX, 128, DT, VPT, true, false)                              \
    LN_REGISTERS(ln1_warp_sca##VPT##_##SUFFIX, 128, DT, VPT, false, false)
#define LN2(SUFFIX, DT, VPT) LN_REGISTERS(ln2_block_vec##VPT##_##SUFFIX, 512, DT, VPT, true, true)
#define LN3(SUFFIX, DT)                                                                                \
    extern "C" __global__ void __launch_bounds__(512) ln3_loop_##SUFFIX(LN_PARAMS(lnk::DT::T)) {       \
        libnn::pdl_launch_dependents();                                                                \
        lnk::ln_loop<lnk::DT>(x, res, w, b, y, s, M, N, eps);                                                  \
    }
ROW_KERNELS(LN1, LN2, LN3)
