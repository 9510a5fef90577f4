/*
Embedding lookup with the position and token-type rows added and an optional LayerNorm, in one pass
over each token (BERT's embedding layer), in the style of llm.c dev/cuda:

    e[r, c] = word[ids[r], c] + pos[pos_offset + r % S, c] + type[type_ids[r], c]      (in fp32)
    y[r, c] = (e[r, c] - mean_r) * rstd_r * w[c] + b[c]        where normalization is asked for
    y[r, c] = e[r, c]                                          otherwise

r runs over the M = prod(ids.shape) tokens in row-major order; S is ids' last dimension, so r % S is a
token's position in its sequence. pos, type, type_ids, w and b may each be null: no position term, no
type term, every token of type 0 (Hugging Face's default), and w, b = 1, 0. The tables are (rows, H)
row-major and contiguous, w and b (H,), y (M, H). I/O in fp32, fp16 or bf16 (raw 16-bit words,
converted with PTX), all arithmetic in fp32, y rounded once. ids and type_ids are int32 or int64 (the
`flags` say which). No CUDA toolkit header (only kernels/common.cuh, and kernels/row_norm.cuh, the
row sum and normalization it shares with kernels/layer_norm.cu); sm_80 or newer (cvt.rn.bf16.f32).

One pass: the rows are gathered, summed and normalized in registers and y is written once, where
take + add + add + layer_norm read and wrote the (M, H) activations four times more.

Out-of-range indices. The kernel cannot raise an error, so it never reads outside a table: a token
whose id is outside [0, rows), whose type id is outside [0, type_rows), or whose position row is
outside [0, pos_rows) gets NaN in every element of its row of y (the launcher checks the positions on
the host, so only the ids can cause it in practice), and where `bad` is not null, 1 + the token's index
r is stored there (one plain 8-byte store per bad token: the last one stored stays, any of them names a
bad token). `bad` is meant to be mapped pinned host memory (libnn/ops/embedding.py IdErrors), which the
host reads whenever it likes without synchronising; the launcher never clears it.

Numerics (the same as kernels/layer_norm.cu's, so that the two normalize alike): two passes over the
token's sum e held in registers, the mean first, then the variance as the mean of (e - mean)^2, never
E[e^2] - E[e]^2; both sums are taken of e - e[r, 0] (the row's first element is the pivot). e[r, 0] is
computed with the same additions in the same order as every other element, so the pivot's own
difference is an exact 0. A row sum is: each thread sums its elements in order, a butterfly over the
warp (__shfl_xor_sync), and for versions 2 and 3 a sum of the block's warp sums in a fixed order
through shared memory. rstd is rsqrtf (2 ulp), 1/H a div.full (2 ulp).

Versions (the launcher, libnn/ops/embedding.py, picks one; all take the same parameters):

1) emb1_warp_{vec,sca}{1,2,4}_{f32,f16,bf16}, and emb1_warp_{vec,sca}8_f32
   One token per warp, 4 tokens per 128-thread block, the row in registers. Lane l holds VPT groups
   of V consecutive elements (V = 4 for fp32, 8 for fp16/bf16: 16 bytes), group j at columns
   (32 j + l) V ... (32 j + l) V + V - 1. No shared memory, no barrier. For H <= 32 VPT V, i.e. up to
   H = 1024 (BERT's 384, 768 and 1024 all run here).
2) emb2_block_vec{2,4,8}_*
   One token per block, the same register layout with blockDim.x threads (a multiple of 32, at most
   512; the launcher sizes the block to the row). For H <= blockDim.x VPT V: up to 16384 (fp32) and
   32768 (fp16/bf16). 16-byte accesses only.
3) emb3_loop_*
   One token per 512-thread block, any H and alignment, element-wise accesses; with normalization,
   three strided passes (sum, squared deviations, output) that gather the rows again each time (they
   are in L1/L2 by then). The fallback for rows longer than 1024 that version 2 cannot take 16 bytes
   at a time, or longer than it holds.

vec: 16-byte loads of the table rows, w and b and 16-byte stores of y; the launcher picks it only when
H % V == 0 (so every row starts on a 16-byte boundary) and every table and vector pointer is 16-byte
aligned. sca: the same groups element by element with a bounds check each (any H, any alignment).

LAUNCH (every kernel takes the same parameters)
    (const void* ids, const void* type_ids, const T* word, const T* pos, const T* type, const T* w,
     const T* b, T* y, long long M, int S, int H, long long rows, long long pos_rows,
     long long pos_offset, long long type_rows, int flags, float eps, unsigned long long* bad)
    T = float (f32) or unsigned short (f16/bf16 bits); type_ids, pos, type, w, b and bad may be null.
    flags: bit 0 ids are int64 (else int32), bit 1 type_ids are int64, bit 2 normalize.

    kernel         block                                                   grid
    emb1_warp_*    (128, 1, 1)                                             min(ceil(M / 4), 65535)
    emb2_block_*   (32 ceil(ceil(H / (VPT V)) / 32), 1, 1), at most 512    min(M, 65535)
    emb3_loop_*    (512, 1, 1)                                             min(M, 65535)

    Tokens are grid-strided: any grid >= 1 is correct. Preconditions: M >= 0, S >= 1, 1 <= H < 2^31,
    rows, pos_rows, type_rows >= 0 (a table of 0 rows gives NaN rows), eps > 0, y overlaps no input.
*/

#include "row_norm.cuh"

namespace embk {

using namespace libnn;

enum : int { IDS_I64 = 1, TYPES_I64 = 2, NORMALIZE = 4 };

__device__ __forceinline__ i64 load_index(const void* a, i64 i, bool wide) {
    return wide ? static_cast<const i64*>(a)[i] : (i64) static_cast<const int*>(a)[i];
}

// The table rows of token r at position s of its sequence (pr, tr null where the table is absent);
// false, with no row read, when an index is out of its table's range.
template <class DT>
__device__ __forceinline__ bool token_rows(const void* ids, const void* type_ids, const typename DT::T* word,
                                           const typename DT::T* pos, const typename DT::T* type, i64 r, int s,
                                           int H, i64 rows, i64 pos_rows, i64 pos_offset, i64 type_rows, int flags,
                                           const typename DT::T*& wr, const typename DT::T*& pr,
                                           const typename DT::T*& tr) {
    const i64 id = load_index(ids, r, flags & IDS_I64);
    const i64 p = pos_offset + s;
    const i64 t = type_ids ? load_index(type_ids, r, flags & TYPES_I64) : 0;
    if (id < 0 || id >= rows || (pos && (p < 0 || p >= pos_rows)) || (type && (t < 0 || t >= type_rows)))
        return false;
    wr = word + id * H;
    pr = pos ? pos + p * H : nullptr;
    tr = type ? type + t * H : nullptr;
    return true;
}

// e at column c: word + position + type, added in this order in fp32 (the pivot is computed the same way)
template <class DT>
__device__ __forceinline__ float e_at(const typename DT::T* wr, const typename DT::T* pr, const typename DT::T* tr,
                                      i64 c) {
    float e = DT::ld(wr[c]);
    if (pr) e += DT::ld(pr[c]);
    if (tr) e += DT::ld(tr[c]);
    return e;
}

template <class DT>
__device__ __forceinline__ typename DT::T nan_value() {
    return DT::st(u32_as_f32(0x7fc00000u));
}

#define EMB_PARAMS(T)                                                                                  \
    const void* __restrict__ ids, const void* __restrict__ type_ids, const T* __restrict__ word,        \
        const T* __restrict__ pos, const T* __restrict__ type, const T* __restrict__ w,                 \
        const T* __restrict__ b, T* __restrict__ y, long long M, int S, int H, long long rows,    \
        long long pos_rows, long long pos_offset, long long type_rows, int flags, float eps,            \
        unsigned long long* __restrict__ bad
#define EMB_ARGS ids, type_ids, word, pos, type, w, b, y, M, S, H, rows, pos_rows, pos_offset, type_rows, flags, eps, bad

// ---------------------------------------------------------------------------------------------------
// 1) and 2): the token's row in registers, VPT groups of V elements per thread
template <class DT, int VPT, bool VEC, bool ROW_IS_BLOCK>
__device__ __forceinline__ void emb_registers(EMB_PARAMS(typename DT::T)) {
    typedef typename DT::T T;
    constexpr int V = DT::V;
    __shared__ float red[16];
    const RowThread<ROW_IS_BLOCK> me;
    const int threads = me.threads, t = me.t, rows_per_block = me.rows_per_block;
    const i64 first = me.first;
    const int stride = (int)gridDim.x * rows_per_block;
    const bool normalize = flags & NORMALIZE;
    const float inv_h = fdiv_full(1.f, (float)H);
    // r % S is followed by steps: a 64-bit remainder per token would be a call to a division routine
    // (which made ptxas spill around it); first and stride are below 2^31, so these are 32-bit
    const int step = stride % S;
    int s_pos = (int)first % S;
    for (i64 r = first; r < M; r += stride, s_pos = s_pos >= S - step ? s_pos - (S - step) : s_pos + step) {
        T* yr = y + r * H;
        const T *wr, *pr, *tr;
        // uniform over the token's warp or block: the barriers of row_sum are not split
        if (!token_rows<DT>(ids, type_ids, word, pos, type, r, s_pos, H, rows, pos_rows, pos_offset, type_rows,
                            flags, wr, pr, tr)) {
            for (int c = t; c < H; c += threads) yr[c] = nan_value<DT>();
            if (bad && t == 0) *bad = (unsigned long long)r + 1ull;
            continue;
        }
        const float pivot = normalize ? e_at<DT>(wr, pr, tr, 0) : 0.f;
        float v[VPT][V];  // e - pivot (e itself without normalization); 0 outside the row
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const int c = (j * threads + t) * V;
            if constexpr (VEC) {
                if (c < H) {
                    const Pack<DT> pw = *reinterpret_cast<const Pack<DT>*>(wr + c);
#pragma unroll
                    for (int e = 0; e < V; e++) v[j][e] = DT::ld(pw.e[e]);
                    if (pr) {
                        const Pack<DT> pp = *reinterpret_cast<const Pack<DT>*>(pr + c);
#pragma unroll
                        for (int e = 0; e < V; e++) v[j][e] += DT::ld(pp.e[e]);
                    }
                    if (tr) {
                        const Pack<DT> pt = *reinterpret_cast<const Pack<DT>*>(tr + c);
#pragma unroll
                        for (int e = 0; e < V; e++) v[j][e] += DT::ld(pt.e[e]);
                    }
#pragma unroll
                    for (int e = 0; e < V; e++) v[j][e] -= pivot;
                } else {
#pragma unroll
                    for (int e = 0; e < V; e++) v[j][e] = 0.f;
                }
            } else {
#pragma unroll
                for (int e = 0; e < V; e++) v[j][e] = c + e < H ? e_at<DT>(wr, pr, tr, c + e) - pivot : 0.f;
            }
#pragma unroll
            for (int e = 0; e < V; e++) s += v[j][e];
        }
        float mean = 0.f, rstd = 1.f;
        if (normalize) {  // uniform: flags are the launch's
            mean = row_sum<ROW_IS_BLOCK>(s, red) * inv_h;  // the mean of e - pivot
            rstd = row_rstd<VPT, V, ROW_IS_BLOCK>(v, mean, threads, t, H, inv_h, eps, red);
        }
#pragma unroll
        for (int j = 0; j < VPT; j++)
            store_group<DT, VEC>(v[j], normalize, mean, rstd, w, b, yr, (j * threads + t) * V, H);
    }
}

// ---------------------------------------------------------------------------------------------------
// 3) any H: strided passes over the gathered rows
template <class DT>
__device__ __forceinline__ void emb_loop(EMB_PARAMS(typename DT::T)) {
    typedef typename DT::T T;
    __shared__ float red[16];
    const bool normalize = flags & NORMALIZE;
    const float inv_h = fdiv_full(1.f, (float)H);
    const int step = (int)gridDim.x % S;  // r % S by steps, as in emb_registers
    int s_pos = (int)blockIdx.x % S;
    for (i64 r = blockIdx.x; r < M; r += gridDim.x, s_pos = s_pos >= S - step ? s_pos - (S - step) : s_pos + step) {
        T* yr = y + r * H;
        const T *wr, *pr, *tr;
        if (!token_rows<DT>(ids, type_ids, word, pos, type, r, s_pos, H, rows, pos_rows, pos_offset, type_rows,
                            flags, wr, pr, tr)) {
            for (i64 c = threadIdx.x; c < H; c += blockDim.x) yr[c] = nan_value<DT>();
            if (bad && threadIdx.x == 0) *bad = (unsigned long long)r + 1ull;
            continue;
        }
        if (!normalize) {
            for (i64 c = threadIdx.x; c < H; c += blockDim.x) yr[c] = DT::st(e_at<DT>(wr, pr, tr, c));
            continue;
        }
        const float pivot = e_at<DT>(wr, pr, tr, 0);
        float s = 0.f;
        for (i64 c = threadIdx.x; c < H; c += blockDim.x) s += e_at<DT>(wr, pr, tr, c) - pivot;
        normalize_row_loop<DT>([&](i64 c) { return e_at<DT>(wr, pr, tr, c); }, s, pivot, w, b, yr, H, inv_h, eps,
                               red);
    }
}

}  // namespace embk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
// (BOUNDS, 1): with the bound alone, NVRTC 13's ptxas spilled a few bytes at 56-64 registers, far below
// the bound's limit (emb1_warp_vec2_f16 and emb2_block_vec4_bf16 for sm_90); with one block per SM
// stated, none of the kernels spills.
#define EMB_REGISTERS(name, BOUNDS, DT, VPT, VEC, ROW_IS_BLOCK)                                        \
    extern "C" __global__ void __launch_bounds__(BOUNDS, 1) name(EMB_PARAMS(embk::DT::T)) {            \
        embk::emb_registers<embk::DT, VPT, VEC, ROW_IS_BLOCK>(EMB_ARGS);                               \
    }
#define EMB1(SUFFIX, DT, VPT)                                                                          \
    EMB_REGISTERS(emb1_warp_vec##VPT##_##SUFFIX, 128, DT, VPT, true, false)                            \
    EMB_REGISTERS(emb1_warp_sca##VPT##_##SUFFIX, 128, DT, VPT, false, false)
#define EMB2(SUFFIX, DT, VPT) EMB_REGISTERS(emb2_block_vec##VPT##_##SUFFIX, 512, DT, VPT, true, true)
#define EMB3(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(512) emb3_loop_##SUFFIX(EMB_PARAMS(embk::DT::T)) {    \
        embk::emb_loop<embk::DT>(EMB_ARGS);                                                            \
    }
ROW_KERNELS(EMB1, EMB2, EMB3)
