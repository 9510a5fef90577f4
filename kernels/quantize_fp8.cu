/*
FP8 (E4M3) quantisation of linear_fp8's activations: one scale for the whole tensor, computed on the GPU
and written to device memory, so that no value comes back to the host (the call can be captured in a
CUDA graph). Two kernels on the same stream: the first reduces max|x| per block, the second reduces those
partial maxima in every block, writes the scale and encodes x.

E4M3 ("E4M3FN" in OCP's FP8 specification, CUDA_R_8F_E4M3): 1 sign, 4 exponent (bias 7) and 3 mantissa
bits; no infinity; S.1111.111 is NaN; the largest finite value is 448 = 1.75 * 2^8, the smallest
subnormal 2^-9.

    amax = max |x| over the finite elements of x (0 where there is none)
    s    = amax / 448 (fp32, rounded to nearest), or 1 where that is not > 0 (x all zeros)
    q    = x / s (fp32, div.rn: the IEEE quotient, whatever NVRTC's flags)
    code = NaN (0x7f | sign) for NaN and +-inf (E4M3 has no infinity: the rows an inf touches come out NaN);
           else, with a = min(|q|, 448) (saturation: |q| <= 448 up to the rounding of s),
           E = clamp(floor(log2 a), -6, 8), r = rint(a * 2^(3 - E)) (round half to even, exact scaling),
           code = sign | (8E + 48 + r)
The last line is round-to-nearest-even onto E4M3's grid in one formula: r = 16 carries into the next
exponent by itself, and E = -6 covers the subnormals (r = rint(a * 2^9) in 0..8). libnn/ops/quantize_fp8.py's
encode_e4m3 computes the same, operation for operation, in NumPy: the two agree bit for bit
(tests/test_linear_fp8_gpu.py). x in fp16 or bf16 converts to fp32 exactly.

Everything is fp32 arithmetic without flush-to-zero (NVRTC's default; the scaling by 2^(3-E) is exact
also for subnormal fp32 inputs). No CUDA toolkit header is included (only libnn's kernels/common.cuh).

Kernels (T = unsigned short for f16/bf16 bits, float for f32):

1) fp8_amax_{f16,bf16,f32}(const T* x, float* partial, long long total)
   Grid-stride over x's `total` elements; block b writes the max |x| of the finite elements it read to
   partial[b] (0 if none).
   LAUNCH: block FP8_THREADS, grid min(ceil(total / FP8_THREADS), FP8_MAX_PARTIALS); total >= 1.

2) fp8_quantize_{f16,bf16,f32}(const T* x, unsigned char* q, float* scale, const float* partial,
                               int partials, long long total, int scale_count)
   Every block reduces partial[0 .. partials) to amax (a few loads per thread: partials <= FP8_MAX_PARTIALS),
   computes s; block 0 writes s to scale[0 .. scale_count) (scale_count > 1 where cuBLASLt's outer-vector
   scaling reads one scale per row of x: the same value M times); then grid-stride q[i] = code(x[i] / s).
   LAUNCH: block FP8_THREADS, grid min(ceil(total / FP8_THREADS), FP8_MAX_QUANT_BLOCKS); partials is the
   grid of kernel 1, scale_count >= 1.

Both kernels read one element per thread and step (2 or 4 bytes): memory-bound and not tuned; the
activations of one linear call are read twice and written once, in a quarter of their size.
*/
#include "common.cuh"
#include "fp8.cuh"

constexpr int FP8_THREADS = 256;             // threads per block, both kernels (the launch bound)
constexpr int FP8_MAX_PARTIALS = 512;        // blocks of kernel 1: what each block of kernel 2 reduces
constexpr int FP8_MAX_QUANT_BLOCKS = 1024;   // blocks of kernel 2 (grid-stride beyond)

namespace fp8q {

using namespace libnn;

template <class DT>
__device__ __forceinline__ void amax(const typename DT::T* __restrict__ x, float* __restrict__ partial, i64 total) {
    __shared__ float red[FP8_THREADS / 32];
    float m = 0.f;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        m = fmaxf(m, finite_abs(DT::ld(x[i])));
    m = block_max(m, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

template <class DT>
__device__ __forceinline__ void quantize(const typename DT::T* __restrict__ x, unsigned char* __restrict__ q,
                                         float* __restrict__ scale, const float* __restrict__ partial, int partials,
                                         i64 total, int scale_count) {
    __shared__ float red[FP8_THREADS / 32];
    float m = 0.f;
    for (int i = threadIdx.x; i < partials; i += blockDim.x) m = fmaxf(m, partial[i]);
    float s = div_rn(block_max(m, red), E4M3_MAX);
    if (!(s > 0.f)) s = 1.f;
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < scale_count; i += blockDim.x) scale[i] = s;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        q[i] = (unsigned char)e4m3_code(div_rn(DT::ld(x[i]), s));
}

}  // namespace fp8q

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define FP8_AMAX_PARAMS(T) const T* __restrict__ x, float* __restrict__ partial, long long total
#define FP8_QUANTIZE_PARAMS(T) const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, \
    const float* __restrict__ partial, int partials, long long total, int scale_count

#define FP8_KERNELS(SUFFIX, DT)                                                                          \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS) fp8_amax_##SUFFIX(FP8_AMAX_PARAMS(libnn::DT::T)) { \
        fp8q::amax<libnn::DT>(x, partial, total);                                                        \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS)                                            \
        fp8_quantize_##SUFFIX(FP8_QUANTIZE_PARAMS(libnn::DT::T)) {                                       \
        fp8q::quantize<libnn::DT>(x, q, scale, partial, partials, total, scale_count);                   \
    }

FP8_KERNELS(f16, dt_f16)
FP8_KERNELS(bf16, dt_bf16)
FP8_KERNELS(f32, dt_f32)
