/*
The rotation of one (token, head) row of RoPE, shared by kernels/rope.cu (rope) and kernels/kv_append.cu
(k rotated into a KV cache): the math, its precision and the two pair styles are described in rope.cu's
header. The threads of a block's x dimension split the row's items: its R / 2 rotation pairs, then its
D - R pass-through elements.
*/
#pragma once

#include "common.cuh"

namespace ropek {

using namespace libnn;

typedef libnn::dt_f16 f16;
typedef libnn::dt_bf16 bf16;
typedef libnn::dt_f32 f32;

__device__ __forceinline__ float to_float(int p) { return (float)p; }             // cvt.rn.f32.s32
__device__ __forceinline__ float to_float(long long p) { return (float)p; }       // cvt.rn.f32.s64

// y = the row x rotated at `position`; y may be x itself (a pair's two loads come before its two stores)
template <class DT>
__device__ __forceinline__ void rotate_row(const typename DT::T* x, typename DT::T* y, float position,
                                           const float* __restrict__ inv_freq, int D, int R, int interleaved) {
    const int half = R >> 1, items = half + (D - R);
    for (int j = threadIdx.x; j < items; j += blockDim.x) {
        if (j < half) {
            float sn, cs;
            sincosf(__fmul_rn(position, inv_freq[j]), &sn, &cs);
            const int j0 = interleaved ? 2 * j : j, j1 = interleaved ? 2 * j + 1 : j + half;
            const float a = DT::ld(x[j0]), c = DT::ld(x[j1]);
            y[j0] = DT::st(a * cs - c * sn);
            y[j1] = DT::st(c * cs + a * sn);
        } else {
            y[j + half] = x[j + half];  // element R + (j - half): passes through, bits unchanged
        }
    }
}

}  // namespace ropek
