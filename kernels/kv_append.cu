/*
KV-cache append for decoders: each token's k rotated (RoPE, kernels/rope.cuh) and its v copied into the
caches at the token's own position, in one pass, for prefill (positions 0..S-1) and decode steps (one
token per sequence at its current length) alike.

    k, v              (B, S, H, D), element strides (kb, ks, kh, 1) and (vb, vs, vh, 1)
    positions         (B, S), int32 or int64, element strides (pb, ps) (0 for a broadcast dimension)
    inv_freq          (R / 2,) fp32, contiguous; may be null when R = 0 (never read then)
    k_cache, v_cache  (B, L, H, D), both with element strides (cb, cs, ch, 1); or, with a page table,
                      pools of pages (pages, page_size, H, D) with those strides (cb between pages)
    page_table        null (dense caches), or (B, L / page_size) int32, element strides (tb, tp): the
                      page holding positions j * page_size .. (j + 1) * page_size - 1 of sequence b;
                      page_size = 2^page_shift (a power of two, as cuDNN's paged attention reads them:
                      a shift and a mask, not a 64-bit division, which would call a subroutine and spill)

    for token (b, s) at p = positions[b, s], 0 <= p < L, and head h, its cache row c = [b, p] (dense) or
    [page_table[b, p >> page_shift], p & (page_size - 1)] (paged):
        k_cache[c, h] = rope(k[b, s, h], p)        as kernels/rope.cu computes it (style, rotary_dim R);
                                                   R = 0 (learned positions, GPT-2): the bits copied
        v_cache[c, h] = v[b, s, h]                 the bits copied
    a position outside [0, L), or a page outside [0, pages), writes nothing: the kernel never writes
    outside the caches (the op checks positions and pages before launching unless its caller vouches
    for them).

    q                 (B, S, Hq, D), element strides (qb, qs, qh, 1), or null (Hq = 0)
    q_out             (B, S, Hq, D) contiguous: q_out[b, s, h] = rope(q[b, s, h], p), whatever p is (rope's
                      function: a decoder's query rotated in the same launch as its key, one kernel less)

I/O in fp16, bf16 (raw 16-bit words) or fp32; positions int32 or int64. sm_80 or newer. k, v and the
caches must not overlap (the op refuses k_cache and v_cache sharing memory; k or v overlapping a
cache is the caller's error); two tokens of one sequence at the same position race, as do two tokens
whose page tables send them to one cache row.

Versions (libnn/ops/kv_append.py launches it):

1) kv_append1_{f16,bf16,f32}_{i32,i64}   any strides with a contiguous last dimension
   The geometry of rope1_pairs: a block of (BX, BY) threads, BX lanes over one (token, head) row, BY
   tokens of one sequence; blockIdx.y the head (KV heads 0..H-1, then q's heads), blockIdx.z the
   sequence. Each lane rotates its k pairs (and pass-through elements), then copies its share of the v
   row; in a q head's block it rotates its q pairs into q_out. With a page table (non-null) the
   threads of a (token, head) row read its page entry (one int) before addressing the row; a null table
   is one branch, uniform over the grid.

LAUNCH (every kernel takes the same parameters)
    (const T* k, const T* v, const P* positions, const float* inv_freq, T* k_cache, T* v_cache,
     long long B, long long S, int H, int D, int R, long long L, long long kb, long long ks, long long kh,
     long long vb, long long vs, long long vh, long long cb, long long cs, long long ch, long long pb,
     long long ps, int interleaved, const int* page_table, long long tb, long long tp, int page_shift,
     long long pages, const T* q, T* q_out, int Hq, long long qb, long long qs, long long qh)
    On sm_90 and newer it is launched with programmatic stream serialization: it waits (pdl_wait) for the
    kernel ahead (the q/k/v GEMV, or rope) before its work.
    T = float (f32) or unsigned short (f16/bf16 bits); P = int (i32) or long long (i64).

    kernel           block                                   grid
    kv_append1_*     (BX, BY, 1)                             (min(ceil(S / BY), 65535), min(H + Hq, 65535), min(B, 65535))
                     BX = min(KV_MAX_BX, max(32, power of 2 >= D))
                     BY = min(KV_THREADS / BX, power of 2 >= S)

    Tokens, heads and sequences are grid-strided and a row's elements block-strided: any grid >= 1 and
    any block up to KV_THREADS threads are correct. Preconditions: R even, 0 <= R <= D < 2^31 (R = 0: no
    pairs, every element of the k row passes through), 1 <= H, 0 <= Hq, H + Hq < 2^31, B, S, L >= 1; q_out
    overlaps no input; element offsets are 64-bit. With a page table: 0 <= page_shift < 63 and L = 2^page_shift x the table's columns
    (page_shift and pages are not read without one).
*/

#include "rope.cuh"

constexpr int KV_THREADS = 256;  // threads per block: the launch bound
constexpr int KV_MAX_BX = 128;   // lanes over one (token, head) row

namespace ropek {

template <class DT, class P>
__device__ __forceinline__ void kv_append(const typename DT::T* __restrict__ k, const typename DT::T* __restrict__ v,
                                          const P* __restrict__ positions, const float* __restrict__ inv_freq,
                                          typename DT::T* __restrict__ k_cache, typename DT::T* __restrict__ v_cache,
                                          i64 B, i64 S, int H, int D, int R, i64 L, i64 kb, i64 ks, i64 kh, i64 vb,
                                          i64 vs, i64 vh, i64 cb, i64 cs, i64 ch, i64 pb, i64 ps, int interleaved,
                                          const int* __restrict__ page_table, i64 tb, i64 tp, int page_shift,
                                          i64 pages, const typename DT::T* q, typename DT::T* q_out, int Hq,
                                          i64 qb, i64 qs, i64 qh) {
    for (i64 b = blockIdx.z; b < B; b += gridDim.z) {
        for (int h = blockIdx.y; h < H + Hq; h += gridDim.y) {
            // the first token in 32 bits (grid.x <= 65535 blocks of <= 256 rows): as a 64-bit product, kept
            // live across the loops, NVRTC 13.0's ptxas spilled it in the bf16 kernels
            for (i64 s = (i64)(blockIdx.x * blockDim.y + threadIdx.y); s < S; s += (i64)gridDim.x * blockDim.y) {
                const P p = positions[b * pb + s * ps];
                if (h >= H) {   // a query head: rope's rotation, any position
                    const int hq = h - H;
                    rotate_row<DT>(q + b * qb + s * qs + hq * qh, q_out + ((b * S + s) * Hq + hq) * D, to_float(p),
                                   inv_freq, D, R, interleaved);
                    continue;
                }
                if (p < 0 || p >= L) continue;
                i64 at;
                if (page_table) {
                    const i64 page = page_table[b * tb + ((i64)p >> page_shift) * tp];
                    if (page < 0 || page >= pages) continue;
                    at = page * cb + ((i64)p & ((1ll << page_shift) - 1)) * cs + h * ch;
                } else {
                    at = b * cb + (i64)p * cs + h * ch;
                }
                rotate_row<DT>(k + b * kb + s * ks + h * kh, k_cache + at, to_float(p), inv_freq, D, R, interleaved);
                const typename DT::T* vr = v + b * vb + s * vs + h * vh;
                for (int j = threadIdx.x; j < D; j += blockDim.x) v_cache[at + j] = vr[j];
            }
        }
    }
}

}  // namespace ropek

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define KV_PARAMS(T, P)                                                                                   \
    const T* k, const T* v, const P* __restrict__ positions, const float* __restrict__ inv_freq,          \
        T* k_cache, T* v_cache, long long B, long long S, int H, int D, int R, long long L, long long kb,  \
        long long ks, long long kh, long long vb, long long vs, long long vh, long long cb, long long cs,  \
        long long ch, long long pb, long long ps, int interleaved, const int* __restrict__ page_table,     \
        long long tb, long long tp, int page_shift, long long pages, const T* q, T* q_out, int Hq,             \
        long long qb, long long qs, long long qh

#define KV1(SUFFIX, DT, PSUFFIX, P)                                                                       \
    extern "C" __global__ void __launch_bounds__(KV_THREADS)                                              \
        kv_append1_##SUFFIX##_##PSUFFIX(KV_PARAMS(ropek::DT::T, P)) {                                     \
        libnn::pdl_wait();   /* launched programmatically: k and v are the kernel ahead's output */       \
        ropek::kv_append<ropek::DT, P>(k, v, positions, inv_freq, k_cache, v_cache, B, S, H, D, R, L, kb, \
                                       ks, kh, vb, vs, vh, cb, cs, ch, pb, ps, interleaved, page_table,   \
                                       tb, tp, page_shift, pages, q, q_out, Hq, qb, qs, qh);              \
    }

KV1(f16, f16, i32, int)
KV1(f16, f16, i64, long long)
KV1(bf16, bf16, i32, int)
KV1(bf16, bf16, i64, long long)
KV1(f32, f32, i32, int)
KV1(f32, f32, i64, long long)
