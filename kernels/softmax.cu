/*
Softmax and log-softmax along one dimension, for inference, in the style of llm.c dev/cuda:

    x, y viewed as (outer, n, inner), C-contiguous; the slice (o, :, i) is normalised:
    softmax:     y = exp(x - M) / S
    log_softmax: y = (x - M) - log(S)      (the difference, not log(softmax): finite where exp underflows)
    M = max over the slice,  S = sum over the slice of exp(x - M)

I/O in fp16, bf16 (raw 16-bit words, converted with PTX), fp32, arithmetic in fp32; fp64 I/O with
fp64 arithmetic. expf and logf (fp64: log, and an inline exp, see ex(double)) are accurate to a few
ulp, not the MUFU approximations: __expf's error grows with |x - M| and would use up fp32's 1e-5.
It includes no CUDA toolkit header (only libnn's kernels/common.cuh); sm_80 or newer (cvt.rn.bf16.f32).

Semantics are PyTorch's, and come out of the formula itself: NaN anywhere in a slice makes S NaN,
so the whole slice is NaN; +inf makes exp(inf - inf) = NaN, so the whole slice is NaN; a slice all
-inf has M = -inf and exp(-inf - -inf) = NaN. M is taken with plain comparisons (NaN may or may not
win them): NaN enters through S, which every output of the slice reads.

Versions (the launcher, libnn/ops/softmax.py, picks one; all take the same parameters):

1) softmax_warp{1,2,4,8,16,32}_{f16,bf16,f32,f64}   inner == 1, n <= 1024
   A slice is a row of n contiguous elements, held in registers by a group of L lanes of one warp,
   L = min(32, next power of two >= n) (computed by the kernel from n), so that rows of 10 (a
   classifier's logits) do not leave 22 lanes of each warp idle. Lane l of a group holds columns
   j L + l, j < VPT; the launcher picks the smallest built VPT with L VPT >= n. Two reductions over
   the group (max, then the sum of exp), butterflies with __shfl_xor_sync of width L; no shared memory,
   no barrier. A warp walks its rows in steps that keep all its lanes in the loop (rows past the end
   are masked), so every shuffle has the full warp.
2) softmax_block_{f16,bf16,f32,f64}   inner == 1, n > 1024
   One row per block (blockDim.x threads, a multiple of 32, at most 1024). Each thread reads its
   strided share of the row once, keeping an online (running max, sum of exp rescaled to it) pair,
   the pairs are merged over the warp and then over the block through shared memory, and a second
   read of the row writes y: two reads and one write per element, where max-then-sum takes three.
3) softmax_cols_{f16,bf16,f32,f64}   inner > 1 (softmax over dim 1 of NCHW, over dim 0, ...)
   A block of (32, Y) threads takes 32 consecutive slices (flattened (o, i) positions p); thread
   (tx, ty) reads elements k = ty, ty + Y, ... of slice tx, so that each warp's loads are 32
   consecutive inner positions (coalesced when inner >= 32), its sum compensated (Kahan: a thread
   adds up to n / Y elements in a row). The Y online pairs of a slice are merged in shared memory in
   a fixed order, and a second pass writes y.

Online pairs: (m, s) means s = sum of exp(v - m) over the elements seen. An element v > m rescales
s by exp(m - v) and adds exp(v - v) (1, or NaN for v = +inf, as the two-pass formula gets); an
element v = -inf adds nothing (exp(-inf - m) is 0 unless m is -inf too, where it would be NaN for a
row with a finite element still to come); any other v adds exp(v - m) (NaN for a NaN v). Two pairs
merge by rescaling each s to the larger m. A slice all -inf ends with (m, s) = (-inf, 0), and
y = exp(-inf - -inf) / 0 = NaN, log_softmax NaN likewise.

Sums are taken in a fixed order (each thread's elements in order, butterflies, warps or rows of Y
in index order): every launch of one shape gives the same bits.

LAUNCH (every kernel takes the same parameters)
    (const T* x, T* y, long long outer, long long n, long long inner, int log)
    T = float (f32), double (f64) or unsigned short (f16/bf16 bits); log != 0 for log_softmax.

    kernel              block                                         grid
    softmax_warp*       (128, 1, 1)                                   min(ceil(outer / (128 / L)), 65535)
    softmax_block_*     (min(1024, power of 2 >= n / 8), 1, 1)        min(outer, 65535)
    softmax_cols_*      (32, Y, 1), Y = min(16, power of 2 >= n / 8)  min(ceil(outer inner / 32), 65535)

    softmax_block_* takes any multiple of 32 threads up to 1024, softmax_cols_* any Y up to 16.

    Rows, and tiles of 32 slices, are grid-strided: any grid >= 1 is correct. Preconditions: n >= 1,
    outer >= 1, inner >= 1, outer n inner < 2^63 (all offsets are 64-bit); softmax_warp* needs
    inner == 1 and n <= 32 VPT, softmax_block_* inner == 1; y does not overlap x.
*/

#include "common.cuh"

namespace smk {

using namespace libnn;

// the compute type C and the conversions of each I/O type: fp32 for the 16-bit and 32-bit floats
// (common.cuh's traits), fp64 for fp64
template <class DT>
struct io : DT {
    typedef float C;
};
template <>
struct io<dt_f64> : dt_f64 {
    typedef double C;
};
typedef io<dt_f16> f16;
typedef io<dt_bf16> bf16;
typedef io<dt_f32> f32;
typedef io<dt_f64> f64;

__device__ __forceinline__ float ex(float v) { return expf(v); }
// exp(v) for v <= 0, -inf or NaN in fp64 (every exponent in this file is x - M, or a max minus a larger
// one), inline: CUDA's exp(double) calls a subroutine for its slow path, and around that call ptxas
// spilled registers on sm_90. v = k ln2 + r, |r| <= ln2 / 2, ln2 in two parts (Cody and Waite: ln2_hi
// has 32 trailing zero bits, so k ln2_hi is exact); exp(r) is its Taylor series to r^13 (remainder
// below 5e-18); 2^k is applied in two factors so that k down to -1075 reaches the subnormals.
__device__ __forceinline__ double ex(double v) {
    if (!(v > -745.2)) return v == v ? 0.0 : v;  // below the smallest subnormal (or -inf): 0; NaN stays
    const double k = rint(v * 1.4426950408889634);
    const double r = fma(k, -1.90821492927058770002e-10, fma(k, -6.93147180369123816490e-01, v));
    double p = 1.0 / 6227020800.0;  // 1/13!
    p = fma(p, r, 1.0 / 479001600.0);
    p = fma(p, r, 1.0 / 39916800.0);
    p = fma(p, r, 1.0 / 3628800.0);
    p = fma(p, r, 1.0 / 362880.0);
    p = fma(p, r, 1.0 / 40320.0);
    p = fma(p, r, 1.0 / 5040.0);
    p = fma(p, r, 1.0 / 720.0);
    p = fma(p, r, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    const int k1 = (int)k / 2, k2 = (int)k - k1;
    return p * __longlong_as_double((long long)(k1 + 1023) << 52) * __longlong_as_double((long long)(k2 + 1023) << 52);
}
__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
__device__ __forceinline__ float reciprocal(float v) { return fdiv_full(1.f, v); }
__device__ __forceinline__ double reciprocal(double v) { return __drcp_rn(v); }
template <class C> __device__ __forceinline__ C neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ll); }

// the larger of a and b (either one when one is NaN): M is a maximum over values, NaN reaches y through S
template <class C> __device__ __forceinline__ C larger(C a, C b) { return a > b ? a : b; }

// y of one element from z = x - M, the log-softmax's log(S), the softmax's 1 / S
template <class C>
__device__ __forceinline__ C output(C z, int log, C log_s, C inv_s) {
    return log ? z - log_s : ex(z) * inv_s;
}

// ---------------------------------------------------------------------------------------------------
// online (max, sum) pairs
template <class C>
__device__ __forceinline__ void add(C& m, C& s, C v) {
    if (v > m) {
        s = s * ex(m - v) + ex(v - v);  // exp(v - v): NaN for v = +inf, as in the two-pass formula
        m = v;
    } else if (v != neg_inf<C>()) {
        s += ex(v - m);
    }
}
// add, with the sum compensated (Kahan: c keeps the low-order bits the last addition lost, and is
// rescaled with s): a thread of softmax_cols sums n / Y elements in a row, up to 2^16 for n = 2^20,
// where plain fp32 addition drifted to a 7e-5 relative error
template <class C>
__device__ __forceinline__ void add_compensated(C& m, C& s, C& c, C v) {
    C term;
    if (v > m) {
        const C scale = ex(m - v);
        s *= scale;
        c *= scale;
        m = v;
        term = ex(v - v);  // NaN for v = +inf, as in add
    } else if (v != neg_inf<C>()) {
        term = ex(v - m);
    } else {
        return;
    }
    const C corrected = term - c, total = s + corrected;
    c = (total - s) - corrected;
    s = total;
}
// s of a pair rescaled to the maximum mm >= m. A pair still at m = -inf has seen only -inf (s = 0) or
// also NaN (s = NaN): its s is kept as it is, where exp(-inf - -inf) would make the 0 a NaN.
template <class C>
__device__ __forceinline__ C rescaled(C m, C s, C mm) {
    return m == neg_inf<C>() ? s : s * ex(m - mm);
}
template <class C>
__device__ __forceinline__ void merge(C& m, C& s, C m2, C s2) {
    const C mm = larger(m, m2);
    s = rescaled(m, s, mm) + rescaled(m2, s2, mm);
    m = mm;
}
// (m, s) merged over the warp by a butterfly: every lane ends with the same bits (merge is symmetric)
template <class C>
__device__ __forceinline__ void warp_merge(C& m, C& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const C m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
}
// (m, s) merged over the block: the warp's butterfly, then warp 0 over the warps' pairs in order.
// The first barrier keeps a row from overwriting pairs the previous row's threads are still reading.
template <class C>
__device__ __forceinline__ void block_merge(C& m, C& s) {
    __shared__ C red_m[32], red_s[32];
    warp_merge(m, s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        red_m[warp] = m;
        red_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? red_m[lane] : neg_inf<C>();
        s = lane < warps ? red_s[lane] : C(0);
        warp_merge(m, s);
        if (lane == 0) {
            red_m[0] = m;
            red_s[0] = s;
        }
    }
    __syncthreads();
    m = red_m[0];
    s = red_s[0];
}

// ---------------------------------------------------------------------------------------------------
// 1) rows of n <= 32 VPT in the registers of L lanes
template <class DT, int VPT>
__device__ __forceinline__ void softmax_warp(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                             i64 rows, int n, int log) {
    typedef typename DT::C C;
    const int L = n >= 32 ? 32 : 1 << (32 - __clz(n - 1));  // lanes per row: next power of two >= n
    const int lane = threadIdx.x & 31, l = lane & (L - 1);
    const int rows_per_warp = 32 / L, rows_per_block = (blockDim.x >> 5) * rows_per_warp;
    const i64 warp_first = (i64)blockIdx.x * rows_per_block + (threadIdx.x >> 5) * rows_per_warp;
    // the loop condition is the warp's first row, the same in every lane: the shuffles see the full warp
    for (i64 base = warp_first; base < rows; base += (i64)gridDim.x * rows_per_block) {
        const i64 r = base + lane / L;
        const bool live = r < rows;
        const typename DT::T* xr = x + r * n;
        C v[VPT];
        C mx = neg_inf<C>();
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const int c = j * L + l;
            v[j] = live && c < n ? DT::ld(xr[c]) : neg_inf<C>();
            mx = larger(mx, v[j]);
        }
        for (int o = L >> 1; o > 0; o >>= 1) mx = larger(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        C s = 0;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const C z = v[j] - mx;
            const C e = ex(z);
            if (j * L + l < n) s += e;
            v[j] = log ? z : e;
        }
        for (int o = L >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const C log_s = lg(s), inv_s = reciprocal(s);
        if (live) {
            typename DT::T* yr = y + r * n;
#pragma unroll
            for (int j = 0; j < VPT; j++) {
                const int c = j * L + l;
                if (c < n) yr[c] = DT::st(log ? v[j] - log_s : v[j] * inv_s);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 2) a row per block, any n: one online read, one writing read
template <class DT>
__device__ __forceinline__ void softmax_block(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                              i64 rows, i64 n, int log) {
    typedef typename DT::C C;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const typename DT::T* xr = x + r * n;
        C m = neg_inf<C>(), s = 0;
        for (i64 c = threadIdx.x; c < n; c += blockDim.x) add(m, s, DT::ld(xr[c]));
        block_merge(m, s);
        const C log_s = lg(s), inv_s = reciprocal(s);
        typename DT::T* yr = y + r * n;
        for (i64 c = threadIdx.x; c < n; c += blockDim.x) yr[c] = DT::st(output(DT::ld(xr[c]) - m, log, log_s, inv_s));
    }
}

// ---------------------------------------------------------------------------------------------------
// 3) inner > 1: 32 slices per block, Y threads per slice
constexpr int COLS_MAX_Y = 16;

template <class DT>
__device__ __forceinline__ void softmax_cols(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                             i64 outer, i64 n, i64 inner, int log) {
    typedef typename DT::C C;
    __shared__ C red_m[COLS_MAX_Y][32], red_s[COLS_MAX_Y][32];
    const int tx = threadIdx.x, ty = threadIdx.y, Y = blockDim.y;
    const i64 slices = outer * inner, stride = (i64)Y * inner;
    for (i64 tile = blockIdx.x; tile * 32 < slices; tile += gridDim.x) {
        const i64 p = tile * 32 + tx;
        const bool live = p < slices;
        const i64 o = p / inner;
        const i64 first = live ? o * n * inner + (p - o * inner) + ty * inner : 0;
        const i64 end = live ? first - ty * inner + n * inner : 0;  // one past the slice's last element
        C m = neg_inf<C>(), s = 0, c = 0;
        for (i64 e = first; e < end; e += stride) add_compensated(m, s, c, DT::ld(x[e]));
        __syncthreads();  // the previous tile's threads have read red_m[0], red_s[0]
        red_m[ty][tx] = m;
        red_s[ty][tx] = s;
        __syncthreads();
        if (ty == 0) {
            for (int k = 1; k < Y; k++) merge(m, s, red_m[k][tx], red_s[k][tx]);
            red_m[0][tx] = m;
            red_s[0][tx] = s;
        }
        __syncthreads();
        m = red_m[0][tx];
        s = red_s[0][tx];
        const C log_s = lg(s), inv_s = reciprocal(s);
        for (i64 e = first; e < end; e += stride) y[e] = DT::st(output(DT::ld(x[e]) - m, log, log_s, inv_s));
    }
}

}  // namespace smk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define SM_PARAMS(T) const T* __restrict__ x, T* __restrict__ y, long long outer, long long n, long long inner, int log

#define SM_WARP(SUFFIX, DT, VPT)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) softmax_warp##VPT##_##SUFFIX(SM_PARAMS(smk::DT::T)) { \
        smk::softmax_warp<smk::DT, VPT>(x, y, outer, (int)n, log);                                      \
    }
#define SM_DTYPE(SUFFIX, DT)                                                                            \
    SM_WARP(SUFFIX, DT, 1) SM_WARP(SUFFIX, DT, 2) SM_WARP(SUFFIX, DT, 4) SM_WARP(SUFFIX, DT, 8)         \
    SM_WARP(SUFFIX, DT, 16) SM_WARP(SUFFIX, DT, 32)                                                     \
    extern "C" __global__ void __launch_bounds__(1024) softmax_block_##SUFFIX(SM_PARAMS(smk::DT::T)) {  \
        smk::softmax_block<smk::DT>(x, y, outer, n, log);                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * smk::COLS_MAX_Y)                                \
        softmax_cols_##SUFFIX(SM_PARAMS(smk::DT::T)) {                                                  \
        smk::softmax_cols<smk::DT>(x, y, outer, n, inner, log);                                         \
    }

SM_DTYPE(f16, f16)
SM_DTYPE(bf16, bf16)
SM_DTYPE(f32, f32)
SM_DTYPE(f64, f64)
