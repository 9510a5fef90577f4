/*
The mean over the positions a mask keeps, for inference: a BERT encoder's pooled sentence embedding
(libnn/nn/functional.py masked_mean):

    x     (B, S, F) C-contiguous
    valid (B, S) bool (bytes 0 / 1), C-contiguous: 1 at the positions to average
    out   (B, F) C-contiguous
    out[b, f] = sum over s with valid[b, s] of x[b, s, f], divided by the number of such s; 0 where
                there is none (never NaN)

Sums in fp32 (fp64 for fp64 input), the mean rounded to T once (to nearest even: cvt.rn for fp16 and
bf16). Positions the mask drops are never read, so what they hold (inf, NaN, stale memory) does not
matter. Deterministic: every sum is taken in a fixed order (each thread's rows in order, then the row
groups' partial sums in order), the same bits on every run. I/O in fp16, bf16 (raw 16-bit words), fp32
or fp64; no CUDA toolkit header (only libnn's kernels/common.cuh); sm_80 or newer (cvt.rn.bf16.f32).

A column reduction over S, not a row-wise op: its own file rather than a version of key_padding.cu,
whose kernels read the mask alone.

Versions (libnn/nn/functional.py picks one from F and x's alignment):

   One block per (batch entry, slice of MM_COLS = 64 columns). Its MM_THREADS threads are L = 64 / V
   lanes across the slice (V columns each) by R = MM_THREADS / L row groups down S: group r sums rows
   r, r + R, r + 2R, ... of its lanes' columns and counts the kept rows; the R partial sums of each
   column then meet in shared memory and the first 64 threads add them in order of r and divide. At
   B = 32, F = 384 that is 192 blocks of 256 threads, where a thread per output value reading down its
   column (CuPy's kernel before this one) had 12288 threads walking S = 128 steps one after another
   (timings of both: benchmarks/RESULTS.md, eleventh session).

1) masked_mean1_scalar_{f16,bf16,f32,f64}   any F, any alignment: V = 1 (L = 64, R = 4)
2) masked_mean2_vec_{f16,bf16,f32,f64}      F a multiple of V = 16 / sizeof(T) and x 16-byte aligned:
                                            one 16-byte load per row and lane (fp16: L = 8, R = 32)

LAUNCH (every kernel takes the same parameters)
    (const T* x, const unsigned char* valid, T* out, int S, int F)
    T = unsigned short (f16/bf16 bits), float (f32) or double (f64).

    kernel          block                 grid
    masked_mean*    (MM_THREADS, 1, 1)    (B, ceil(F / MM_COLS), 1)

    Every block is needed (a missing one leaves its outputs unwritten); grid x is the batch entry.
    Preconditions: 1 <= B < 2^31, 1 <= S < 2^31, 1 <= F, ceil(F / MM_COLS) <= 65535; out overlaps neither
    x nor valid; element offsets are 64-bit.
*/

#include "common.cuh"

constexpr int MM_THREADS = 256;  // threads per block: the launch bound
constexpr int MM_COLS = 64;      // columns per block

namespace mmk {

using namespace libnn;

// the accumulator of each dtype: fp32, fp64 for fp64
template <class DT> struct acc { typedef float A; };
template <> struct acc<dt_f64> { typedef double A; };

// V consecutive elements of x from `p` (16 bytes when V > 1: the launcher checked the alignment), widened
template <class DT, int V>
__device__ __forceinline__ void load(const typename DT::T* p, typename acc<DT>::A* v) {
    typedef typename DT::T T;
    if constexpr (V == 1) {
        v[0] = DT::ld(*p);
    } else {
        union { u32x4 q; T e[V]; } u;
        u.q = *reinterpret_cast<const u32x4*>(p);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = DT::ld(u.e[k]);
    }
}

template <class DT, int V>
__device__ __forceinline__ void masked_mean(const typename DT::T* __restrict__ x,
                                            const unsigned char* __restrict__ valid, typename DT::T* __restrict__ out,
                                            int S, int F) {
    typedef typename acc<DT>::A A;
    constexpr int L = MM_COLS / V, R = MM_THREADS / L;
    __shared__ A partial[R][MM_COLS];
    __shared__ int kept[R];
    const i64 b = blockIdx.x;
    const int lane = threadIdx.x % L, group = threadIdx.x / L;
    const int col = blockIdx.y * MM_COLS + lane * V;  // the lane's first column (V of them, all in or all out)
    const bool inside = col < F;
    const typename DT::T* xb = x + b * S * F + col;
    const unsigned char* vb = valid + b * S;
    A sum[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sum[k] = 0;
    int n = 0;
#pragma unroll 4
    for (int s = group; s < S; s += R) {
        if (!vb[s]) continue;  // dropped positions are not read: a padded batch moves only its tokens
        ++n;
        if (inside) {
            A v[V];
            load<DT, V>(xb + (i64)s * F, v);
#pragma unroll
            for (int k = 0; k < V; ++k) sum[k] += v[k];
        }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) partial[group][lane * V + k] = sum[k];
    if (lane == 0) kept[group] = n;
    __syncthreads();
    const int c = threadIdx.x;
    if (c < MM_COLS && blockIdx.y * MM_COLS + c < F) {
        A total = 0;
        int count = 0;
#pragma unroll 4
        for (int r = 0; r < R; ++r) {
            total += partial[r][c];
            count += kept[r];
        }
        out[b * F + blockIdx.y * MM_COLS + c] = DT::st(count ? total / (A)count : (A)0);
    }
}

}  // namespace mmk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define MM_PARAMS(T) \
    const T* __restrict__ x, const unsigned char* __restrict__ valid, T* __restrict__ out, int S, int F

#define MM(SUFFIX, DT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) masked_mean1_scalar_##SUFFIX(MM_PARAMS(DT::T)) { \
        mmk::masked_mean<DT, 1>(x, valid, out, S, F);                                                   \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) masked_mean2_vec_##SUFFIX(MM_PARAMS(DT::T)) {    \
        mmk::masked_mean<DT, DT::V>(x, valid, out, S, F);                                               \
    }

MM(f16, libnn::dt_f16)
MM(bf16, libnn::dt_bf16)
MM(f32, libnn::dt_f32)
MM(f64, libnn::dt_f64)
