/*
Element-wise epilogues applied in place after a library op that cannot fuse them. Memory-bound: one read
and one write of y; the per-channel vectors stay in L1/L2.

1) channel_epilogue_{f32,f16,bf16}: y = act(y * scale[k] + shift[k]), after cuDNN's convolution alone
   (when no engine supports the fused graph). One grid-stride pass, one element per thread and step;
   k = (i / inner) % K, where `inner` is 1 for channels-last (NHWC) tensors and P*Q for NCHW. scale and
   shift are fp32 and either may be null (1 and 0).

   LAUNCH: block 256, grid min(ceil(total / 256), 524280), any total; parameters
       (T* y, const float* scale, const float* shift, long long total, int K, long long inner, int act)

2) bias_act_rows_{none,relu,gelu,gelu_erf}_{f32,f16,bf16}: y = act(y + bias[n]) over a row-major (rows, N)
   y, after a GEMM whose epilogue has no such activation (linear's exact erf GELU on cuBLASLt, and on
   gemm.cu's fp32 kernel). bias is in y's dtype, or null. Math in fp32 (gelu_erf: v·normal_cdf(v), see
   kernels/common.cuh), rounded once. Where N is a multiple of 16 bytes' worth of elements (8 halves, 4
   floats) and y and bias are 16-byte aligned, each thread moves 16 bytes per load and store and keeps
   its column in a register, advanced by the grid stride mod N (no division in the loop); else a scalar
   grid-stride loop with a division per element. The kernel picks the path itself. The activation is
   compiled in, one kernel per activation: with the code as a run-time argument (versions up to the
   sixth session) the chain of tests on it ran per element, and the pass was measurably slower on the
   H100 (benchmarks/RESULTS.md, seventh session). Linear used to run channel_epilogue here:
   one 2-byte element per thread and step and a 64-bit division for its channel ran the BERT FFN's GELU
   far below copy bandwidth.

   LAUNCH: block 256, grid min(ceil(total / (256 * 16 / sizeof(T))), 32 * SMs) (grid-stride: enough
   blocks to fill every SM whatever the registers allow), any rows and N; parameters
       (T* y, const T* bias, long long total, int N)     total = rows * N
*/
#include "common.cuh"

using namespace libnn;

// 1) per-channel scale, shift and activation
template <class DT>
__device__ __forceinline__ void channel_epilogue(typename DT::T* y, const float* scale, const float* shift,
                                                 i64 total, int K, i64 inner, int act) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int k = (int)((i / inner) % K);
        float v = DT::ld(y[i]);
        if (scale) v *= scale[k];
        if (shift) v += shift[k];
        y[i] = DT::st(apply_act(v, act));
    }
}

#define CHANNEL_EPILOGUE(SUFFIX, DT)                                                                   \
    extern "C" __global__ void channel_epilogue_##SUFFIX(DT::T* y, const float* scale, const float* shift, \
                                                          i64 total, int K, i64 inner, int act) {       \
        channel_epilogue<DT>(y, scale, shift, total, K, inner, act);                                   \
    }
CHANNEL_EPILOGUE(f32, dt_f32)
CHANNEL_EPILOGUE(f16, dt_f16)
CHANNEL_EPILOGUE(bf16, dt_bf16)

// 2) bias + activation over rows, 16 bytes per access; the activation ACT compiled in
__device__ __forceinline__ u32 f32_as_u32(float f) {
    u32 u; asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f)); return u;
}

template <class DT, int ACT>
__device__ __forceinline__ void bias_act_rows(typename DT::T* __restrict__ y, const typename DT::T* __restrict__ bias,
                                              i64 total, int N) {
    typedef typename DT::T T;
    const auto act = [](float v) { return apply_act<1u << ACT>(v, ACT); };
    constexpr int V = DT::V;   // elements per 16 bytes
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    if (N % V == 0 && (((u64)y | (u64)bias) & 15) == 0) {
        u32x4* yv = reinterpret_cast<u32x4*>(y);
        const i64 vectors = total / V;
        int n = (int)((first * V) % N);                 // this thread's first column
        const int step = (int)((stride * V) % N);       // columns advanced per grid stride
        for (i64 i = first; i < vectors; i += stride) {
            const u32x4 v = yv[i];
            u32x4 b = {0u, 0u, 0u, 0u};
            if (bias) b = *reinterpret_cast<const u32x4*>(bias + n);
            u32 w[4] = {v.a, v.b, v.c, v.d};
            const u32 bw[4] = {b.a, b.b, b.c, b.d};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if constexpr (V == 4) {   // fp32: one element per word
                    w[j] = f32_as_u32(act(u32_as_f32(w[j]) + u32_as_f32(bw[j])));
                } else {                  // fp16/bf16: two per word, low half first
                    const float lo = DT::ld((T)(w[j] & 0xffffu)) + DT::ld((T)(bw[j] & 0xffffu));
                    const float hi = DT::ld((T)(w[j] >> 16)) + DT::ld((T)(bw[j] >> 16));
                    w[j] = pack_f32x2<DT::bf16 != 0>(act(lo), act(hi));
                }
            }
            u32x4 o;
            o.a = w[0]; o.b = w[1]; o.c = w[2]; o.d = w[3];
            yv[i] = o;
            n += step;
            if (n >= N) n -= N;
        }
        return;
    }
    for (i64 i = first; i < total; i += stride) {
        float v = DT::ld(y[i]);
        if (bias) v += DT::ld(bias[(int)(i % N)]);
        y[i] = DT::st(act(v));
    }
}

#define BIAS_ACT_ROWS(ACT_NAME, ACT, SUFFIX, DT)                                                        \
    extern "C" __global__ void bias_act_rows_##ACT_NAME##_##SUFFIX(DT::T* __restrict__ y,                 \
                                                                   const DT::T* __restrict__ bias, i64 total, int N) { \
        bias_act_rows<DT, ACT>(y, bias, total, N);                                                     \
    }
#define BIAS_ACT_ROWS_ALL(SUFFIX, DT)                                                                  \
    BIAS_ACT_ROWS(none, ACT_NONE, SUFFIX, DT)                                                          \
    BIAS_ACT_ROWS(relu, ACT_RELU, SUFFIX, DT)                                                          \
    BIAS_ACT_ROWS(gelu, ACT_GELU, SUFFIX, DT)                                                          \
    BIAS_ACT_ROWS(gelu_erf, ACT_GELU_ERF, SUFFIX, DT)
BIAS_ACT_ROWS_ALL(f32, dt_f32)
BIAS_ACT_ROWS_ALL(f16, dt_f16)
BIAS_ACT_ROWS_ALL(bf16, dt_bf16)
