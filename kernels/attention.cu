/*
Scaled dot-product attention for inference, in the style of llm.c dev/cuda: a plain kernel, a
FlashAttention-2 kernel on tensor cores, a split-K decoding kernel on tensor cores, and the masked
softmax of the unfused (cuBLAS) path.

    q    (B, Hq,  Sq,  D)    element strides (q_sb, q_sh, q_ss, 1)
    k, v (B, Hkv, Skv, D)    element strides (k_sb, k_sh, k_ss, 1), (v_sb, v_sh, v_ss, 1)
    o    (B, Hq,  Sq,  D)    element strides (o_sb, o_sh, o_ss, 1)
    bias (B, Hq,  Sq,  Skv)  element strides (b_sb, b_sh, b_si, b_sj), 0 along broadcast dims; or null
    lens_q, lens_kv (B,) int32 (0 <= L <= S), or null (every Lq = Sq, Lk = Skv)

    o[b,h,i,:] = sum_j p_ij v[b,h/g,j,:],  p_i = softmax over the allowed j of (scale * q_i . k_j + bias_ij)

with g = Hq / Hkv (query head h reads kv head h / g: MHA, GQA, MQA). The allowed keys of row i are a
prefix, j < key_end(i): j < Lk, and j <= i under causal 1 (top-left), j <= i + Lk - Lq under causal 2
(bottom-right). Rows i >= Lq, rows with no allowed key and rows whose allowed logits are all -inf (a
bias can do that) are written as exact zeros, never NaN. The softmax is taken in base 2: the logits
are x = scale*log2(e) * q.k + log2(e) * bias (the launcher passes scale_log2 = scale*log2(e)), so every
exponential is one exp2f. Everything accumulates in fp32; o is rounded to the io dtype once. fp16/bf16
are raw 16-bit storage (unsigned short). Needs sm_80 or newer (cp.async, ldmatrix, bf16 mma);
compiled by libnn with -Xptxas=-v -I kernels/ -arch=sm_XX, no CUDA toolkit header.

Versions (their rates on the H100, and those of the variants tried on the way: benchmarks/RESULTS.md,
attention):

1) attn1_naive_{f32,f16,bf16}
   One warp per query row, fp32 throughout: lane l holds q and the output accumulator at d = l + 32*t
   (t < 8, so D <= 256), and the warp walks the row's allowed keys one at a time: a warp-reduced dot
   product, then the online softmax update (running max m and sum l; the accumulator is rescaled by
   exp2(m_old - m_new)). Any D <= 256, any strides and alignment. The obviously-correct baseline and
   the fallback for what attn2 does not take (fp32, D > 128, D % 8 != 0, unaligned rows); slow on long
   rows (one shuffle reduction per key).

2) attn2_flash_d{32,64,96,128}_{f16,bf16}, attn2_flash_bias_d{32,64,96,128}_{f16,bf16}
   FlashAttention-2 (Dao, 2023) with mma.sync.m16n8k16 (fp32 accumulate). A block takes BM = 16*WARPS
   query rows of one (b, h) (each warp 16 rows) and loops over the keys in tiles of BN = 64: S = Q K^T
   for its 16 x 64 tile in registers, the online softmax on the accumulator fragments (row max and sum
   over the 4 lanes that share a row), P rounded to the io dtype in registers as the A operand of
   O += P V; S x S is never stored. Q (once), K and V tiles arrive in shared memory through 16-byte
   cp.async, zero-filled past the head dim (D rounds up to the bucket DB: D = 80 runs as 96), past Lq
   and past Lk (so masked keys meet zeros in V, never stale NaN); fragments come from ldmatrix (V with
   .trans), Q's once into registers. K and V are double-buffered: tile j+1 is copied during all of tile
   j's work, one barrier per tile (FA2's single buffers, V_j copied during S_j and K_j+1 during P_j V_j,
   took two barriers per tile). Exponentials are ex2.approx.ftz (exp2f adds a subnormal fix-up).
   Shared rows are padded to DB + 8 elements (an odd number of 16-byte chunks), which keeps every
   ldmatrix phase and cp.async store free of bank conflicts for every bucket (no XOR swizzle: 96 has
   12 chunks). Masks: blocks visit only key tiles below the
   key_end of their last row (causal skips the tiles above the diagonal), and apply the per-element
   mask only on tiles that reach past the key_end of their first row (the diagonal and Lk tiles).
   Blocks are launched last m-tile first, so under causal the longest rows start first.
   The bias kernels (separate: the bias code raised every call's registers past 255 at DB = 128)
   copy the block's BM x 64 bias tile into shared memory with K and V (cp.async) and start the S
   accumulators at bias / scale, so s * scale*log2(e) is the biased logit (a -inf bias stays -inf).
   A bias broadcast along the rows (b_si == 0: a key-padding bias (B, 1, 1, Skv)) is staged as its one
   row, which every warp reads: staging BM copies of it tripled a block's memory traffic at D = 32.
   Preconditions (the launcher checks them, and sends anything else to attn1): D % 8 == 0, D <= DB;
   q, k, v, o rows 16-byte aligned (pointers, and every stride but the last a multiple of 8 elements);
   bias kernels: scale != 0, b_sj == 1, Skv % 8 == 0 or the bias rows padded to a multiple of 8
   elements (a 16-byte copy may read up to 7 elements past Lk), bias rows 16-byte aligned.
   -DATTN2_WARPS=4 or 8 (default 8) sets the block (4 spills in the bias kernels at DB = 128).

3) attn3_decode_d{32,64,96,128}_{f16,bf16} + attn3_combine_{f16,bf16}
   Split-K decoding ("flash-decoding", Dao et al., 2023) on tensor cores, for one query row per sequence
   (Sq = 1: a decoder's step reading its KV cache), no bias, no causal mask (one row sees every key below
   Lk). The g = Hq / Hkv query heads of a kv head are the rows of one 16-row A tile (GQA: each K and V
   row is read once for all of them; rows g..15 are zeros), so a key tile's scores, online softmax and P
   V are attn2's (tile_scores, tile_softmax, tile_pv) on mma.sync. The keys of each (b, kv head) are cut
   into `splits` splits of 64-key tiles (at least a block's warps' worth each, as far as the sequence's
   own length Lk goes), one block per (kv head, split, b), kv heads fastest (the blocks running together
   read neighbouring slices of the same cache rows). A block's 2 warps take its split's tiles in turn,
   each streaming its own: 3 stages of a K and a V tile in shared memory, 2 in flight (16-byte cp.async,
   zero-filled past Lk and past D), no block barrier in the key loop. Then the warps' (m, l, o) are
   merged in warp order and written as the split's fp32 partials (o unnormalised); attn3_combine merges a
   head's splits in split order (m = max, l and o rescaled by exp2(m_s - m)) and writes o once, zeros
   where no key is allowed (Lk = 0, or Lq = 0). With one split (a batch whose (b, kv head) blocks are
   enough alone, or a cache a block's two warps cover: attention_kernels.py decode_split_tiles) there is
   nothing to merge: the block writes o itself with the combine's arithmetic (the same bits, zeros where the
   combine would write them), and the combine is not launched: at batch 64, context 4096 it was 2% of the time
   (benchmarks/RESULTS.md, nineteenth session). Deterministic run to run on one device for one shape and
   one set of lengths (the splits follow the grid, sized by the launcher from the shapes and the device;
   a sequence's bits may differ in another batch size). With a page table, k and v are pools of pages
   (k_sb and v_sb step pages) and key j is row j % page_size of page page_table[b * t_sb + j /
   page_size]; page_size = 2^page_shift >= 64, so that a tile lies in one page. Preconditions (the
   launcher checks them): fp16 or bf16, D % 8 == 0 and D <= 128 (the bucket DB as attn2's), g <=
   ATTN3_MAX_G, q, k, v rows 16-byte aligned; o any strides; the table's entries within the pools; the
   block's shared memory within the device's (every bucket on the H100; to 96 on the A100).
   (The scalar split kernel this replaced reached 40% of copy at batch 64: benchmarks/RESULTS.md.)

Unfused path, between two cuBLAS GEMMs (libnn/ops/attention_kernels.py):

   attn_softmax_{f32,f16,bf16}  (suffix: the bias dtype)
   In place on the fp32 scores s (B, Hq, Sq, Skv) contiguous, s = q.k^T unscaled: s := p, the masked
   softmax of scale*s + bias, exact zeros at masked keys and in empty rows. One block of 128 threads per
   row: an online (m, l) pass over the allowed keys, a block reduction of (m, l), then a pass that
   writes the row.

After cuDNN's fused SDPA (the cudnn path, libnn/ops/attention.py), under key padding alone:

   attn_zero_empty_batches
   cuDNN writes NaN into the rows of a batch entry with no key (lens_kv[b] == 0); this sets o[b] to
   +0.0 (all bits zero, in every float dtype) where lens_kv[b] <= 0, o C-contiguous, `words` 16-bit
   words per batch entry. One block per batch entry, which returns unless its entry has no key (a
   thread per element of o was far slower: a 64-bit division per element, benchmarks/RESULTS.md).

LAUNCH (libnn/ops/attention_kernels.py packs the parameters by the names of ATTN_PARAMS, ATTN3_PARAMS,
attn_softmax's, attn3_combine's and attn_zero_empty_batches' lists, and reads ATTN1_THREADS, ATTN2_WARPS,
ATTN2_BN, ATTN3_THREADS, ATTN3_STAGES, ATTN3_MAX_G, COMBINE_THREADS, SOFTMAX_THREADS and ZERO_THREADS from
this file)
    attn1, attn2 take the same parameters, in this order:
    (const T* q, const T* k, const T* v, T* o, const T* bias_or_null, const int* lens_q_or_null,
     const int* lens_kv_or_null, int B, int Hq, int Hkv, int Sq, int Skv, int D, int causal,
     float scale_log2, long long q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss,
     b_sb, b_sh, b_si, b_sj)          causal: 0 none, 1 top-left, 2 bottom-right; strides in elements

    kernel                 block             grid                    dynamic smem
    attn1_naive_*          (256, 1, 1)       ceil(B*Hq*Sq / 8)       0
    attn2_flash_dDB_*      (32*WARPS, 1, 1)  ceil(Sq / BM) * B * Hq  (BM + 256) * (DB + 8) * 2, BM = 16*WARPS
    attn2_flash_bias_dDB_* (32*WARPS, 1, 1)  ceil(Sq / BM) * B * Hq  the same + 2 * BM * 72 * 2
                                                                     (over 48 KB: set the max dynamic
                                                                     smem attribute first)
    attn_softmax_*         (128, 1, 1)       B*Hq*Sq                 0
    attn3_decode_dDB_*     (ATTN3_THREADS)   (Hkv, splits, B)        (16 + ATTN3_WARPS * ATTN3_STAGES * 2 * 64) * (DB + 8) * 2
        (ATTN3_PARAMS: const T* q, const T* k, const T* v, float* part_o, float* part_ml, T* o, long long
         o_sb, long long o_sh, const int* lens_q_or_null, const int* lens_kv_or_null, int Hq, int Hkv, int Skv,
         int D, int splits, float scale_log2, long long q_sb, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh,
         v_ss, const int* page_table_or_null, long long t_sb, int page_shift)
        part_o (B, Hq, splits, D), part_ml (B, Hq, splits, 2): fp32 scratch, contiguous; o is then not written.
        Or part_o and part_ml null, with splits = 1: the kernel writes o itself, as attn3_combine would have
        (no partials, no combine launch); o any strides
        splits: 1 to 65535 (any: sequence b's ceil(Lk / 64) tiles go max(ATTN3_WARPS, ceil(tiles / splits))
        a split, the splits past its end empty); over 48 KB of shared memory: set the max dynamic smem attribute first
    attn3_combine_*        (COMBINE_THREADS) B * Hq                  0
        (const float* part_o, const float* part_ml, T* o, int Hq, int D, int splits, long long o_sb,
         long long o_sh)                 a row with no key (Lk = 0 or Lq = 0: every split wrote l = 0) is zeros
    Both are launched with programmatic stream serialization on sm_90 and newer (they wait, pdl_wait, for
    the kernel ahead before their work); attn3_combine lets the kernel after it start once past its wait.
    attn3_decode does not: with one split (no combine) the kernel after it starts when it ends.
        (float* s, const T* bias_or_null, const int* lens_q_or_null, const int* lens_kv_or_null,
         int B, int Hq, int Sq, int Skv, int causal, float scale_log2, long long b_sb, b_sh, b_si, b_sj)
    attn_zero_empty_batches (256, 1, 1)       B                       0
        (const int* lens_kv, unsigned short* o, long long words)

    Every kernel needs exactly its grid (a missing block leaves rows unwritten). Grids are 1-D (attn3_decode's
    3-D: Hkv < 2^31, splits and B < 65536): the block count must stay below 2^31. Hq % Hkv == 0; o must not alias q, k, v or bias.
*/

#include "common.cuh"

#ifndef ATTN2_WARPS
#define ATTN2_WARPS 8   // 8 warps x 1 block/SM beat 4 warps x 2 on the H100 (benchmarks/RESULTS.md)
#endif
#define ATTN1_THREADS 256   // attn1: one warp per query row, 8 rows per block
#define ATTN2_BN 64         // attn2: keys per tile

namespace at {

using namespace libnn;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// Whether a row's softmax sum l carries weight: l is 0 where no key is allowed (the row is zeros), else
// at least 1, or NaN where a score is NaN (a NaN in q or in an allowed key): NaN then spreads to the row,
// as in the reference.
__device__ __forceinline__ bool weighed(float l) { return l != 0.f; }
constexpr float LOG2E = 1.4426950408889634f;

// The parameters of attn1 and attn2, in kernel-parameter order.
template <class T>
struct Args {
    const T* q; const T* k; const T* v; T* o; const T* bias; const int* lens_q; const int* lens_kv;
    int B, Hq, Hkv, Sq, Skv, D, causal;
    float scale_log2;
    i64 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, b_sb, b_sh, b_si, b_sj;
};

// One (batch, query head): its tensors from row 0 on, and its sequence lengths.
template <class T>
struct Head {
    const T* q; const T* k; const T* v; T* o; const T* bias;
    int Lq, Lk;
};

template <class T>
__device__ __forceinline__ Head<T> head(const Args<T>& a, int b, int h) {
    const int hk = h / (a.Hq / a.Hkv);
    Head<T> r;
    r.q = a.q + (b * a.q_sb + h * a.q_sh);
    r.k = a.k + (b * a.k_sb + hk * a.k_sh);
    r.v = a.v + (b * a.v_sb + hk * a.v_sh);
    r.o = a.o + (b * a.o_sb + h * a.o_sh);
    r.bias = a.bias ? a.bias + (b * a.b_sb + h * a.b_sh) : nullptr;
    r.Lq = a.lens_q ? a.lens_q[b] : a.Sq;
    r.Lk = a.lens_kv ? a.lens_kv[b] : a.Skv;
    return r;
}

// Query row i (< Lq) may attend to the keys j < key_end (a prefix; <= 0: none).
__device__ __forceinline__ int key_end(int i, int Lq, int Lk, int causal) {
    if (causal == 1) return imin(Lk, i + 1);
    if (causal == 2) return imin(Lk, i + 1 + (Lk - Lq));
    return Lk;
}

// ---------------------------------------------------------------------------------------------------
// 1) one warp per query row
template <class DT>
__device__ __forceinline__ void attn1_body(const Args<typename DT::T>& a) {
    typedef typename DT::T T;
    constexpr int PER = 8;   // elements of q and o per lane: D <= 256
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (i64)a.B * a.Hq * a.Sq) return;
    const int i = (int)(row % a.Sq);
    const int bh = (int)(row / a.Sq);
    const Head<T> hd = head(a, bh / a.Hq, bh % a.Hq);
    const int jend = i < hd.Lq ? key_end(i, hd.Lq, hd.Lk, a.causal) : 0;

    const T* qr = hd.q + i * a.q_ss;
    float qv[PER], acc[PER];
#pragma unroll
    for (int t = 0; t < PER; t++) {
        const int d = lane + 32 * t;
        qv[t] = d < a.D ? DT::ld(qr[d]) : 0.f;
        acc[t] = 0.f;
    }
    const T* br = hd.bias ? hd.bias + i * a.b_si : nullptr;
    float m = neg_inf(), l = 0.f;
    for (int j = 0; j < jend; j++) {
        const T* kr = hd.k + j * a.k_ss;
        float dot = 0.f;
#pragma unroll
        for (int t = 0; t < PER; t++) {
            const int d = lane + 32 * t;
            if (d < a.D) dot += qv[t] * DT::ld(kr[d]);
        }
        dot = warp_sum(dot);
        float x = dot * a.scale_log2;
        if (br) x = fmaf(DT::ld(br[j * a.b_sj]), LOG2E, x);
        if (x == neg_inf()) continue;   // a key the bias masks out (uniform: every lane has the same x)
        const float m_new = fmaxf(m, x);
        const float alpha = exp2f(m - m_new), p = exp2f(x - m_new);
        m = m_new;
        l = l * alpha + p;
        const T* vr = hd.v + j * a.v_ss;
#pragma unroll
        for (int t = 0; t < PER; t++) {
            const int d = lane + 32 * t;
            acc[t] = acc[t] * alpha + (d < a.D ? p * DT::ld(vr[d]) : 0.f);
        }
    }
    const float inv = weighed(l) ? fdiv_full(1.f, l) : 0.f;
    T* orow = hd.o + i * a.o_ss;
#pragma unroll
    for (int t = 0; t < PER; t++) {
        const int d = lane + 32 * t;
        if (d < a.D) orow[d] = DT::st(acc[t] * inv);
    }
}

// ---------------------------------------------------------------------------------------------------
// 2) FlashAttention-2 on mma.sync
extern __shared__ u32x4 dsmem[];   // u32x4: 16-byte aligned, as cp.async needs

// Copy rows [0, ROWS) of a (rows x D) tile, row stride `stride` elements, into shared rows of LD
// elements; rows >= valid and columns >= D are zero-filled without reading. The NT threads that copy
// are numbered by `tid` (threadIdx.x for a block, the lane for a warp alone).
template <int ROWS, int DB, int NT>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, i64 stride, int valid, int D, int tid) {
    constexpr int CH = DB / 8, LD = DB + 8, ITERS = (ROWS * CH + NT - 1) / NT;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int idx = tid + it * NT;
        if (ROWS * CH % NT != 0 && idx >= ROWS * CH) break;
        const int r = idx / CH, c = idx % CH;
        const bool ok = r < valid && c * 8 < D;
        cp_async16(dst + (u32)((r * LD + c * 8) * 2), ok ? src + (r * stride + c * 8) : src, ok ? 16 : 0);
    }
}

// The bias of the block's BM rows and the tile's BN keys, raw, by 16-byte cp.async into shared rows of
// BN + 8 elements (the pad puts the 8 rows a warp reads at once in distinct banks); zero-filled outside
// the live rows and Lk. It travels with the K and V tiles. (Read from global memory at the accumulator
// positions instead, or staged by plain 2-byte loads, the bias made the kernel spill at DB = 128.)
// A bias broadcast along the rows (b_si == 0) is staged as its row 0 alone.
template <int BM, int BN, int NT>
__device__ __forceinline__ void stage_bias(u32 dst, const u16* src, i64 b_si, int live, int valid) {
    constexpr int CH = BN / 8, ITERS = BM * CH / NT;
    static_assert(BM * CH % NT == 0, "bias tile shape");
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int idx = threadIdx.x + it * NT, r = idx / CH, c = idx % CH;
        if (b_si == 0 && r > 0) break;   // (idx grows with it: a thread past row 0 stays past it)
        const bool ok = r < live && c * 8 < valid;
        cp_async16(dst + (u32)((r * (BN + 8) + c * 8) * 2), ok ? src + (r * b_si + c * 8) : src, ok ? 16 : 0);
    }
}

// s = Q K^T for the warp's 16 rows and the 64 keys of the tile; with BIAS the accumulators start at
// bias / scale instead of 0, so that the softmax's s * scale*log2(e) is the biased logit and the bias
// costs no pass (nor registers) of its own; a -inf bias stays -inf. qf: Q's A fragments (kept in
// registers: reloading them per tile was measured slower); k_addr: this lane's ldmatrix row address
// (see attn2_body); sb: the staged bias at this lane's (row g, key 2t); sb_rows8: the elements from its
// row g to row g + 8 (0 for a bias broadcast along the rows, staged as one row).
template <class DT, int DB, int BN, bool BIAS>
__device__ __forceinline__ void tile_scores(float (&s)[8][4], const u32 (&qf)[DB / 16][4], u32 k_addr, const u16* sb,
                                            int sb_rows8, float inv_scale) {
    constexpr int LD = DB + 8;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            u32 pair = 0u;
            if constexpr (BIAS) pair = *reinterpret_cast<const u32*>(sb + r * sb_rows8 + 8 * n);
            s[n][2 * r] = BIAS ? DT::ld((u16)pair) * inv_scale : 0.f;
            s[n][2 * r + 1] = BIAS ? DT::ld((u16)(pair >> 16)) * inv_scale : 0.f;
        }
#pragma unroll
    for (int kk = 0; kk < DB / 16; kk++)
#pragma unroll
        for (int np = 0; np < 4; np++) {
            u32 b[4];
            ldsm_x4(b[0], b[1], b[2], b[3], k_addr + (u32)(np * 16 * LD * 2 + kk * 32));
            mma16816<DT::bf16 != 0>(s[2 * np], qf[kk], b);
            mma16816<DT::bf16 != 0>(s[2 * np + 1], qf[kk], b + 2);
        }
}

// The online softmax over one tile, on the accumulator fragments: this lane holds rows g (c = 0, 1)
// and g + 8 (c = 2, 3) at keys j0 + 8n + 2t + (c & 1). Turns s into the logits' exponentials, packed
// into pa as the A fragments of P V, and rescales the running m, l and the output accumulator.
template <class DT, int NO>
__device__ __forceinline__ void tile_softmax(float (&s)[8][4], u32 (&pa)[4][4], float (&acc)[NO][4], float (&m)[2],
                                             float (&l)[2], const int (&jend)[2], bool mask, int j0, int t,
                                             float scale_log2) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int j = j0 + 8 * n + 2 * t + (c & 1);
            s[n][c] = !mask || j < jend[c >> 1] ? s[n][c] * scale_log2 : neg_inf();
        }
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) mx[c >> 1] = fmaxf(mx[c >> 1], s[n][c]);
    float mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));   // the 4 lanes of a row
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mu[r] = mx[r] == neg_inf() ? 0.f : mx[r];   // nothing allowed yet: exp2(-inf - 0) = 0, not NaN
        const float alpha = exp2_ftz(m[r] - mu[r]);
        m[r] = mx[r];
        l[r] *= alpha;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            acc[n][2 * r] *= alpha;
            acc[n][2 * r + 1] *= alpha;
        }
    }
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            s[n][c] = exp2_ftz(s[n][c] - mu[c >> 1]);
            l[c >> 1] += s[n][c];   // this lane's columns only: the row sum is reduced once, at the end
        }
    // C fragments of key tiles 2kk, 2kk+1 are the A fragment of k-step kk (keys 16kk .. 16kk+15)
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        pa[kk][0] = pack_f32x2<DT::bf16 != 0>(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack_f32x2<DT::bf16 != 0>(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack_f32x2<DT::bf16 != 0>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack_f32x2<DT::bf16 != 0>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// acc += P V for the tile's 64 keys; v_addr: this lane's ldmatrix.trans row address.
template <bool BF, int DB>
__device__ __forceinline__ void tile_pv(float (&acc)[DB / 8][4], const u32 (&pa)[4][4], u32 v_addr) {
    constexpr int LD = DB + 8;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int dp = 0; dp < DB / 16; dp++) {
            u32 b[4];
            ldsm_x4_trans(b[0], b[1], b[2], b[3], v_addr + (u32)(kk * 16 * LD * 2 + dp * 32));
            mma16816<BF>(acc[2 * dp], pa[kk], b);
            mma16816<BF>(acc[2 * dp + 1], pa[kk], b + 2);
        }
}

template <class DT, int DB, int WARPS, bool BIAS>
__device__ __forceinline__ void attn2_body(const Args<u16>& a) {
    constexpr int BM = 16 * WARPS, BN = ATTN2_BN, LD = DB + 8, NT = 32 * WARPS, NO = DB / 8;
    constexpr bool BF = DT::bf16 != 0;
    static_assert(DB % 16 == 0 && DB <= 128, "head-dim bucket");
    // shared memory: Q [BM][LD], then two stages of K [BN][LD] + V [BN][LD], then (BIAS) two stages of
    // the bias tile [BM][BN + 8]
    constexpr int KV_STAGE = 2 * BN * LD * 2, BIAS_STAGE = BM * (BN + 8);   // bytes, elements
    const u32 sQ = smem_addr(dsmem), sKV = sQ + BM * LD * 2;
    u16* const sBias = reinterpret_cast<u16*>(dsmem) + (BM + 4 * BN) * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    const int mtiles = (a.Sq + BM - 1) / BM;
    const int m0 = (mtiles - 1 - (int)(blockIdx.x % mtiles)) * BM;   // last m-tile first
    const int bh = (int)(blockIdx.x / mtiles);
    const Head<u16> hd = head(a, bh / a.Hq, bh % a.Hq);

    // Key tiles below kv_end hold every key some live row of the block may see; keys below kv_full
    // every live row may see (0 if any row of the block is past Lq: then every tile is masked).
    const int live = imin(BM, hd.Lq - m0);
    const int kv_end = live > 0 ? key_end(m0 + live - 1, hd.Lq, hd.Lk, a.causal) : 0;
    const int kv_full = live == BM ? key_end(m0, hd.Lq, hd.Lk, a.causal) : 0;
    const int ntiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;

    int jend[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = m0 + warp * 16 + g + 8 * r;
        jend[r] = i < hd.Lq ? key_end(i, hd.Lq, hd.Lk, a.causal) : 0;
    }
    const bool bias_rows = a.b_si != 0;   // else one row broadcast to every query row
    const u16* sb_lane = sBias + (bias_rows ? (warp * 16 + g) * (BN + 8) : 0) + 2 * t;
    const int sb_rows8 = bias_rows ? 8 * (BN + 8) : 0;
    const float inv_scale = BIAS ? fdiv_full(LOG2E, a.scale_log2) : 0.f;   // the launcher sends scale 0 to attn1
    auto load_tile_kv = [&](int j0, int stage) {   // K, V (and bias) of key tile j0 into `stage`, one group
        const u32 kv = sKV + stage * KV_STAGE;
        load_tile<BN, DB, NT>(kv, hd.k + j0 * a.k_ss, a.k_ss, hd.Lk - j0, a.D, threadIdx.x);
        load_tile<BN, DB, NT>(kv + BN * LD * 2, hd.v + j0 * a.v_ss, a.v_ss, hd.Lk - j0, a.D, threadIdx.x);
        if constexpr (BIAS)
            stage_bias<BM, BN, NT>(smem_addr(sBias + stage * BIAS_STAGE), hd.bias + (m0 * a.b_si + j0), a.b_si, live,
                                   hd.Lk - j0);
        cp_async_commit();
    };

    // ldmatrix row addresses (stage 0). Q (A, 16x16): lanes 0-15 rows 0-15 at d 0-7, lanes 16-31 the same
    // rows at d 8-15. K (B of two key tiles): lanes 0-7 keys 0-7 / d 0-7, 8-15 keys 0-7 / d 8-15, 16-23
    // keys 8-15 / d 0-7, 24-31 keys 8-15 / d 8-15. V (.trans, B of two d tiles): lanes 0-15 keys 0-15
    // at d 0-7, lanes 16-31 the same keys at d 8-15.
    const u32 q_addr = sQ + (u32)(((warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8) * 2);
    const u32 k_addr = sKV + (u32)(((((lane >> 4) << 3) + (lane & 7)) * LD + ((lane >> 3) & 1) * 8) * 2);
    const u32 v_addr = sKV + (u32)((BN * LD + (lane & 15) * LD + (lane >> 4) * 8) * 2);

    u32 qf[DB / 16][4];
    float acc[NO][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NO; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[n][c] = 0.f;

    // Double-buffered: tile it+1 is copied during all of tile it's work, one barrier per tile.
    if (ntiles > 0) {
        load_tile<BM, DB, NT>(sQ, hd.q + m0 * a.q_ss, a.q_ss, live, a.D, threadIdx.x);
        load_tile_kv(0, 0);
    }
    for (int it = 0; it < ntiles; it++) {
        const int stage = it & 1;
        cp_async_wait<0>();   // tile it (and Q) landed for this thread ...
        __syncthreads();      // ... for all, and all are done with tile it-1, whose stage is refilled next
        if (it + 1 < ntiles) load_tile_kv((it + 1) * BN, stage ^ 1);
        if (it == 0)
#pragma unroll
            for (int kk = 0; kk < DB / 16; kk++) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], q_addr + kk * 32);

        float s[8][4];
        u32 pa[4][4];
        tile_scores<DT, DB, BN, BIAS>(s, qf, k_addr + stage * KV_STAGE, sb_lane + stage * BIAS_STAGE, sb_rows8,
                                      inv_scale);
        tile_softmax<DT, NO>(s, pa, acc, m, l, jend, (it + 1) * BN > kv_full, it * BN, t, a.scale_log2);
        tile_pv<BF, DB>(acc, pa, v_addr + stage * KV_STAGE);
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const float inv = weighed(l[r]) ? fdiv_full(1.f, l[r]) : 0.f;
        const int i = m0 + warp * 16 + g + 8 * r;
        if (i >= a.Sq) continue;
        u16* orow = hd.o + i * a.o_ss;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            const int d = n * 8 + 2 * t;
            if (d < a.D)
                *reinterpret_cast<u32*>(orow + d) = pack_f32x2<BF>(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Unfused path: masked softmax of one row of fp32 scores, in place
constexpr int SOFTMAX_THREADS = 128;

// (m, l) of two parts of a row merged: l is relative to m, and m = -inf only while l is 0 (no key) or NaN (NaN
// logits only). Where neither part has a logit above -inf the l are added as they are: 0 stays 0, NaN spreads.
__device__ __forceinline__ void merge(float& m, float& l, float m2, float l2) {
    const float mn = fmaxf(m, m2);
    if (mn == neg_inf()) {
        l += l2;
        return;
    }
    l = l * exp2f(m - mn) + l2 * exp2f(m2 - mn);
    m = mn;
}

template <class DT>
__device__ __forceinline__ void softmax_body(float* s, const typename DT::T* bias, const int* lens_q,
                                             const int* lens_kv, int Hq, int Sq, int Skv, int causal,
                                             float scale_log2, i64 b_sb, i64 b_sh, i64 b_si, i64 b_sj) {
    typedef typename DT::T T;
    __shared__ float part_m[SOFTMAX_THREADS / 32], part_l[SOFTMAX_THREADS / 32];
    const int row = blockIdx.x, i = row % Sq, bh = row / Sq, b = bh / Hq, h = bh % Hq;
    const int Lq = lens_q ? lens_q[b] : Sq, Lk = lens_kv ? lens_kv[b] : Skv;
    const int jend = i < Lq ? key_end(i, Lq, Lk, causal) : 0;
    float* sr = s + (i64)row * Skv;
    const T* br = bias ? bias + (b * b_sb + h * b_sh + i * b_si) : nullptr;
    auto logit = [&](int j) { return br ? fmaf(DT::ld(br[j * b_sj]), LOG2E, sr[j] * scale_log2) : sr[j] * scale_log2; };

    float m = neg_inf(), l = 0.f;
    for (int j = threadIdx.x; j < jend; j += SOFTMAX_THREADS) {
        const float x = logit(j);   // a key weighs 1 at its own max; x - x is NaN where x is NaN or +inf
        if (x != neg_inf()) merge(m, l, x, x - x + 1.f);   // (the reference's softmax is NaN there too)
    }
#pragma unroll
    for (int off = 16; off; off >>= 1)
        merge(m, l, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, l, off));
    if ((threadIdx.x & 31) == 0) {
        part_m[threadIdx.x >> 5] = m;
        part_l[threadIdx.x >> 5] = l;
    }
    __syncthreads();
    m = part_m[0];
    l = part_l[0];
#pragma unroll
    for (int w = 1; w < SOFTMAX_THREADS / 32; w++) merge(m, l, part_m[w], part_l[w]);

    const float inv = weighed(l) ? fdiv_full(1.f, l) : 0.f;
    for (int j = threadIdx.x; j < Skv; j += SOFTMAX_THREADS) sr[j] = j < jend && weighed(l) ? exp2f(logit(j) - m) * inv : 0.f;
}

// ---------------------------------------------------------------------------------------------------
// 3) split-K decoding on tensor cores: the g query heads of a (b, kv head) as the rows of one mma tile
constexpr int ATTN3_THREADS = 64;       // 2 warps a block; each streams its own key tiles
constexpr int ATTN3_WARPS = ATTN3_THREADS / 32;
constexpr int ATTN3_STAGES = 3;         // K + V tiles a warp holds in shared memory: STAGES - 1 in flight
constexpr int ATTN3_MAX_G = 16;         // query heads per kv head: the 16 rows of the A tile (the launcher checks)
constexpr int COMBINE_THREADS = 128;    // attn3_combine: threads per query head, over the head dim

__host__ __device__ constexpr int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

// load_tile for one warp (the lane numbers the threads), its addresses advanced in steps the compiler
// cannot see through: with load_tile's, it keeps every row's offset live across attn3's key loop (255
// registers and spills). Lane l copies 16-byte chunk (l + 32 p) % CH of row (l + 32 p) / CH, for each of
// the PERIOD phases p, then the same chunk RP rows further on, to the tile's end. Each copy asks L2 for
// the 256 bytes around it: a cache row's neighbouring kv heads, which the blocks beside this one read.
template <int ROWS, int DB>
__device__ __forceinline__ void warp_load_tile(u32 dst, const u16* src, i64 stride, int valid, int D, int lane) {
    constexpr int CH = DB / 8, LD = DB + 8, PERIOD = CH / gcd(CH, 32), RP = 32 * PERIOD / CH;
    static_assert(ROWS % RP == 0, "tile copy shape");
#pragma unroll
    for (int ph = 0; ph < PERIOD; ph++) {
        const int idx = lane + 32 * ph, r0 = idx / CH, c = idx % CH;
        const bool col = c * 8 < D;
        const u16* p = src + (r0 * stride + c * 8);
        const u32 d = dst + (u32)((r0 * LD + c * 8) * 2);
#pragma unroll 8   // (whole, the 32 copies a lane makes of a tile at DB = 128 took 255 registers and spilled)
        for (int it = 0; it < ROWS / RP; it++) {
            const bool ok = col && r0 + it * RP < valid;
            cp_async16_l2_256(d + (u32)(it * RP * LD * 2), ok ? p : src, ok ? 16 : 0);
            p += RP * stride;
            asm volatile("" : "+l"(p));
        }
    }
}

// The scores, softmax and P V of one key tile are attn2's (tile_scores, tile_softmax, tile_pv) on a warp's
// own copy of the tile; a block's warps take the split's tiles in turn, then merge into one partial.
template <class DT, int DB>
__device__ __forceinline__ void attn3_body(const u16* __restrict__ q, const u16* __restrict__ k,
                                           const u16* __restrict__ v, float* __restrict__ part_o,
                                           float* __restrict__ part_ml, u16* __restrict__ o, i64 o_sb, i64 o_sh,
                                           const int* __restrict__ lens_q,
                                           const int* __restrict__ lens_kv, int Hq, int Hkv, int Skv, int D,
                                           int splits, float scale_log2, i64 q_sb, i64 q_sh,
                                           i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss,
                                           const int* __restrict__ page_table, i64 t_sb, int page_shift) {
    constexpr int BN = ATTN2_BN, LD = DB + 8, NO = DB / 8, W = ATTN3_WARPS, S = ATTN3_STAGES;
    constexpr int TILE = BN * LD * 2;             // bytes of one K or V tile in shared memory
    constexpr bool BF = DT::bf16 != 0;
    static_assert(DB % 16 == 0 && DB <= 128, "head-dim bucket");
    static_assert(16 * DB * 4 + 2 * 16 * 4 <= S * 2 * TILE, "a warp's partial fits its stages");
    static_assert(ATTN3_MAX_G == 16, "the query heads of a kv head are the rows of one m16n8k16 A tile");
    // kv heads vary fastest over the grid: the blocks running at once read neighbouring slices of the same
    // cache rows (B, L, Hkv, D), not rows a kv head's stride apart
    const int hk = blockIdx.x, split = blockIdx.y, b = blockIdx.z, G = Hq / Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // Launched programmatically: q, k, v and the lengths are the kernels' ahead output. No early trigger
    // (pdl_launch_dependents) here: the combine kernel's start gained nothing, and the output projection's
    // GEMV, when it was the dependent, made the 1.1B LLaMA's batch-1 step 10% slower (benchmarks/RESULTS.md)
    pdl_wait();
    const int Lk = lens_kv ? lens_kv[b] : Skv;
    const bool live = lens_q ? lens_q[b] > 0 : true;
    // The sequence's tiles in `splits` parts of at least W tiles: the launcher sized the splits by the
    // cache's length Skv, and a shorter sequence spreads over the splits as far as its own tiles go
    const int tiles_b = live ? (Lk + BN - 1) / BN : 0, per = imax(W, (tiles_b + splits - 1) / splits);
    const int start = split * per * BN, end = live ? imin(Lk, start + per * BN) : 0;
    // head hk G + r's partials: part_ml[(first + r splits) 2 ..] and part_o[(first + r splits) D ..]; without
    // partials (one split) the block writes o itself, head hk G + r's row at o + b o_sb + (hk G + r) o_sh
    const i64 first = (i64)(b * Hq + hk * G) * splits + split;
    if (end <= start) {  // no key in this split: a part that weighs nothing in the merge, or rows of zeros
        if (part_o == nullptr) {
            for (int j = threadIdx.x; j < G * D; j += ATTN3_THREADS) o[b * o_sb + (hk * G + j / D) * o_sh + j % D] = 0;
        } else {
            for (int r = threadIdx.x; r < G; r += ATTN3_THREADS) {
                part_ml[(first + (i64)r * splits) * 2] = neg_inf();
                part_ml[(first + (i64)r * splits) * 2 + 1] = 0.f;
            }
        }
        return;
    }
    // shared memory: Q [16][LD] (rows >= G zero), then each warp's S stages of K [BN][LD] + V [BN][LD]
    const u32 sQ = smem_addr(dsmem), sW = sQ + 16 * LD * 2 + warp * S * 2 * TILE;
    // Key j's K row: with a page table, row j % page_size of page table[b][j / page_size] (k_sb, v_sb
    // step pages); a tile of 64 keys lies in one page (page_size a power of two >= 64)
    const u16* const kh = k + hk * k_sh + (page_table ? 0 : b * k_sb);
    const u16* const vh = v + hk * v_sh + (page_table ? 0 : b * v_sb);
    const int* const pages = page_table ? page_table + b * t_sb : nullptr;
    const int in_page = (1 << page_shift) - 1;
    const int tiles = (end - start + BN - 1) / BN;
    const int mine = tiles > warp ? (tiles - warp + W - 1) / W : 0;   // this warp's: warp, warp + W, ...
    auto load = [&](int i) {  // the warp's i-th tile into stage i % S, one group (empty past its last)
        if (i < mine) {
            const int j0 = start + (warp + i * W) * BN;
            const u32 st = sW + (i % S) * 2 * TILE;
            const i64 page = pages ? pages[j0 >> page_shift] : 0;
            const int row = pages ? j0 & in_page : j0;
            warp_load_tile<BN, DB>(st, kh + page * k_sb + row * k_ss, k_ss, end - j0, D, lane);
            warp_load_tile<BN, DB>(st + TILE, vh + page * v_sb + row * v_ss, v_ss, end - j0, D, lane);
        }
        cp_async_commit();
    };
    load_tile<16, DB, ATTN3_THREADS>(sQ, q + b * q_sb + hk * G * q_sh, q_sh, G, D, threadIdx.x);
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < S - 1; i++) load(i);
    cp_async_wait<S - 1>();   // Q landed for this thread ...
    __syncthreads();          // ... and for every thread
    u32 qf[DB / 16][4];
    const u32 q_addr = sQ + (u32)(((lane & 15) * LD + (lane >> 4) * 8) * 2);
#pragma unroll
    for (int kk = 0; kk < DB / 16; kk++) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], q_addr + kk * 32);

    // ldmatrix row addresses within a stage, as in attn2_body
    const u32 k_off = (u32)(((((lane >> 4) << 3) + (lane & 7)) * LD + ((lane >> 3) & 1) * 8) * 2);
    const u32 v_off = (u32)(TILE + ((lane & 15) * LD + (lane >> 4) * 8) * 2);
    float acc[NO][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NO; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[n][c] = 0.f;
    const int jend[2] = {end, end};
    for (int i = 0; i < mine; i++) {
        cp_async_wait<S - 2>();   // tile i landed for this lane ...
        __syncwarp();             // ... for the warp, and every lane is done with tile i - 1's stage
        load(i + S - 1);          // which takes tile i + S - 1
        const int j0 = start + (warp + i * W) * BN;
        const u32 st = sW + (i % S) * 2 * TILE;
        float s[8][4];
        u32 pa[4][4];
        tile_scores<DT, DB, BN, false>(s, qf, st + k_off, nullptr, 0, 0.f);
        tile_softmax<DT, NO>(s, pa, acc, m, l, jend, j0 + BN > end, j0, t, scale_log2);
        tile_pv<BF, DB>(acc, pa, st + v_off);
    }
    cp_async_wait<0>();   // (the groups left are empty)
#pragma unroll
    for (int r = 0; r < 2; r++) {   // row sums over the 4 lanes of a row
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }

    // Warps 1.. leave their (m, l, o) in their own stages; warp 0 adds them to its own in warp order.
    __syncwarp();
    float* const red = reinterpret_cast<float*>(reinterpret_cast<char*>(dsmem) + 16 * LD * 2);
    constexpr int RED = S * 2 * TILE / 4;   // floats between two warps' partials
    if (warp > 0) {
        float* const mine_o = red + warp * RED;
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int n = 0; n < NO; n++)
                *reinterpret_cast<float2*>(mine_o + (g + 8 * r) * DB + n * 8 + 2 * t) =
                    make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
            if (t == 0) {
                mine_o[16 * DB + g + 8 * r] = m[r];
                mine_o[16 * DB + 16 + g + 8 * r] = l[r];
            }
        }
    }
    __syncthreads();
    if (warp > 0) return;
    for (int w = 1; w < W; w++) {
        const float* const theirs = red + w * RED;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mw = theirs[16 * DB + g + 8 * r], mn = fmaxf(m[r], mw);
            // neither has a score above -inf (no key, or NaN scores only): added as they are (merge's rule)
            const bool none = mn == neg_inf();
            const float a = none ? 1.f : exp2f(m[r] - mn), aw = none ? 1.f : exp2f(mw - mn);
            l[r] = l[r] * a + theirs[16 * DB + 16 + g + 8 * r] * aw;
            m[r] = mn;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                const float2 ow = *reinterpret_cast<const float2*>(theirs + (g + 8 * r) * DB + n * 8 + 2 * t);
                acc[n][2 * r] = acc[n][2 * r] * a + ow.x * aw;
                acc[n][2 * r + 1] = acc[n][2 * r + 1] * a + ow.y * aw;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = g + 8 * r;
        if (row >= G) continue;
        if (part_o == nullptr) {
            // attn3_combine's arithmetic for one split, bit for bit: (0 + o) (1 / l), and +0 where l is 0 (no
            // key), so that a row's bits do not depend on the splits its batch gets
            u16* const o_row = o + b * o_sb + (hk * G + row) * o_sh;
            const bool kept = weighed(l[r]);
            const float inv = kept ? fdiv_full(1.f, l[r]) : 0.f;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                const int d = n * 8 + 2 * t;
                if (d >= D) continue;
#pragma unroll
                for (int e = 0; e < 2; e++)   // (o's strides may be odd: one element at a time)
                    o_row[d + e] = kept ? DT::st((0.f + acc[n][2 * r + e]) * inv) : (u16)0;
            }
            continue;
        }
        float* const po_row = part_o + (first + (i64)row * splits) * D;
#pragma unroll
        for (int n = 0; n < NO; n++) {
            const int d = n * 8 + 2 * t;
            if (d < D) *reinterpret_cast<float2*>(po_row + d) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
        }
        if (t == 0) {
            part_ml[(first + (i64)row * splits) * 2] = m[r];
            part_ml[(first + (i64)row * splits) * 2 + 1] = l[r];
        }
    }
}

// o[b, h] from the splits' partials of head (b, h): one block per head
template <class DT>
__device__ __forceinline__ void decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               typename DT::T* __restrict__ o, int Hq, int D, int splits, i64 o_sb,
                                               i64 o_sh) {
    pdl_wait();   // the partials are attn3_decode's output
    // the output projection's GEMV may start: its blocks load their first weights while this small kernel
    // runs (benchmarks/RESULTS.md, sixteenth and eighteenth sessions)
    pdl_launch_dependents();
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq;
    const float* ml = part_ml + (i64)bh * splits * 2;
    const float* po = part_o + (i64)bh * splits * D;
    float m = neg_inf();
    for (int s = 0; s < splits; s++) m = fmaxf(m, ml[2 * s]);
    float l = 0.f;
    for (int s = 0; s < splits; s++)   // a split without keys weighs nothing (its m - m may be NaN)
        if (weighed(ml[2 * s + 1])) l += ml[2 * s + 1] * exp2f(ml[2 * s] - m);
    const float inv = weighed(l) ? fdiv_full(1.f, l) : 0.f;
    typename DT::T* orow = o + b * o_sb + h * o_sh;
    for (int d = threadIdx.x; d < D; d += COMBINE_THREADS) {
        float sum = 0.f;
        for (int s = 0; s < splits; s++)  // a split without keys wrote no o: never read it
            if (weighed(ml[2 * s + 1])) sum += po[(i64)s * D + d] * exp2f(ml[2 * s] - m);
        orow[d] = DT::st(sum * inv);
    }
}

}  // namespace at

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define ATTN_PARAMS(T)                                                                                     \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,          \
        const T* __restrict__ bias, const int* __restrict__ lens_q, const int* __restrict__ lens_kv, int B, \
        int Hq, int Hkv, int Sq, int Skv, int D, int causal, float scale_log2, at::i64 q_sb, at::i64 q_sh, \
        at::i64 q_ss, at::i64 k_sb, at::i64 k_sh, at::i64 k_ss, at::i64 v_sb, at::i64 v_sh, at::i64 v_ss,  \
        at::i64 o_sb, at::i64 o_sh, at::i64 o_ss, at::i64 b_sb, at::i64 b_sh, at::i64 b_si, at::i64 b_sj
#define ATTN_ARGS                                                                                          \
    {q, k, v, o, bias, lens_q, lens_kv, B, Hq, Hkv, Sq, Skv, D, causal, scale_log2, q_sb, q_sh, q_ss, k_sb, \
     k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, b_sb, b_sh, b_si, b_sj}

#define ATTN1(SUFFIX, DT)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN1_THREADS) attn1_naive_##SUFFIX(ATTN_PARAMS(at::DT::T)) { \
        at::attn1_body<at::DT>(at::Args<at::DT::T> ATTN_ARGS);                                \
    }
ATTN1(f32, dt_f32)
ATTN1(f16, dt_f16)
ATTN1(bf16, dt_bf16)

// 4 warps: 2 blocks per SM fit in registers (<= 255 each) and shared memory. The bias gets kernels of
// its own: compiled into one kernel, its code pushed the register count of every call past 255.
#define ATTN2(NAME, DT, DB, BIAS)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * ATTN2_WARPS, ATTN2_WARPS == 4 ? 2 : 1) NAME(ATTN_PARAMS(at::u16)) { \
        at::attn2_body<at::DT, DB, ATTN2_WARPS, BIAS>(at::Args<at::u16> ATTN_ARGS);                          \
    }
#define ATTN2_ALL(DB)                                          \
    ATTN2(attn2_flash_d##DB##_f16, dt_f16, DB, false)          \
    ATTN2(attn2_flash_d##DB##_bf16, dt_bf16, DB, false)        \
    ATTN2(attn2_flash_bias_d##DB##_f16, dt_f16, DB, true)      \
    ATTN2(attn2_flash_bias_d##DB##_bf16, dt_bf16, DB, true)
ATTN2_ALL(32)
ATTN2_ALL(64)
ATTN2_ALL(96)
ATTN2_ALL(128)

#define ATTN_SOFTMAX(SUFFIX, DT)                                                                             \
    extern "C" __global__ void __launch_bounds__(at::SOFTMAX_THREADS) attn_softmax_##SUFFIX(                 \
        float* __restrict__ s, const at::DT::T* __restrict__ bias, const int* __restrict__ lens_q,           \
        const int* __restrict__ lens_kv, int B, int Hq, int Sq, int Skv, int causal, float scale_log2,       \
        at::i64 b_sb, at::i64 b_sh, at::i64 b_si, at::i64 b_sj) {                                            \
        at::softmax_body<at::DT>(s, bias, lens_q, lens_kv, Hq, Sq, Skv, causal, scale_log2, b_sb, b_sh, b_si, \
                                 b_sj);                                                                      \
    }
ATTN_SOFTMAX(f32, dt_f32)
ATTN_SOFTMAX(f16, dt_f16)
ATTN_SOFTMAX(bf16, dt_bf16)

#define ZERO_THREADS 256  // attn_zero_empty_batches: threads per batch entry

extern "C" __global__ void __launch_bounds__(ZERO_THREADS) attn_zero_empty_batches(
    const int* __restrict__ lens_kv, unsigned short* __restrict__ o, long long words) {
    libnn::pdl_launch_dependents();   // the output projection's GEMV streams its weight meanwhile
    if (lens_kv[blockIdx.x] > 0) return;
    unsigned short* ob = o + (long long)blockIdx.x * words;
    for (long long j = threadIdx.x; j < words; j += ZERO_THREADS) ob[j] = 0;
}

#define ATTN3_PARAMS                                                                                         \
    const at::u16* __restrict__ q, const at::u16* __restrict__ k, const at::u16* __restrict__ v,                \
        float* __restrict__ part_o, float* __restrict__ part_ml, at::u16* __restrict__ o, at::i64 o_sb,           \
        at::i64 o_sh, const int* __restrict__ lens_q, const int* __restrict__ lens_kv, int Hq, int Hkv, int Skv,  \
        int D, int splits, float scale_log2, at::i64 q_sb, at::i64 q_sh, at::i64 k_sb, at::i64 k_sh, at::i64 k_ss, \
        at::i64 v_sb, at::i64 v_sh, at::i64 v_ss, const int* __restrict__ page_table, at::i64 t_sb, int page_shift

// 2 warps: an H100 SM holds 3 blocks at DB = 32, 2 at 64, 1 at 96 and 128 (shared memory).
#define ATTN3(NAME, DT, DB)                                                                                     \
    extern "C" __global__ void __launch_bounds__(at::ATTN3_THREADS) NAME(ATTN3_PARAMS) {                       \
        at::attn3_body<at::DT, DB>(q, k, v, part_o, part_ml, o, o_sb, o_sh, lens_q, lens_kv, Hq, Hkv, Skv, D,   \
                                   splits, scale_log2, q_sb, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,         \
                                   page_table, t_sb, page_shift);                                             \
    }
#define ATTN3_ALL(DB)                                  \
    ATTN3(attn3_decode_d##DB##_f16, dt_f16, DB)        \
    ATTN3(attn3_decode_d##DB##_bf16, dt_bf16, DB)
ATTN3_ALL(32)
ATTN3_ALL(64)
ATTN3_ALL(96)
ATTN3_ALL(128)

#define ATTN3_COMBINE(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(at::COMBINE_THREADS) attn3_combine_##SUFFIX(                   \
        const float* __restrict__ part_o, const float* __restrict__ part_ml, at::DT::T* __restrict__ o, int Hq,  \
        int D, int splits, at::i64 o_sb, at::i64 o_sh) {                                                        \
        at::decode_combine<at::DT>(part_o, part_ml, o, Hq, D, splits, o_sb, o_sh);                              \
    }
ATTN3_COMBINE(f16, dt_f16)
ATTN3_COMBINE(bf16, dt_bf16)
