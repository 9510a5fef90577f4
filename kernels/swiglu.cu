/*
SwiGLU, the gated activation of LLaMA's MLP, for inference, in the style of llm.c dev/cuda:

    x  (M, 2F) rows, element row stride ldx (>= 2F), last dimension contiguous: one gate_up GEMM's
       output, gate in columns 0..F-1 and up in columns F..2F-1 of each row (Hugging Face's
       gate_proj and up_proj weights concatenated in that order)
    y  (M, F), C-contiguous
    y[m, f] = silu(x[m, f]) * x[m, F + f],   silu(v) = v / (1 + exp(-v))

Math in fp32, rounded once to T: silu is common.cuh's (apply_act with ACT_SILU: expf, accurate to a
few ulp, not the __expf intrinsic, and the division by div.full.f32, 2 ulp over the full range, so
that v far below 0 gives v / inf = -0 rather than NaN), the product one more rounding; about 1e-7
relative in fp32. NaN propagates; silu(-inf) is -inf / inf = NaN, as PyTorch's x * sigmoid(x) gives.
I/O in fp16, bf16 (raw 16-bit words, converted with PTX) or fp32. It includes no CUDA toolkit header
(only libnn's kernels/common.cuh); sm_80 or newer (cvt.rn.bf16.f32).

Memory-bound: each output element reads two inputs and writes one, 3 x sizeof(T) bytes. Rows and
columns are walked in two grid-strided loops (rows over blockIdx.y and threadIdx.y, columns over
blockIdx.x and threadIdx.x), so that no index is divided and short rows (F = 1, 7) still fill a block.

Versions (libnn/ops/swiglu.py picks one per bound call, from F, the row stride and the pointers'
alignment, which are part of its signature):

1) swiglu1_scalar_{f16,bf16,f32}   any F >= 1, any ldx, any alignment
   One element per thread and step: a gate, an up, an output.
2) swiglu2_vec_{f16,bf16,f32}      F and ldx multiples of V = 16 / sizeof(T) (8 halves, 4 floats),
                                   x and y 16-byte aligned
   One 16-byte vector per thread and step: V gates and V ups in two 16-byte loads, V outputs in one
   16-byte store. Columns count vectors (F / V of them per row).

LAUNCH (every kernel takes the same parameters)
    (const T* x, T* y, long long M, int F, long long ldx)
    T = float (f32) or unsigned short (f16/bf16 bits); F and ldx in elements.
    On sm_90 and newer it is launched with programmatic stream serialization: it waits (pdl_wait) for the
    kernel ahead before its work, and lets the kernel after it start (pdl_launch_dependents).

    cols = F (swiglu1) or F / V (swiglu2) per row
    kernel        block                                      grid
    swiglu*       (BX, BY, 1)                                (min(ceil(cols / BX), 65535), min(ceil(M / BY), 65535), 1)
                  BX = min(SWIGLU_THREADS, max(32, power of 2 >= cols))
                  BY = SWIGLU_THREADS / BX

    Rows and columns are grid-strided: any grid >= 1 and any block up to SWIGLU_THREADS threads are
    correct. Preconditions: M >= 1, 1 <= F < 2^31, ldx >= 2F; x and y do not overlap; element offsets
    are 64-bit. swiglu2 also needs the divisibility and alignment above (the launcher checks them).
*/

#include "common.cuh"

constexpr int SWIGLU_THREADS = 256;  // threads per block: the launch bound

namespace swigluk {

using namespace libnn;

__device__ __forceinline__ float silu_times(float gate, float up) {
    return apply_act<1u << ACT_SILU>(gate, ACT_SILU) * up;
}

// 1) one element per thread and step
template <class DT>
__device__ __forceinline__ void swiglu_scalar(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                              i64 M, int F, i64 ldx) {
    for (i64 m = (i64)blockIdx.y * blockDim.y + threadIdx.y; m < M; m += (i64)gridDim.y * blockDim.y) {
        const typename DT::T* row = x + m * ldx;
        typename DT::T* out = y + m * F;
        for (i64 f = (i64)blockIdx.x * blockDim.x + threadIdx.x; f < F; f += (i64)gridDim.x * blockDim.x)
            out[f] = DT::st(silu_times(DT::ld(row[f]), DT::ld(row[F + f])));
    }
}

__device__ __forceinline__ u32 f32_bits(float f) {
    u32 u; asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f)); return u;
}

// one 32-bit word of outputs from a word of gates and a word of ups: one fp32, or two packed halves
// (low half first)
template <class DT>
__device__ __forceinline__ u32 word(u32 g, u32 u) {
    typedef typename DT::T T;
    if constexpr (DT::V == 4) {
        return f32_bits(silu_times(u32_as_f32(g), u32_as_f32(u)));
    } else {
        const float lo = silu_times(DT::ld((T)(g & 0xffffu)), DT::ld((T)(u & 0xffffu)));
        const float hi = silu_times(DT::ld((T)(g >> 16)), DT::ld((T)(u >> 16)));
        return pack_f32x2<DT::bf16 != 0>(lo, hi);
    }
}

// 2) one 16-byte vector per thread and step
template <class DT>
__device__ __forceinline__ void swiglu_vec(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                           i64 M, int F, i64 ldx) {
    constexpr int V = DT::V;
    const int cols = F / V;
    for (i64 m = (i64)blockIdx.y * blockDim.y + threadIdx.y; m < M; m += (i64)gridDim.y * blockDim.y) {
        const u32x4* gate = reinterpret_cast<const u32x4*>(x + m * ldx);
        const u32x4* up = gate + cols;
        u32x4* out = reinterpret_cast<u32x4*>(y + m * F);
        for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += (i64)gridDim.x * blockDim.x) {
            const u32x4 g = gate[c], u = up[c];
            u32x4 o;
            o.a = word<DT>(g.a, u.a);
            o.b = word<DT>(g.b, u.b);
            o.c = word<DT>(g.c, u.c);
            o.d = word<DT>(g.d, u.d);
            out[c] = o;
        }
    }
}

}  // namespace swigluk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define SWIGLU_PARAMS(T) const T* __restrict__ x, T* __restrict__ y, long long M, int F, long long ldx

#define SWIGLU(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(SWIGLU_THREADS)                                         \
        swiglu1_scalar_##SUFFIX(SWIGLU_PARAMS(libnn::DT::T)) {                                           \
        libnn::pdl_launch_dependents();   /* the down projection's GEMV streams its weight meanwhile */  \
        libnn::pdl_wait();                /* launched programmatically after a GEMV: x is its output */  \
        swigluk::swiglu_scalar<libnn::DT>(x, y, M, F, ldx);                                              \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(SWIGLU_THREADS)                                         \
        swiglu2_vec_##SUFFIX(SWIGLU_PARAMS(libnn::DT::T)) {                                              \
        libnn::pdl_launch_dependents();                                                                  \
        libnn::pdl_wait();                                                                               \
        swigluk::swiglu_vec<libnn::DT>(x, y, M, F, ldx);                                                 \
    }

SWIGLU(f16, dt_f16)
SWIGLU(bf16, dt_bf16)
SWIGLU(f32, dt_f32)
