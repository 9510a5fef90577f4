/*
Row argmax for inference, in the style of llm.c dev/cuda: a decoder's greedy next token, and the draw of the
Gumbel-max trick when it samples.

    x  (M, N) rows, element row stride ldx (>= N), last dimension contiguous
    y  (M,) int64: y[m] = the first n whose x[m, n] is the row's largest value, a NaN counting as larger
       than any number (NumPy's and CuPy's argmax: the first NaN of a row that has one)

The order "NaN above every number, then the larger value, then the lower index" is total, so the result is
one element whatever order the threads meet the elements in: the geometry changes no result. Values are
compared as fp32 (fp16 and bf16 convert exactly). I/O: x in fp16, bf16 (raw 16-bit words) or fp32, y int64.
It includes no CUDA toolkit header (only libnn's kernels/common.cuh); sm_80 or newer.

Version 1 (the only one; libnn/ops/argmax.py launches it):

1) argmax1_{f16,bf16,f32}   any N >= 1, any ldx >= N, x at any address that is a multiple of the element size
   One block of ARGMAX_THREADS threads per row (rows grid-strided over blockIdx.x). The row's 16-byte-aligned
   middle is read in 16-byte vectors, ARGMAX_UNROLL vectors a thread in flight before it compares any, the
   elements before it and after it one each by the first threads. Each thread
   keeps its best (value, index), meeting its elements in increasing index (so a later one wins only by
   being larger, or the first NaN); then a butterfly over each warp and warp 0 over the warps' bests, in the
   full order. One row is one SM's work: at batch 1 the compares of its 32000 elements, not the reads,
   set the time, hence the cheap per-element test and a block of 1024 threads.

LAUNCH
    (const T* x, long long* y, long long M, int N, long long ldx)
    T = float (f32) or unsigned short (f16/bf16 bits); N and ldx in elements.
    On sm_90 and newer it is launched with programmatic stream serialization: it waits (pdl_wait) for the
    kernel ahead (the logits' GEMM) before its work.

    kernel        block                  grid
    argmax1_*     (ARGMAX_THREADS, 1, 1) (min(M, 65535), 1, 1)

    Rows are grid-strided: any grid >= 1 is correct; the block must be ARGMAX_THREADS threads (the warps'
    shared bests). Preconditions: M >= 1, 1 <= N < 2^31 (the launcher sends longer rows to another path),
    ldx >= N, x element-aligned; element offsets are 64-bit.
*/

#include "common.cuh"

constexpr int ARGMAX_THREADS = 1024;  // threads per block, one block per row
constexpr int ARGMAX_UNROLL = 4;      // 16-byte vectors a thread has in flight before it compares
static_assert(ARGMAX_THREADS == 32 * 32, "warp 0 merges the warps' bests, one a lane");

namespace argmaxk {

using namespace libnn;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Whether (w, j) comes before (v, i) in the order of the file's comment: NaN first (the lower index among
// NaNs), then the larger value, then the lower index.
__device__ __forceinline__ bool beats(float w, int j, float v, int i) {
    const bool w_nan = w != w, v_nan = v != v;
    if (w_nan || v_nan) return w_nan && (!v_nan || j < i);
    return w > v || (w == v && j < i);
}

constexpr int NONE = 0x7fffffff;   // the index of a thread's best before it has seen an element

struct Best {
    float v;
    int i;
    // (w, j) from another thread's best: the full order
    __device__ __forceinline__ void merge(float w, int j) {
        if (beats(w, j, v, i)) { v = w; i = j; }
    }
    // the thread's own elements, met in increasing index j: a later one wins only by being larger, or by
    // being the first NaN (a few instructions an element, where merge's order costs a dozen)
    __device__ __forceinline__ void next(float w, int j) {
        if (w > v || (w != w && v == v) || i == NONE) { v = w; i = j; }
    }
};

template <class DT>
__device__ __forceinline__ void argmax_row(const typename DT::T* __restrict__ row, long long* __restrict__ out, int N,
                                           Best* warp_best) {
    using T = typename DT::T;
    constexpr int V = 16 / sizeof(T);
    Best best{neg_inf(), NONE};
    // elements before the first 16-byte boundary and after the last whole vector, one per thread, before and
    // after its vectors: each thread meets its elements in increasing index
    const int head = imin(N, (int)(((16 - ((unsigned long long)row & 15)) & 15) / sizeof(T)));
    const int vectors = (N - head) / V, tail = head + vectors * V;
    if ((int)threadIdx.x < head) best.next(DT::ld(row[threadIdx.x]), threadIdx.x);
    const uint4* middle = reinterpret_cast<const uint4*>(row + head);
    for (int base = threadIdx.x; base < vectors; base += ARGMAX_THREADS * ARGMAX_UNROLL) {
        uint4 pack[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int at = base + u * ARGMAX_THREADS;
            pack[u] = at < vectors ? middle[at] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int at = base + u * ARGMAX_THREADS;
            if (at >= vectors) break;
            const T* e = reinterpret_cast<const T*>(&pack[u]);
#pragma unroll
            for (int k = 0; k < V; k++) best.next(DT::ld(e[k]), head + at * V + k);
        }
    }
    // (N - tail, not tail + t < N: near N = 2^31 - 1 the sum would wrap past int)
    if ((int)threadIdx.x < N - tail) best.next(DT::ld(row[tail + threadIdx.x]), tail + threadIdx.x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best.merge(__shfl_xor_sync(0xffffffffu, best.v, o),
                                               __shfl_xor_sync(0xffffffffu, best.i, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();   // the previous row's bests are read
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (warp != 0) return;   // to the next row, whose first barrier waits for warp 0 here
    best = warp_best[lane];   // ARGMAX_THREADS / 32 = 32 warps: a best for each lane
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best.merge(__shfl_xor_sync(0xffffffffu, best.v, o),
                                               __shfl_xor_sync(0xffffffffu, best.i, o));
    if (lane == 0) *out = best.i;
}

}  // namespace argmaxk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define ARGMAX_PARAMS(T) const T* __restrict__ x, long long* __restrict__ y, long long M, int N, long long ldx

#define ARGMAX1(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax1_##SUFFIX(ARGMAX_PARAMS(libnn::DT::T)) { \
        __shared__ argmaxk::Best warp_best[ARGMAX_THREADS / 32];                                          \
        libnn::pdl_wait();   /* launched programmatically: x is the kernel ahead's output */              \
        for (long long m = blockIdx.x; m < M; m += gridDim.x)                                             \
            argmaxk::argmax_row<libnn::DT>(x + m * ldx, y + m, N, warp_best);                             \
    }

ARGMAX1(f16, dt_f16)
ARGMAX1(bf16, dt_bf16)
ARGMAX1(f32, dt_f32)
