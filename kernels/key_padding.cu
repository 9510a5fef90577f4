/*
Key padding from a padding mask, in one launch: what the attention op takes for a (B, S) mask (sequence
lengths and a bias for the holes) and the boolean mask the layers around it read. libnn/nn/functional.py
key_padding_and_tokens launches it while a CUDA graph is captured, where nothing can be read back and a
replay may bring any mask (outside a capture it decides on the host, with one read-back, what it needs).

    mask    (B, S) integers, C-contiguous, read as words of their own size (1 byte: bool, int8, uint8;
            2, 4 or 8 bytes: the wider integers), nonzero at a token; never converted first
    valid   (B, S) bool (bytes 0 / 1), C-contiguous, or null: not written (a bool mask is its own)
    lengths (B,) int32
    bias    (B, S) words of the bias dtype's size (2 bytes: fp16, bf16; 4: fp32; 8: fp64), C-contiguous,
            written as raw bits: `minus_inf` (its low bytes: that dtype's -inf) or +0

    last[b]    = the position of row b's last token, -1 for a row with none
    valid[b,j] = mask[b,j] != 0
    lengths[b] = max(last[b] + 1, min_length)      min_length 0: the true lengths; 1: never 0
    bias[b,j]  = -inf where j < last[b] and mask[b,j] == 0 (a hole before the row's last token), else +0

The bias is -inf only before the TRUE last token, so it never masks the last key the lengths leave a
row: with min_length = 1 a row without tokens keeps length 1 and an all-zero bias row, and attends to
its first position (a finite row where the attention op would otherwise return zeros and look for the
rows to zero after every layer: the encoder's choice, see libnn/models/bert.py).

Versions:

1) key_padding_mask{8,16,32,64}_bias{16,32,64}   (the mask's and the bias's word size in bits)
   One warp per row, KP_THREADS / 32 rows per block. Pass 1 walks the row 32 positions at a time, one
   per lane (a warp's load is 32 consecutive words), writes valid and keeps the last token from each
   step's __ballot_sync (its highest set bit); pass 2 reads the row again (in cache: the warp read it
   just before) and writes the bias once `last` is known. Replaces a thread per row reading its S
   flags one after another (latency bound), a second kernel for the holes and the `mask != 0` pass the
   caller ran first (timings of both: benchmarks/RESULTS.md, eleventh session).

LAUNCH (every kernel takes the same parameters)
    (const M* mask, unsigned char* valid, int* lengths, W* bias, long long B, int S, int min_length,
     unsigned long long minus_inf)
    M = unsigned char, unsigned short, unsigned int or unsigned long long (the mask's word);
    W = unsigned short, unsigned int or unsigned long long (the bias's word). valid may be null.

    kernel           block                 grid
    key_padding_*    (KP_THREADS, 1, 1)    ceil(B / (KP_THREADS / 32))

    Every row needs its warp (a missing block leaves rows unwritten). Preconditions: B >= 1,
    1 <= S <= 2^31 - 32 (positions step by 32 in int), ceil(B / (KP_THREADS / 32)) < 2^31; min_length 0 or
    1; no output overlaps the mask or another output; row offsets are 64-bit.
*/

#include "common.cuh"

constexpr int KP_THREADS = 128;  // threads per block: 4 rows

namespace kpk {

using namespace libnn;

template <class M, class W>
__device__ __forceinline__ void key_padding(const M* __restrict__ mask, unsigned char* __restrict__ valid,
                                            int* __restrict__ lengths, W* __restrict__ bias, i64 B, int S,
                                            int min_length, u64 minus_inf) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (KP_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= B) return;  // a whole warp: the ballots below see all 32 lanes
    const M* m = mask + row * S;
    int last = -1;
#pragma unroll 4
    for (int j0 = 0; j0 < S; j0 += 32) {
        const int j = j0 + lane;
        const bool token = j < S && m[j] != 0;
        const u32 tokens = __ballot_sync(0xffffffffu, token);
        if (tokens) last = j0 + 31 - __clz((int)tokens);
        if (valid && j < S) valid[row * S + j] = token;
    }
    if (lane == 0) lengths[row] = imax(last + 1, min_length);
    W* out = bias + row * S;
    const W hole = (W)minus_inf;
#pragma unroll 4
    for (int j = lane; j < S; j += 32) out[j] = (j < last && m[j] == 0) ? hole : (W)0;
}

}  // namespace kpk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define KP_PARAMS(M, W)                                                                                 \
    const M* __restrict__ mask, unsigned char* __restrict__ valid, int* __restrict__ lengths,           \
        W* __restrict__ bias, long long B, int S, int min_length, unsigned long long minus_inf

#define KP(MBITS, M, WBITS, W)                                                                          \
    extern "C" __global__ void __launch_bounds__(KP_THREADS)                                            \
        key_padding_mask##MBITS##_bias##WBITS(KP_PARAMS(M, W)) {                                        \
        kpk::key_padding<M, W>(mask, valid, lengths, bias, B, S, min_length, minus_inf);                \
    }
#define KP_BIASES(MBITS, M)                                                                             \
    KP(MBITS, M, 16, unsigned short)                                                                    \
    KP(MBITS, M, 32, unsigned int)                                                                      \
    KP(MBITS, M, 64, unsigned long long)

KP_BIASES(8, unsigned char)
KP_BIASES(16, unsigned short)
KP_BIASES(32, unsigned int)
KP_BIASES(64, unsigned long long)
