/*
libnn's per-row device code, written once for the kernel files that normalize rows (kernels/layer_norm.cu,
kernels/embedding.cu): the sum of a row over the threads that hold it, and the fp32 LayerNorm of a row
once its values are known. Each file forms its row's values its own way (x + res; the gathered word +
position + type rows) and hands them here, so both normalize with the same bits: the numerics
kernels/layer_norm.cu's opening comment describes (two passes about a pivot, the row's first value; a
butterfly over each warp, then the warp sums in a fixed order; rsqrtf).

Register layout (versions 1 and 2 of both files): thread t of the `threads` that hold a row keeps VPT
groups of V consecutive elements (V: 16 bytes of T), group j at columns (j threads + t) V onwards, as
v[j][0..V) = h - pivot, 0 past the row's end.

The helpers are __forceinline__ and each was checked to compile to the PTX of the code it replaced
(a helper for the whole output loop did not: ptxas gave ln2_block_vec4_bf16 111 registers where it had
64, so the callers keep the loop over groups and call store_group in it).
*/
#pragma once

#include "common.cuh"

namespace libnn {

// the 16 bytes of T that a vectorised access moves
template <class DT>
struct alignas(16) Pack {
    typename DT::T e[DT::V];
};

// Sum of `s` over the threads of one row: the warp (ROW_IS_BLOCK false) or the whole block. `red` holds
// blockDim.x / 32 floats of shared memory and is reused by every call; the first barrier keeps a call
// from overwriting partial sums the previous call's threads are still reading.
template <bool ROW_IS_BLOCK>
__device__ __forceinline__ float row_sum(float s, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if constexpr (ROW_IS_BLOCK) {
        __syncthreads();
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
        __syncthreads();
        s = 0.f;
        const int warps = (int)(blockDim.x >> 5);
        for (int i = 0; i < warps; i++) s += red[i];
    }
    return s;
}

// This thread's place in a register version: `threads` threads hold each row (a warp, or the block),
// this is thread t of them, and its first row; the rows a block takes at a time: rows_per_block.
template <bool ROW_IS_BLOCK>
struct RowThread {
    int threads, t, rows_per_block;
    i64 first;
    __device__ __forceinline__ RowThread()
        : threads(ROW_IS_BLOCK ? (int)blockDim.x : 32),
          t(ROW_IS_BLOCK ? (int)threadIdx.x : (int)(threadIdx.x & 31)),
          rows_per_block(ROW_IS_BLOCK ? 1 : (int)(blockDim.x >> 5)),
          first((i64)blockIdx.x * rows_per_block + (ROW_IS_BLOCK ? 0 : (int)(threadIdx.x >> 5))) {}
};

// rstd of a row of n elements held in registers as above, given its mean (of v = h - pivot). Every
// thread of the row calls it (row_sum's barriers).
template <int VPT, int V, bool ROW_IS_BLOCK>
__device__ __forceinline__ float row_rstd(const float (&v)[VPT][V], float mean, int threads, int t, int n, float inv_n,
                                          float eps, float* red) {
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        const int c = (j * threads + t) * V;
#pragma unroll
        for (int e = 0; e < V; e++) {
            const float d = v[j][e] - mean;
            if (c + e < n) q += d * d;
        }
    }
    return rsqrtf(row_sum<ROW_IS_BLOCK>(q, red) * inv_n + eps);
}

// One group of a row held in registers written out: yr[c + e] = (v[e] - mean) * rstd * w[c + e] + b[c + e]
// for the V elements from column c within the row's n (w, b null: 1 and 0), rounded to T once; with
// `normalize` false, yr[c + e] = v[e]. VEC: 16-byte accesses of w, b and yr (n % V == 0, aligned
// pointers), else element by element with a bounds check each.
template <class DT, bool VEC>
__device__ __forceinline__ void store_group(const float* v, bool normalize, float mean, float rstd,
                                            const typename DT::T* w, const typename DT::T* b, typename DT::T* yr,
                                            int c, int n) {
    constexpr int V = DT::V;
    if constexpr (VEC) {
        if (c < n) {
            Pack<DT> pw, pb, out;
            if (normalize) {
                if (w) pw = *reinterpret_cast<const Pack<DT>*>(w + c);
                if (b) pb = *reinterpret_cast<const Pack<DT>*>(b + c);
#pragma unroll
                for (int e = 0; e < V; e++) {
                    const float wv = w ? DT::ld(pw.e[e]) : 1.f, bv = b ? DT::ld(pb.e[e]) : 0.f;
                    out.e[e] = DT::st(fmaf((v[e] - mean) * rstd, wv, bv));
                }
            } else {
#pragma unroll
                for (int e = 0; e < V; e++) out.e[e] = DT::st(v[e]);
            }
            *reinterpret_cast<Pack<DT>*>(yr + c) = out;
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) {
            if (c + e < n) {
                if (normalize) {
                    const float wv = w ? DT::ld(w[c + e]) : 1.f, bv = b ? DT::ld(b[c + e]) : 0.f;
                    yr[c + e] = DT::st(fmaf((v[e] - mean) * rstd, wv, bv));
                } else {
                    yr[c + e] = DT::st(v[e]);
                }
            }
        }
    }
}

// The looping versions (3) after their first pass: the row's mean from s (this thread's sum of
// h - pivot over columns threadIdx.x, + blockDim.x, ...), then the squared deviations and the output in
// two more strided passes, each reading h again through h_at(c) (float h_at(i64 c): h at column c in
// fp32, recomputed from the inputs so that every version normalizes the same h).
template <class DT, class HAt>
__device__ __forceinline__ void normalize_row_loop(const HAt& h_at, float s, float pivot, const typename DT::T* w,
                                                   const typename DT::T* b, typename DT::T* yr, int n, float inv_n,
                                                   float eps, float* red) {
    const float mean = row_sum<true>(s, red) * inv_n;
    float q = 0.f;
    for (i64 c = threadIdx.x; c < n; c += blockDim.x) {
        const float d = (h_at(c) - pivot) - mean;
        q += d * d;
    }
    const float rstd = rsqrtf(row_sum<true>(q, red) * inv_n + eps);
    for (i64 c = threadIdx.x; c < n; c += blockDim.x) {
        const float wv = w ? DT::ld(w[c]) : 1.f, bv = b ? DT::ld(b[c]) : 0.f;
        yr[c] = DT::st(fmaf(((h_at(c) - pivot) - mean) * rstd, wv, bv));
    }
}

}  // namespace libnn

// The kernels each file exports, one table for both (libnn/ops/row_kernels.py's WARP_VPTS and BLOCK_VPTS
// launch them): ROW_KERNELS(K1, K2, K3) expands the file's K1(SUFFIX, DT, VPT) (version 1 at each VPT),
// K2(SUFFIX, DT, VPT) (version 2) and K3(SUFFIX, DT) (version 3) for fp32, fp16 and bf16.
#define ROW_KERNELS_OF(K1, K2, K3, SUFFIX, DT)                                                           \
    K1(SUFFIX, DT, 1) K1(SUFFIX, DT, 2) K1(SUFFIX, DT, 4)                                                \
    K2(SUFFIX, DT, 2) K2(SUFFIX, DT, 4) K2(SUFFIX, DT, 8)                                                \
    K3(SUFFIX, DT)
// fp32 holds 4 elements a group: version 1 also at VPT 8 reaches a row of 1024, as for fp16 and bf16
#define ROW_KERNELS(K1, K2, K3)                                                                          \
    ROW_KERNELS_OF(K1, K2, K3, f32, dt_f32)                                                              \
    K1(f32, dt_f32, 8)                                                                                   \
    ROW_KERNELS_OF(K1, K2, K3, f16, dt_f16)                                                              \
    ROW_KERNELS_OF(K1, K2, K3, bf16, dt_bf16)
