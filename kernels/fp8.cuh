/*
E4M3 (FP8) helpers shared by kernels/quantize_fp8.cu (the activations' quantiser) and kernels/linear_fp8.cu
(the FP8 GEMM and GEMV, which decode codes and, in the GEMV, quantise x themselves): the encoding that
quantize_fp8.cu's opening comment specifies (and libnn/ops/quantize_fp8.py's encode_e4m3 mirrors bit for
bit), the exact decoding, and a block's maximum. fp32 arithmetic without flush-to-zero; no toolkit header.
*/
#pragma once

#include "common.cuh"

namespace libnn {

constexpr float E4M3_MAX = 448.f;
constexpr float F32_MAX = 3.4028234663852886e38f;

__device__ __forceinline__ u32 bits_of(float f) {
    u32 u; asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f)); return u;
}
__device__ __forceinline__ float div_rn(float a, float b) {
    float d; asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d;
}
// round to the nearest integer, half to even
__device__ __forceinline__ float rint_even(float a) {
    float r; asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
}

// |v| if finite, else 0: NaN and inf take no part in the scale
__device__ __forceinline__ float finite_abs(float v) {
    const float a = fabsf(v);
    return a <= F32_MAX ? a : 0.f;
}

// the E4M3 code of q (kernels/quantize_fp8.cu's opening comment)
__device__ __forceinline__ u32 e4m3_code(float q) {
    const u32 sign = (bits_of(q) >> 24) & 0x80u;
    float a = fabsf(q);
    if (!(a <= F32_MAX)) return sign | 0x7fu;
    a = fminf(a, E4M3_MAX);
    const int E = imin(8, imax(-6, (int)(bits_of(a) >> 23) - 127));
    const float r = rint_even(a * u32_as_f32((u32)(130 - E) << 23));   // a * 2^(3 - E), exact
    return sign | (u32)(8 * E + 48 + (int)r);
}

// v / d rounded to nearest, given r = div_rn(1, d), for d >= 2^-100 and finite v: Newton's correction of v·r
// once (within an ulp of v / d after it), then Markstein's (correctly rounded from there; each residual is
// exact by FMA). A quotient small enough for its residual to underflow is far below E4M3's smallest value,
// whose code is then 0 (with v's sign) however it rounds.
__device__ __forceinline__ float div_by_reciprocal(float v, float d, float r) {
    float q = v * r;
    q = fmaf(fmaf(-q, d, v), r, q);
    return fmaf(fmaf(-q, d, v), r, q);
}

// e4m3_code of two finite values, hi in the upper byte: the hardware's conversion on sm_89+ (round to
// nearest even, saturating at 448: the same codes, tests/test_linear_fp8_gpu.py), e4m3_code below that
__device__ __forceinline__ u32 e4m3x2_code(float lo, float hi);

// max of v over the block (every thread gets it); `red` holds blockDim.x / 32 floats, and is read by
// every thread after: a second call needs a __syncthreads() before it
__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); i++) v = fmaxf(v, red[i]);
    return v;
}

// the value of E4M3 code c: exact in fp32
__device__ __forceinline__ float e4m3_value(u32 c) {
    const u32 e = (c >> 3) & 15u, m = c & 7u;
    float v;
    if (e == 0u) v = (float)m * 0.001953125f;                 // subnormal: m * 2^-9
    else if (e == 15u && m == 7u) v = u32_as_f32(0x7fc00000u);  // NaN
    else v = u32_as_f32(((e + 120u) << 23) | (m << 20));      // (1 + m/8) * 2^(e - 7)
    return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ u32 e4m3x2_code(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    u16 h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(hi), "f"(lo));
    return h;
#else
    return e4m3_code(lo) | e4m3_code(hi) << 8;
#endif
}

}  // namespace libnn
