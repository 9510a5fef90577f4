/*
Kernels for 2-D max and average pooling (inference), in the style of llm.c dev/cuda. cuDNN's graph API
has no pooling node, so these are the GPU path.

    x (N, H, W, C)   any layout: element strides (sxn, sxh, sxw, sxc) (NHWC, NCHW, ...)
    y (N, P, Q, C)   any layout: element strides (syn, syh, syw, syc)

    window of output (p, q): rows h = p*stride_h - pad_h + [0, kh), columns w = q*stride_w - pad_w + [0, kw)
    max: y = max over the window's in-image elements (padded positions are ignored, i.e. -inf). NaN
         propagates: y is NaN if any element of the window is NaN (PyTorch semantics). A window with no
         in-image element gives -inf.
    avg: y = (sum over the window's in-image elements) / divisor, in fp32, rounded once. PyTorch's
         avg_pool2d: hend = min(h0 + kh, H + pad_h), wend likewise, pool_size = (hend-h0)*(wend-w0)
         (the window clipped to the padded image), divisor = pool_size when count_include_pad != 0
         (PyTorch's default), else the number of in-image elements (0/0 = NaN if there are none, which
         PyTorch's shape rules never produce). divisor_override is not supported.

P and Q are the caller's (floor or ceil mode is the caller's choice). fp16/bf16 are passed as raw 16-bit
storage (unsigned short); max compares values exactly (the result is one of the inputs, or NaN, or -inf).

It includes no CUDA toolkit header (only libnn's kernels/common.cuh) so that NVRTC from any pip wheel
compiles it without a CUDA toolkit; conversions and the NaN-propagating max are inline PTX. It needs sm_80 or newer
(cvt.rn.bf16.f32, max.NaN). Compiled by libnn with -Xptxas=-v -I kernels/ -arch=sm_80 or sm_90.

Versions:

1) maxpool_{f32,f16,bf16}, avgpool_{f32,f16,bf16}
   One template, the mode a template parameter. One thread per output element, any strides for x and y.
   blockIdx.y (and a loop) walks the images; the threads of a grid row walk one image's P*Q*C outputs
   (32-bit index math) with c fastest when sxc <= sxw (NHWC: the warp reads contiguous channels),
   otherwise q fastest (NCHW). Sums and the max are taken in fp32 (exact for the max).

2) maxpool_nhwc_vec_{f16,bf16,f32}
   A thread handles V consecutive channels (V = 8 for fp16/bf16, 4 for fp32: 16 bytes) of one output
   pixel; the threads of a grid row walk one image's (pixel, channel group) pairs, group fastest. When
   the kernel sees (itself, uniform branch) C % V == 0, sxc == syc == 1, the other strides multiples of
   V and x, y 16-byte aligned, every window element is one 16-byte load and the max is taken on the
   packed values (max.NaN.f16x2 / .bf16x2 / .f32, which propagate NaN), the result one 16-byte store;
   otherwise guarded scalar accesses with maxpool_*'s semantics (correct for any strides).

LAUNCH (all kernels take the same parameters, in this order, no extra ones):
    (const T* x, T* y, int N, int H, int W, int C, int P, int Q, int kh, int kw,
     int stride_h, int stride_w, int pad_h, int pad_w, int count_include_pad,
     long long sxn, long long sxh, long long sxw, long long sxc,
     long long syn, long long syh, long long syw, long long syc)
    T = float (f32) or unsigned short (f16/bf16 bits); strides are in elements. count_include_pad is
    read by avgpool_* only (the max kernels ignore it).

    kernel                 block        grid                                              dynamic smem
    maxpool_*, avgpool_*   (256, 1, 1)  (ceil(P*Q*C / 256), min(N, 65535), 1)             0
    maxpool_nhwc_vec_*     (256, 1, 1)  (ceil(P*Q*ceil(C/V) / 256), min(N, 65535), 1)     0
                                         V = 8 (f16/bf16), 4 (f32)
    Both loop over their work (grid-stride within an image, grid.y-stride over images), so any
    grid.x, grid.y >= 1 is correct (capping them is fine).
    Preconditions: every size >= 1, window strides >= 1, pads >= 0, P*Q*C < 2^31 (element offsets are
    64-bit), y does not alias x. The launcher checks no layout: maxpool_nhwc_vec_* picks its 16-byte
    path itself.
*/

#include "common.cuh"

namespace pk {

using namespace libnn;

// The scalar sizes and strides every kernel gets (copied out of the kernel parameters once).
struct Shape {
    int N, H, W, C, P, Q, kh, kw, sh, sw, ph, pw, cip;
    i64 sxn, sxh, sxw, sxc, syn, syh, syw, syc;
};

// The in-image part [h0, h1) x [w0, w1) of output (p, q)'s window (empty when h1 <= h0 or w1 <= w0).
struct Window { int hs, ws, h0, h1, w0, w1; };
__device__ __forceinline__ Window window(const Shape& s, int p, int q) {
    Window wd;
    wd.hs = p * s.sh - s.ph;
    wd.ws = q * s.sw - s.pw;
    wd.h0 = imax(wd.hs, 0); wd.h1 = imin(wd.hs + s.kh, s.H);
    wd.w0 = imax(wd.ws, 0); wd.w1 = imin(wd.ws + s.kw, s.W);
    return wd;
}

// the one max update both versions use on unpacked values: NaN sticks (v > NaN and NaN != NaN are false)
__device__ __forceinline__ float max_nan(float m, float v) { return (v > m || v != v) ? v : m; }

// ---------------------------------------------------------------------------------------------------
// 1) any layout, one thread per output element
template <class DT, bool MAX>
__device__ __forceinline__ void pool1_body(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                           const Shape& s) {
    typedef typename DT::T T;
    const int PQC = s.P * s.Q * s.C;             // outputs per image: 32-bit index math
    const bool cfast = s.sxc <= s.sxw;
    for (int n = blockIdx.y; n < s.N; n += gridDim.y) {
        for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < PQC; idx += gridDim.x * blockDim.x) {
            int p, q, c;
            unflatten_pqc(idx, s.P, s.Q, s.C, cfast, p, q, c);
            const Window wd = window(s, p, q);
            const T* xc = x + ((i64)n * s.sxn + (i64)c * s.sxc);
            float out;
            if constexpr (MAX) {
                float m = u32_as_f32(dt_f32::NINF);
                for (int h = wd.h0; h < wd.h1; h++)
                    for (int v = wd.w0; v < wd.w1; v++) m = max_nan(m, DT::ld(xc[(i64)h * s.sxh + (i64)v * s.sxw]));
                out = m;
            } else {
                float sum = 0.f;
                for (int h = wd.h0; h < wd.h1; h++)
                    for (int v = wd.w0; v < wd.w1; v++) sum += DT::ld(xc[(i64)h * s.sxh + (i64)v * s.sxw]);
                int div;
                if (s.cip) div = (imin(wd.hs + s.kh, s.H + s.ph) - wd.hs) * (imin(wd.ws + s.kw, s.W + s.pw) - wd.ws);
                else div = imax(wd.h1 - wd.h0, 0) * imax(wd.w1 - wd.w0, 0);
                out = sum / (float)div;
            }
            y[(i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw + (i64)c * s.syc] = DT::st(out);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 2) NHWC max pooling, V channels per thread, 16-byte accesses when the layout allows
template <class DT, bool VEC>
__device__ __forceinline__ void pool2_body(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                           const Shape& s) {
    typedef typename DT::T T;
    constexpr int V = DT::V;
    const int CG = (s.C + V - 1) / V;
    const int PQG = s.P * s.Q * CG;              // work items per image: 32-bit index math
    for (int n = blockIdx.y; n < s.N; n += gridDim.y) {
        for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < PQG; idx += gridDim.x * blockDim.x) {
            const int pq = idx / CG, cg = idx - pq * CG;
            const int p = pq / s.Q, q = pq - p * s.Q;
            const int c0 = cg * V;
            const Window wd = window(s, p, q);
            const T* xb = x + ((i64)n * s.sxn + (i64)c0 * s.sxc);
            T* yb = y + ((i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw + (i64)c0 * s.syc);
            if constexpr (VEC) {
                u32x4 m;
                m.a = m.b = m.c = m.d = DT::NINF;
                for (int h = wd.h0; h < wd.h1; h++) {
                    const T* xr = xb + (i64)h * s.sxh;
                    for (int v = wd.w0; v < wd.w1; v++) {
                        const u32x4 e = *reinterpret_cast<const u32x4*>(xr + (i64)v * s.sxw);
                        m.a = DT::vmax(m.a, e.a); m.b = DT::vmax(m.b, e.b);
                        m.c = DT::vmax(m.c, e.c); m.d = DT::vmax(m.d, e.d);
                    }
                }
                *reinterpret_cast<u32x4*>(yb) = m;
            } else {   // any strides / C: one channel at a time (keeps registers low)
                const int cnt = imin(s.C - c0, V);
#pragma unroll 1
                for (int j = 0; j < cnt; j++) {
                    const T* xc = xb + (i64)j * s.sxc;
                    float m = u32_as_f32(dt_f32::NINF);
                    for (int h = wd.h0; h < wd.h1; h++)
                        for (int v = wd.w0; v < wd.w1; v++) m = max_nan(m, DT::ld(xc[(i64)h * s.sxh + (i64)v * s.sxw]));
                    yb[(i64)j * s.syc] = DT::st(m);
                }
            }
        }
    }
}

template <class DT>
__device__ __forceinline__ void pool2_entry(const typename DT::T* __restrict__ x, typename DT::T* __restrict__ y,
                                            const Shape& s) {
    constexpr int V = DT::V;
    const bool vec = s.C % V == 0 && s.sxc == 1 && s.syc == 1 &&
                     ((s.sxn | s.sxh | s.sxw | s.syn | s.syh | s.syw) & (V - 1)) == 0 &&
                     (((u64)x | (u64)y) & 15) == 0;
    if (vec) pool2_body<DT, true>(x, y, s);
    else pool2_body<DT, false>(x, y, s);
}

}  // namespace pk

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define POOL_PARAMS(T)                                                                                      \
    const T* __restrict__ x, T* __restrict__ y, int N, int H, int W, int C, int P, int Q, int kh, int kw,   \
    int stride_h, int stride_w, int pad_h, int pad_w, int count_include_pad, long long sxn, long long sxh,  \
    long long sxw, long long sxc, long long syn, long long syh, long long syw, long long syc
#define POOL_SHAPE                                                                                          \
    const pk::Shape s = {N, H, W, C, P, Q, kh, kw, stride_h, stride_w, pad_h, pad_w, count_include_pad,     \
                         sxn, sxh, sxw, sxc, syn, syh, syw, syc}

#define POOL1(name, DT, MAX)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) name(POOL_PARAMS(pk::DT::T)) {                        \
        POOL_SHAPE;                                                                                         \
        pk::pool1_body<pk::DT, MAX>(x, y, s);                                                               \
    }
POOL1(maxpool_f32, dt_f32, true)
POOL1(maxpool_f16, dt_f16, true)
POOL1(maxpool_bf16, dt_bf16, true)
POOL1(avgpool_f32, dt_f32, false)
POOL1(avgpool_f16, dt_f16, false)
POOL1(avgpool_bf16, dt_bf16, false)

#define POOL2(name, DT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 4) name(POOL_PARAMS(pk::DT::T)) {                     \
        POOL_SHAPE;                                                                                         \
        pk::pool2_entry<pk::DT>(x, y, s);                                                                   \
    }
POOL2(maxpool_nhwc_vec_f16, dt_f16)
POOL2(maxpool_nhwc_vec_bf16, dt_bf16)
POOL2(maxpool_nhwc_vec_f32, dt_f32)
