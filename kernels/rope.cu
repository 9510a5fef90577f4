/*
Rotary position embedding (RoPE) of q or k, for inference, in the style of llm.c dev/cuda: each head's
first R = rotary_dim elements are rotated pairwise by angles that grow with the token's position;
elements R..D-1 pass through unchanged (GPT-NeoX's partial rotary).

    x, y       (B, S, H, D), element strides (xb, xs, xh, 1) and (yb, ys, yh, 1); packed tokens
               (T, H, D) are B = 1, S = T
    positions  (B, S), int32 or int64, element strides (pb, ps) (0 for a broadcast dimension)
    inv_freq   (R / 2,) fp32, contiguous

    for pair i < R / 2 of head h of token (b, s):
        angle    = fp32(positions[b, s]) * inv_freq[i]      one fp32 product, rounded once
        (j0, j1) = (i, i + R / 2)    interleaved = 0: Hugging Face LLaMA / GPT-NeoX, rotate_half
                   (2 i, 2 i + 1)    interleaved = 1: GPT-J, Meta's complex multiplication
        y[j0] = x[j0] cos(angle) - x[j1] sin(angle)
        y[j1] = x[j1] cos(angle) + x[j0] sin(angle)
    y[d] = x[d] for R <= d < D (the bits copied)

The angle is what Hugging Face computes (position_ids.float() times inv_freq in fp32): positions up to
2^24 are exact in fp32, larger ones round to the nearest fp32 (cvt.rn, as NumPy's and torch's casts
do), and the product is rounded once (__fmul_rn: never contracted into an FMA). sincosf is the full-
range function (a few ulp at any argument; Payne-Hanek reduction past |angle| = 105615), not the
__sincosf intrinsic, whose error grows with |angle| outside [-pi, pi] and angles reach position x
inv_freq[0] = position radians. The rotation is in fp32 and rounded to T once: Hugging Face rounds
cos and sin to the activations' dtype and each product and the sum in it, so fp16/bf16 outputs differ
from its by their dtype's rounding, not more.

I/O in fp16, bf16 (raw 16-bit words, converted with PTX) or fp32; positions int32 or int64. It
includes no CUDA toolkit header (only libnn's kernels/rope.cuh, the rotation of one row, which
kernels/kv_append.cu shares, and kernels/common.cuh); sm_80 or newer (cvt.rn.bf16.f32).

In place: y may be x itself (same pointer, same strides). Each element is read and written by one
thread only, a pair's two loads before its two stores, so the rotation reads only the input; x and y
are not __restrict__ for that reason. Any other overlap of x and y is the caller's error (the launcher
refuses it).

Versions (libnn/ops/rope.py launches it):

1) rope1_pairs_{f16,bf16,f32}_{i32,i64}   any shape and strides with a contiguous last dimension
   One thread per rotation pair, and per pass-through element. A block of (BX, BY) threads: BX lanes
   over the R / 2 pairs and D - R pass-through elements of one (token, head) row (looping where
   there are more than BX), BY tokens of one sequence; blockIdx.y is the head, blockIdx.z the
   sequence, so that no index is divided. Adjacent lanes take adjacent pairs: the half style reads
   and writes two coalesced runs of a row, the interleaved style one. sincosf per pair: a row's
   angles are not shared between heads (H blocks compute the same angles); a cos/sin cache would
   trade that arithmetic for a table read per pair (not measured).

LAUNCH (every kernel takes the same parameters)
    (const T* x, const P* positions, const float* inv_freq, T* y, long long B, long long S, int H,
     int D, int R, long long xb, long long xs, long long xh, long long yb, long long ys, long long yh,
     long long pb, long long ps, int interleaved)
    T = float (f32) or unsigned short (f16/bf16 bits); P = int (i32) or long long (i64).
    On sm_90 and newer it is launched with programmatic stream serialization: it waits (pdl_wait) for the
    kernel ahead before its work, and lets the kernel after it start (pdl_launch_dependents).

    items = R / 2 + D - R per (token, head) row
    kernel           block                                   grid
    rope1_pairs_*    (BX, BY, 1)                             (min(ceil(S / BY), 65535), min(H, 65535), min(B, 65535))
                     BX = min(ROPE_MAX_BX, max(32, power of 2 >= items))
                     BY = min(ROPE_THREADS / BX, power of 2 >= S)

    Tokens, heads and sequences are grid-strided and a row's items block-strided: any grid >= 1 and
    any block up to ROPE_THREADS threads are correct. Preconditions: R even, 2 <= R <= D < 2^31,
    1 <= H < 2^31, B, S >= 1; element offsets are 64-bit, and strides may be negative or (x only) 0.
*/

#include "rope.cuh"

constexpr int ROPE_THREADS = 256;  // threads per block: the launch bound
constexpr int ROPE_MAX_BX = 128;   // lanes over one (token, head) row's items: D up to 256 in one pass

namespace ropek {

template <class DT, class P>
__device__ __forceinline__ void rope_pairs(const typename DT::T* x, const P* __restrict__ positions,
                                           const float* __restrict__ inv_freq, typename DT::T* y, i64 B, i64 S,
                                           int H, int D, int R, i64 xb, i64 xs, i64 xh, i64 yb, i64 ys, i64 yh,
                                           i64 pb, i64 ps, int interleaved) {
    for (i64 b = blockIdx.z; b < B; b += gridDim.z) {
        for (int h = blockIdx.y; h < H; h += gridDim.y) {
            for (i64 s = (i64)blockIdx.x * blockDim.y + threadIdx.y; s < S; s += (i64)gridDim.x * blockDim.y) {
                rotate_row<DT>(x + b * xb + s * xs + h * xh, y + b * yb + s * ys + h * yh,
                               to_float(positions[b * pb + s * ps]), inv_freq, D, R, interleaved);
            }
        }
    }
}

}  // namespace ropek

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define ROPE_PARAMS(T, P)                                                                                \
    const T* x, const P* __restrict__ positions, const float* __restrict__ inv_freq, T* y, long long B,   \
        long long S, int H, int D, int R, long long xb, long long xs, long long xh, long long yb,         \
        long long ys, long long yh, long long pb, long long ps, int interleaved

#define ROPE1(SUFFIX, DT, PSUFFIX, P)                                                                    \
    extern "C" __global__ void __launch_bounds__(ROPE_THREADS)                                           \
        rope1_pairs_##SUFFIX##_##PSUFFIX(ROPE_PARAMS(ropek::DT::T, P)) {                                 \
        libnn::pdl_launch_dependents();   /* kv_append, next, may start */                               \
        libnn::pdl_wait();                /* launched programmatically after a GEMV: x is its output */  \
        ropek::rope_pairs<ropek::DT, P>(x, positions, inv_freq, y, B, S, H, D, R, xb, xs, xh, yb, ys, yh, \
                                        pb, ps, interleaved);                                            \
    }

ROPE1(f16, f16, i32, int)
ROPE1(f16, f16, i64, long long)
ROPE1(bf16, bf16, i32, int)
ROPE1(bf16, bf16, i64, long long)
ROPE1(f32, f32, i32, int)
ROPE1(f32, f32, i64, long long)
