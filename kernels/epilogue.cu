/*
Per-channel epilogue applied in place: y = act(y * scale[k] + shift[k]).

Used after a library op that cannot fuse it (cuDNN's convolution alone, when no engine supports the
fused graph). One grid-stride pass over y; k = (i / inner) % K, where `inner` is 1 for channels-last
(NHWC) tensors and P*Q for NCHW. scale and shift are fp32 and either may be null (1 and 0).
Memory-bound: one read and one write of y, the channel vectors stay in L1/L2.

LAUNCH: block 256, grid min(ceil(total / 256), 524280), any total; parameters
    (T* y, const float* scale, const float* shift, long long total, int K, long long inner, int act)
*/
#include "common.cuh"

using namespace libnn;

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
