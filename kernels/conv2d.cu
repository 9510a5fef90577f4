/*
Kernels for a 2-D convolution's forward pass (inference) with a fused per-output-channel epilogue, in the
style of llm.c dev/cuda.

    x     (N, H, W, C)          any layout: element strides (sxn, sxh, sxw, sxc) (NHWC, NCHW, ...)
    w     (K, R, S, C/groups)   contiguous: KRSC, cuDNN's NHWC filter layout
    scale (K,) fp32, or a null pointer (= 1)      this is how folded BatchNorm arrives
    shift (K,) fp32, or a null pointer (= 0)      this is how bias / folded BatchNorm arrives
    y     (N, P, Q, K)          any layout: element strides (syn, syh, syw, syk)

    y[n,p,q,k] = act( scale[k] * sum_{r<R, s<S, c<Cg} x[n, p*sh-ph+r*dh, q*sw-pw+s*dw, g*Cg+c] * w[k,r,s,c]
                      + shift[k] )
    Cg = C/groups, Kg = K/groups, g = k / Kg (output channel k belongs to group k / Kg). Depthwise: groups == C.

Input positions outside the image (padding) contribute zero. P and Q are the caller's (normally
P = (H + 2*ph - dh*(R-1) - 1) / sh + 1, likewise Q); any P, Q >= 1 are computed correctly, windows that
fall outside the image read zeros. Accumulation is always fp32; scale/shift/activation are applied in fp32
as act(fmaf(acc, scale, shift)) and the result is rounded to the output dtype once. Every kernel computes
its output values with the same epilogue function, so they agree bit for bit whenever their fp32 sums do.
act (runtime int): 0 none, 1 relu (v < 0 ? 0 : v, NaN stays NaN), 2 relu6 (min(max(v,0),6), NaN stays
NaN), 3 gelu, tanh approximation 0.5*v*(1+tanhf(0.7978845608028654*(v+0.044715*v^3))), 4 silu
v/(1+expf(-v)) (the division is div.full.f32, <= 2 ulp: IEEE '/' would be a called subroutine that
makes the callers spill); any other value: none. fp16/bf16 are passed as raw 16-bit storage (unsigned
short).

It includes no CUDA toolkit header (only libnn's kernels/common.cuh, kernels/ffma_tile.cuh and
kernels/mma_pipeline.cuh) so that NVRTC from any pip wheel compiles it without a CUDA toolkit;
conversions, cp.async, ldmatrix and mma are inline PTX. It needs sm_80 or newer (cvt.rn.bf16.f32,
cp.async, bf16 mma). Compiled by libnn with
-Xptxas=-v -I kernels/ -arch=sm_80 or sm_90.

Versions:

1) conv1_direct_{f32,f16,bf16}
   One thread per output element, a plain loop over (r, s, c in the group); any groups, any strides for
   x and y. The obviously-correct baseline. blockIdx.y (and a loop) walks the images, the threads of a
   grid row walk one image's P*Q*K outputs with k fastest when syk <= syw (NHWC y: the warp's x reads are
   broadcasts, its y writes contiguous), otherwise q fastest (NCHW y). 32-bit index math per image.

2) conv2_depthwise_{f32,f16,bf16}
   groups == C == K (depthwise, channel multiplier 1), w (K, R, S, 1). A thread computes V consecutive
   channels (V = 8 for fp16/bf16, 4 for fp32: 16 bytes) of one output pixel; blockIdx.y picks a chunk of
   128 channels, blockIdx.z (and a loop) the image, the block's threads cover floor(256/G) pixels x G
   channel groups per pass (G = groups of V in the chunk) and loop over the image's pixels. The block
   first stages its chunk's weights, scale and shift in shared memory as fp32, transposed to
   [r*S+s][channel] so a thread reads its V weights with 16-byte shared loads. x and y are read/written
   with one 16-byte load per tap and one 16-byte store when the kernel sees (itself, uniform branch)
   C % V == 0, sxc == syk == 1, the other strides multiples of V and x, y 16-byte aligned; otherwise a
   thread computes its channels one at a time with scalar loads (correct for any strides, e.g. NCHW, and
   any C, but slow). If the dynamic shared memory given at launch (read back from %dynamic_smem_size) is
   less than (R*S+2)*128*4 bytes, weights, scale and shift come from global memory through the scalar
   path instead: still correct, slower. Returns without writing anything unless groups == C == K.

3) conv3_igemm_{f16,bf16}
   Implicit GEMM on tensor cores: M = N*P*Q output pixels (rows), N_gemm = K, K_gemm = R*S*C ordered
   (r, s, c) with c fastest, so B is w viewed as a (K, R*S*C) row-major matrix and A[m, (r,s,c)] =
   x[n, p*sh-ph+r*dh, q*sw-pw+s*dw, c] is gathered on the fly (im2col without the copy).
   mma.sync.m16n8k16 (fp32 accumulate) fed by ldmatrix.x4. Default tile 128x64x32 (M x K x K_gemm),
   4 warps as 2(M) x 2(N), 64x32 per warp (64 fp32 accumulators per thread), 4-stage cp.async pipeline
   (16-byte copies, zero-filled for padding, rows past M, channels past K and k past R*S*C; A through
   L1 (.ca: the windows of neighbouring (r, s) overlap), B through L2 only (.cg)), one barrier per
   k-tile, fragments double-buffered across k16 steps and across k-tiles; 64-byte smem rows with the
   16-byte chunks XOR-swizzled (chunk ^ ((row>>1)&3)) so cp.async stores and ldmatrix phases are
   bank-conflict free. Each thread copies one 16-byte chunk (8 channels) of 4 A rows and 2 B rows per
   k-tile; the chunk's (r, s, c) is advanced incrementally and each A row keeps its image offset and
   window origin, so the im2col gather costs a few integer ops per copy. Blocks are rasterized in groups
   of 8 M-tiles (the kernel remaps the block index). The main loop (pipeline, swizzle, fragments, mmas)
   and the rasterization are kernels/mma_pipeline.cuh's, shared with gemm.cu's gemm3; this file has
   conv3's im2col loader (load_tile) and epilogue. Epilogue through shared memory: the fp32 tile is
   written to smem (reusing the pipeline buffers, rows padded to BN+8 floats), then each thread stores
   runs of 8 channels of one output pixel (one 16-byte store when y is channel-contiguous and aligned),
   which also keeps the activation code out of the unrolled accumulator loop.
   16-byte path precondition, checked in-kernel (uniform branch): C % 8 == 0, sxc == 1, sxn, sxh, sxw
   multiples of 8, x and w 16-byte aligned. Otherwise the same pipeline is filled by guarded scalar loads
   (any C, e.g. the C=3 stem, any x strides; the global latency is exposed once per k-tile).
   y: any strides. groups must be 1 (returns without writing otherwise). __launch_bounds__(128, 3):
   at most 168 registers, 3 blocks (12 warps) per SM. The tile can be overridden at compile time with
   -DCONV3_BM/BN/BK/WM/WN/STAGES/MINB for tuning (e.g. BN=128, WN=4 for large K); the LAUNCH table is
   for the defaults.

4) conv4_igemm_f32
   SIMT fp32 implicit GEMM (plain FFMA, no tf32), gemm.cu's gemm2 with the im2col gather: 128x128 tile,
   BK=8, 256 threads, 8x8 outputs per thread (two 4x4 quads 64 apart), tiles staged K-major in shared
   memory (rows padded to 132 floats), double-buffered smem + register prefetch, one barrier per k-tile;
   outputs go out as float4 runs of 4 channels. float4 gathers when C % 4 == 0, sxc == 1, sxn, sxh, sxw
   multiples of 4, x and w 16-byte aligned (checked in-kernel), guarded scalar loads otherwise (any
   strides). groups must be 1 (returns without writing otherwise); grouped fp32 convs go to conv1 (or
   conv2 when depthwise).
   The main loop (thread layout, double buffer, FFMAs) is kernels/ffma_tile.cuh's, shared with gemm.cu's
   gemm2; this file has conv4's im2col loader (gload, sstore) and epilogue.

LAUNCH (all kernels take the same parameters, in this order, no extra ones). libnn/ops/conv2d.py packs them by
the names of CONV_PARAMS below and computes this table from CONV1/CONV2/C4_THREADS, CONV2_CHUNK, CONV3_*
and C4_BM/BN (libnn/runtime/contracts.py reads them; tests/test_kernel_contracts.py checks them):
    (const T* x, const T* w, const float* scale, const float* shift, T* y,
     int N, int H, int W, int C, int K, int R, int S, int P, int Q,
     int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups, int act,
     long long sxn, long long sxh, long long sxw, long long sxc,
     long long syn, long long syh, long long syw, long long syk)
    T = float (f32) or unsigned short (f16/bf16 bits); strides are in elements.

    kernel                block        grid                                                 dynamic smem
    conv1_direct_*        (256, 1, 1)  (ceil(P*Q*K / 256), min(N, 65535), 1)                0
    conv2_depthwise_*     (256, 1, 1)  (ceil(P*Q / floor(256/G)), ceil(C/128), min(N,65535)) (R*S + 2) * 512
                                        G = ceil(min(C, 128) / V), V = 8 (f16/bf16), 4 (f32)
    conv3_igemm_f16/bf16  (128, 1, 1)  (ceil(N*P*Q / 128), ceil(K / 64), 1)                 49152 (= 48 KB:
                                                                                             no attribute)
    conv4_igemm_f32       (256, 1, 1)  (ceil(N*P*Q / 128), ceil(K / 128), 1)                0 (16896 B static)

    conv1, conv2: the work loops (grid-stride over each image's outputs, and over images by grid.y / grid.z),
    so any grid.x and any grid.y (conv1) / grid.z (conv2) >= 1 is correct; conv2's grid.y must be at least
    ceil(C/128). conv2 is also correct with less dynamic smem (0 included: slow path), and needs the max
    dynamic smem attribute only above 49152 bytes (R*S > 94).
    conv3 general form: block = 32*WM*WN, grid = (ceil(N*P*Q/BM), ceil(K/BN)), dynamic smem =
    max(STAGES*(BM+BN)*BK*2, BM*(BN+8)*4) (over 49152: set the kernel's max dynamic smem attribute first).
    conv3 and conv4 must get exactly their grid (extra blocks are harmless, missing ones leave outputs
    unwritten).
    Preconditions (all kernels): every size >= 1, stride and dilation >= 1, pad >= 0, C % groups == 0,
    K % groups == 0, N*P*Q < 2^31, P*Q*K < 2^31 and R*S*C < 2^31 (element offsets are 64-bit), y does
    not alias x, w, scale or shift. conv2: groups == C == K. conv3, conv4: groups == 1.
    x and y may have any strides for every kernel; the fast paths of conv2/3/4 need channel-contiguous
    (NHWC-style) tensors as described above and pick themselves: the launcher checks nothing.
*/

#include "common.cuh"
#include "ffma_tile.cuh"
#include "mma_pipeline.cuh"

namespace ck {

using namespace libnn;

// 16-byte vector load / store of raw elements (the pointer must be 16-byte aligned)
__device__ __forceinline__ void ld16(const float* p, float* o) {
    const f32x4 v = *reinterpret_cast<const f32x4*>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void ld16(const u16* p, u16* o) {
    const u32x4 v = *reinterpret_cast<const u32x4*>(p);
    const u32 wd[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int i = 0; i < 4; i++) { o[2 * i] = (u16)(wd[i] & 0xffffu); o[2 * i + 1] = (u16)(wd[i] >> 16); }
}
__device__ __forceinline__ void st16(float* p, const float* o) {
    f32x4 v; v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
    *reinterpret_cast<f32x4*>(p) = v;
}
__device__ __forceinline__ void st16(u16* p, const u16* o) {
    u32x4 v;
    v.a = (u32)o[0] | ((u32)o[1] << 16); v.b = (u32)o[2] | ((u32)o[3] << 16);
    v.c = (u32)o[4] | ((u32)o[5] << 16); v.d = (u32)o[6] | ((u32)o[7] << 16);
    *reinterpret_cast<u32x4*>(p) = v;
}

// The scalar sizes and strides every kernel gets (copied out of the kernel parameters once).
struct Shape {
    int N, H, W, C, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, groups, act;
    i64 sxn, sxh, sxw, sxc, syn, syh, syw, syk;
};

// ---------------------------------------------------------------------------------------------------
// The one epilogue every kernel uses: act(fmaf(acc, scale, shift)) in fp32, then one rounding.
__device__ __forceinline__ float epi(float acc, float sc, float sh, int act) {
    return apply_act<ACT_CONV>(fmaf(acc, sc, sh), act);
}
__device__ __forceinline__ float epi_k(float acc, const float* scale, const float* shift, int k, int act) {
    return epi(acc, scale ? scale[k] : 1.f, shift ? shift[k] : 0.f, act);
}

// scale/shift of channels k .. k+L-1 (only the first cnt exist; the rest get 1 / 0)
template <int L>
__device__ __forceinline__ void load_ss(const float* scale, const float* shift, int k, int cnt, float* sc, float* sh) {
#pragma unroll
    for (int j = 0; j < L; j++) {
        const bool in = j < cnt;
        sc[j] = (in && scale) ? scale[k + j] : 1.f;
        sh[j] = (in && shift) ? shift[k + j] : 0.f;
    }
}

// Store a run of L output channels of one output pixel, p = &y[n,p,q,k]: the first cnt of them exist.
// A full run goes out as one L-element store when the channels are adjacent in memory and the address
// allows it, otherwise element by element.
template <class DT, int L>
__device__ __forceinline__ void epilogue(typename DT::T* p, i64 syk, int cnt, const float* v, const float* sc,
                                         const float* sh, int act) {
    typedef typename DT::T T;
    struct alignas(L * sizeof(T)) TV { T t[L]; };
    constexpr int B = L * (int)sizeof(T);
    T o[L];
#pragma unroll
    for (int j = 0; j < L; j++) o[j] = DT::st(epi(v[j], sc[j], sh[j], act));
    if ((B == 4 || B == 8 || B == 16) && cnt == L && syk == 1 && ((u64)p & (u64)(B - 1)) == 0) {
        TV t;
#pragma unroll
        for (int j = 0; j < L; j++) t.t[j] = o[j];
        *reinterpret_cast<TV*>(p) = t;
    } else {
#pragma unroll
        for (int j = 0; j < L; j++)
            if (j < cnt) p[j * syk] = o[j];
    }
}

// ---------------------------------------------------------------------------------------------------
// 1) direct
template <class DT>
__device__ __forceinline__ void conv1_body(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ w,
                                           const float* __restrict__ scale, const float* __restrict__ shift,
                                           typename DT::T* __restrict__ y, const Shape& s) {
    typedef typename DT::T T;
    const int Cg = s.C / s.groups, Kg = s.K / s.groups;
    const int PQK = s.P * s.Q * s.K;             // outputs per image: 32-bit index math
    const bool kfast = s.syk <= s.syw;
    for (int n = blockIdx.y; n < s.N; n += gridDim.y) {
        for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < PQK; idx += gridDim.x * blockDim.x) {
            int p, q, k;
            unflatten_pqc(idx, s.P, s.Q, s.K, kfast, p, q, k);
            const int ih0 = p * s.sh - s.ph, iw0 = q * s.sw - s.pw;
            const T* xn = x + ((i64)n * s.sxn + (i64)((k / Kg) * Cg) * s.sxc);
            const T* wk = w + (i64)k * s.R * s.S * Cg;
            float acc = 0.f;
            for (int r = 0; r < s.R; r++) {
                const int ih = ih0 + r * s.dh;
                if ((unsigned)ih >= (unsigned)s.H) continue;
                for (int q2 = 0; q2 < s.S; q2++) {
                    const int iw = iw0 + q2 * s.dw;
                    if ((unsigned)iw >= (unsigned)s.W) continue;
                    const T* xp = xn + ((i64)ih * s.sxh + (i64)iw * s.sxw);
                    const T* wp = wk + (i64)(r * s.S + q2) * Cg;
                    for (int c = 0; c < Cg; c++) acc += DT::ld(xp[c * s.sxc]) * DT::ld(wp[c]);
                }
            }
            float sc, sh;
            load_ss<1>(scale, shift, k, 1, &sc, &sh);
            epilogue<DT, 1>(y + ((i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw + (i64)k * s.syk), s.syk, 1, &acc,
                            &sc, &sh, s.act);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 2) depthwise
#define CONV2_CHUNK 128   // channels per blockIdx.y (and per shared-memory stage)

extern __shared__ u32x4 dsmem[];   // u32x4: 16-byte aligned, as cp.async / vector loads need

// VEC: 16-byte x/y accesses (needs smw); smw: weights/scale/shift staged in shared memory (uniform flag)
template <class DT, bool VEC>
__device__ __forceinline__ void conv2_body(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ w,
                                           const float* __restrict__ scale, const float* __restrict__ shift,
                                           typename DT::T* __restrict__ y, const Shape& s, bool smw) {
    typedef typename DT::T T;
    constexpr int V = DT::V;
    const int tid = threadIdx.x;
    const int c_lo = blockIdx.y * CONV2_CHUNK;
    if (c_lo >= s.C) return;                          // uniform: grid.y too large
    const int cn = imin(s.C - c_lo, CONV2_CHUNK);     // channels in this chunk
    const int gc = (cn + V - 1) / V;                  // channel groups (threads per pixel)
    const int ppb = blockDim.x / gc;                  // pixels per block pass
    const int RS = s.R * s.S;

    float* sw = reinterpret_cast<float*>(dsmem);      // [RS][CHUNK] weights, then scale[CHUNK], shift[CHUNK]
    float* ssc = sw + RS * CONV2_CHUNK;
    float* ssh = ssc + CONV2_CHUNK;
    if (smw) {
        const int cpad = gc * V;                      // zero-fill the last group's tail
        for (int i = tid; i < RS * cpad; i += blockDim.x) {
            const int cl = i / RS, rs = i - cl * RS;  // global reads in w's (k, r, s) order: coalesced
            sw[rs * CONV2_CHUNK + cl] = cl < cn ? DT::ld(w[(i64)(c_lo + cl) * RS + rs]) : 0.f;
        }
        for (int i = tid; i < cpad; i += blockDim.x) {
            ssc[i] = (i < cn && scale) ? scale[c_lo + i] : 1.f;
            ssh[i] = (i < cn && shift) ? shift[c_lo + i] : 0.f;
        }
        __syncthreads();
    }

    const int tg = tid % gc, tp = tid / gc;
    if (tp >= ppb) return;                            // the last tid % gc threads when 256 % gc != 0
    const int cl0 = tg * V, c0 = c_lo + cl0;          // first channel of this thread's group
    const int PQ = s.P * s.Q;
    for (int n = blockIdx.z; n < s.N; n += gridDim.z) {
        for (int pq = blockIdx.x * ppb + tp; pq < PQ; pq += gridDim.x * ppb) {
            const int p = pq / s.Q, q = pq - p * s.Q;
            const int ih0 = p * s.sh - s.ph, iw0 = q * s.sw - s.pw;
            const T* xn = x + ((i64)n * s.sxn + (i64)c0 * s.sxc);
            T* yp = y + ((i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw + (i64)c0 * s.syk);
            if constexpr (VEC) {   // all V channels exist, weights are in shared memory (see conv2_entry)
                float acc[V];
#pragma unroll
                for (int j = 0; j < V; j++) acc[j] = 0.f;
                for (int r = 0; r < s.R; r++) {
                    const int ih = ih0 + r * s.dh;
                    if ((unsigned)ih >= (unsigned)s.H) continue;
                    const T* xr = xn + (i64)ih * s.sxh;
#pragma unroll 1
                    for (int q2 = 0; q2 < s.S; q2++) {
                        const int iw = iw0 + q2 * s.dw;
                        if ((unsigned)iw >= (unsigned)s.W) continue;
                        T raw[V];
                        ld16(xr + (i64)iw * s.sxw, raw);
                        const float* wr = sw + (r * s.S + q2) * CONV2_CHUNK + cl0;
#pragma unroll
                        for (int j = 0; j < V; j += 4) {
                            const f32x4 wv = *reinterpret_cast<const f32x4*>(wr + j);
                            acc[j] += DT::ld(raw[j]) * wv.x;
                            acc[j + 1] += DT::ld(raw[j + 1]) * wv.y;
                            acc[j + 2] += DT::ld(raw[j + 2]) * wv.z;
                            acc[j + 3] += DT::ld(raw[j + 3]) * wv.w;
                        }
                    }
                }
                float sc[V], sh[V];
#pragma unroll
                for (int j = 0; j < V; j += 4) {
                    const f32x4 a4 = *reinterpret_cast<const f32x4*>(ssc + cl0 + j);
                    const f32x4 b4 = *reinterpret_cast<const f32x4*>(ssh + cl0 + j);
                    sc[j] = a4.x; sc[j + 1] = a4.y; sc[j + 2] = a4.z; sc[j + 3] = a4.w;
                    sh[j] = b4.x; sh[j + 1] = b4.y; sh[j + 2] = b4.z; sh[j + 3] = b4.w;
                }
                epilogue<DT, V>(yp, s.syk, V, acc, sc, sh, s.act);   // one 16-byte store
            } else {
                // any strides / C: one channel at a time (a scalar accumulator keeps registers low)
                const int cnt = imin(s.C - c0, V);
#pragma unroll 1
                for (int j = 0; j < cnt; j++) {
                    const T* xc = xn + (i64)j * s.sxc;
                    const T* wc = w + (i64)(c0 + j) * RS;
                    float acc = 0.f;
                    for (int r = 0; r < s.R; r++) {
                        const int ih = ih0 + r * s.dh;
                        if ((unsigned)ih >= (unsigned)s.H) continue;
                        for (int q2 = 0; q2 < s.S; q2++) {
                            const int iw = iw0 + q2 * s.dw;
                            if ((unsigned)iw >= (unsigned)s.W) continue;
                            const int rs = r * s.S + q2;
                            const float wv = smw ? sw[rs * CONV2_CHUNK + cl0 + j] : DT::ld(wc[rs]);
                            acc += DT::ld(xc[(i64)ih * s.sxh + (i64)iw * s.sxw]) * wv;
                        }
                    }
                    float sc, sh;
                    if (smw) { sc = ssc[cl0 + j]; sh = ssh[cl0 + j]; }
                    else load_ss<1>(scale, shift, c0 + j, 1, &sc, &sh);
                    epilogue<DT, 1>(yp + (i64)j * s.syk, s.syk, 1, &acc, &sc, &sh, s.act);
                }
            }
        }
    }
}

template <class DT>
__device__ __forceinline__ void conv2_entry(const typename DT::T* __restrict__ x, const typename DT::T* __restrict__ w,
                                            const float* __restrict__ scale, const float* __restrict__ shift,
                                            typename DT::T* __restrict__ y, const Shape& s) {
    constexpr int V = DT::V;
    if (s.groups != s.C || s.K != s.C) return;
    const bool vec = s.C % V == 0 && s.sxc == 1 && s.syk == 1 &&
                     ((s.sxn | s.sxh | s.sxw | s.syn | s.syh | s.syw) & (V - 1)) == 0 &&
                     (((u64)x | (u64)y) & 15) == 0;
    const bool smw = (u64)dyn_smem_bytes() >= (u64)(s.R * s.S + 2) * CONV2_CHUNK * sizeof(float);
    if (vec && smw) conv2_body<DT, true>(x, w, scale, shift, y, s, true);
    else conv2_body<DT, false>(x, w, scale, shift, y, s, smw);
}

// ---------------------------------------------------------------------------------------------------
// 3) implicit GEMM on tensor cores: mma.sync m16n8k16 + ldmatrix + multi-stage cp.async
#ifndef CONV3_BM
#define CONV3_BM 128
#endif
#ifndef CONV3_BN
#define CONV3_BN 64
#endif
#ifndef CONV3_BK
#define CONV3_BK 32
#endif
#ifndef CONV3_WM
#define CONV3_WM 2
#endif
#ifndef CONV3_WN
#define CONV3_WN 2
#endif
#ifndef CONV3_STAGES
#define CONV3_STAGES 4
#endif
#ifndef CONV3_MINB
#define CONV3_MINB 3      // blocks per SM to fit: caps registers at 65536 / (3*128) = 168
#endif
#define CONV3_THREADS (32 * CONV3_WM * CONV3_WN)
#define CONV3_GROUP_M 8

template <class DT, int BM, int BN, int BK, int WM, int WN, int STAGES, bool AL>
__device__ __forceinline__ void conv3_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                           const float* __restrict__ scale, const float* __restrict__ shift,
                                           u16* __restrict__ y, const Shape& s) {
    constexpr int NT = 32 * WM * WN;
    constexpr int WTM = BM / WM, WTN = BN / WN;    // warp tile
    constexpr int MI = WTM / 16, NI = WTN / 8;     // mma tiles per warp
    constexpr int CH = BK / 8;                     // 16-byte chunks per smem row
    constexpr int RSTEP = NT / CH;                 // loader row step
    constexpr int A_IT = BM * CH / NT, B_IT = BN * CH / NT;
    static_assert(NT % CH == 0 && RSTEP % 8 == 0 && BM % RSTEP == 0 && BN % RSTEP == 0, "loader shape");
    static_assert(A_IT >= 1 && B_IT >= 1 && A_IT <= 32, "loader shape");

    const int M = s.N * s.P * s.Q, PQ = s.P * s.Q, K = s.K;
    const int KG = s.R * s.S * s.C;                // GEMM reduction length

    u16* sA = reinterpret_cast<u16*>(dsmem);       // [STAGES][BM][BK]
    u16* sB = sA + STAGES * BM * BK;                // [STAGES][BN][BK]
    const u32 sA_u = smem_addr(sA), sB_u = smem_addr(sB);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;

    int tm, tn;   // grid = (M-tiles, N-tiles)
    grouped_tile<CONV3_GROUP_M>(gridDim.x, gridDim.y, tm, tn);
    const int m0 = tm * BM, n0 = tn * BN;

    // loader: thread owns chunk column lc (8 consecutive k) of rows lr0 + i*RSTEP
    const int lr0 = tid / CH, lc = tid % CH;
    const int lsw = swz<CH>(lr0, lc);
    const u32 a_dst0 = (u32)((lr0 * BK + lsw * 8) * 2);   // byte offset within a stage

    // A rows = output pixels: window origin (ih0, iw0) and the element offset of x[n, ih0, iw0, 0]
    i64 a_base[A_IT];
    int a_ih[A_IT], a_iw[A_IT];
    u32 a_ok = 0;                                  // bit i: row i is < M
#pragma unroll
    for (int i = 0; i < A_IT; i++) {
        const int m = m0 + lr0 + i * RSTEP;
        int n = 0, p = 0, q = 0;
        if (m < M) {
            n = m / PQ;
            const int pq = m - n * PQ;
            p = pq / s.Q;
            q = pq - p * s.Q;
            a_ok |= 1u << i;
        }
        a_ih[i] = p * s.sh - s.ph;
        a_iw[i] = q * s.sw - s.pw;
        a_base[i] = (i64)n * s.sxn + (i64)a_ih[i] * s.sxh + (i64)a_iw[i] * s.sxw;
    }
    // B rows = output channels
    u32 b_ok = 0;
#pragma unroll
    for (int i = 0; i < B_IT; i++)
        if (n0 + lr0 + i * RSTEP < K) b_ok |= 1u << i;

    // (r, s, c) of this thread's chunk start k = kt*BK + lc*8 in the 16-byte path, advanced by BK per
    // load_tile call (load_tile is called for kt = 0, 1, 2, ... in order)
    int kr = 0, ks = 0, kc = 0;
    if constexpr (AL) {
        const int k = lc * 8;
        const int rs = k / s.C;
        kc = k - rs * s.C;
        kr = rs / s.S;
        ks = rs - kr * s.S;
    }

    auto load_tile = [&](int stage, int kt) {
        const int k = kt * BK + lc * 8;
        if constexpr (AL) {   // C % 8 == 0: a chunk is 8 channels of one (r, s), entirely inside or outside K_gemm
            const bool kok = k < KG;               // same as kr < R
            const int rdh = kr * s.dh, sdw = ks * s.dw;
            const i64 koff = (i64)rdh * s.sxh + (i64)sdw * s.sxw + kc;
#pragma unroll
            for (int i = 0; i < A_IT; i++) {
                const bool ok = kok && ((a_ok >> i) & 1u) && (unsigned)(a_ih[i] + rdh) < (unsigned)s.H &&
                                (unsigned)(a_iw[i] + sdw) < (unsigned)s.W;
                const u16* src = ok ? x + (a_base[i] + koff) : x;
                cp_async16_ca(sA_u + (u32)(stage * BM * BK * 2) + a_dst0 + (u32)(i * RSTEP * BK * 2), src, ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < B_IT; i++) {
                const bool ok = kok && ((b_ok >> i) & 1u);
                const u16* src = ok ? w + ((i64)(n0 + lr0 + i * RSTEP) * KG + k) : w;
                cp_async16(sB_u + (u32)(stage * BN * BK * 2) + a_dst0 + (u32)(i * RSTEP * BK * 2), src, ok ? 16 : 0);
            }
            // advance (r, s, c) by BK
            kc += BK;
            while (kc >= s.C) {
                kc -= s.C;
                if (++ks == s.S) { ks = 0; ++kr; }
            }
        } else {   // any C / strides / alignment: guarded scalar loads, synchronous, stored element-wise
            u16* a_st = sA + stage * BM * BK + a_dst0 / 2;
            u16* b_st = sB + stage * BN * BK + a_dst0 / 2;
#pragma unroll 1
            for (int e = 0; e < 8; e++) {
                const int ke = k + e;
                const bool kok = ke < KG;
                int rdh = 0, sdw = 0;
                i64 off = 0;
                if (kok) {
                    const int rs = ke / s.C, c = ke - rs * s.C;
                    const int r = rs / s.S, q2 = rs - r * s.S;
                    rdh = r * s.dh;
                    sdw = q2 * s.dw;
                    off = (i64)rdh * s.sxh + (i64)sdw * s.sxw + (i64)c * s.sxc;
                }
#pragma unroll
                for (int i = 0; i < A_IT; i++) {
                    const bool ok = kok && ((a_ok >> i) & 1u) && (unsigned)(a_ih[i] + rdh) < (unsigned)s.H &&
                                    (unsigned)(a_iw[i] + sdw) < (unsigned)s.W;
                    a_st[i * RSTEP * BK + e] = ok ? x[a_base[i] + off] : (u16)0;
                }
#pragma unroll
                for (int i = 0; i < B_IT; i++) {
                    const bool ok = kok && ((b_ok >> i) & 1u);
                    b_st[i * RSTEP * BK + e] = ok ? w[(i64)(n0 + lr0 + i * RSTEP) * KG + ke] : (u16)0;
                }
            }
        }
    };

    float acc[MI][NI][4];
    mma_mainloop<DT::bf16 != 0, BM, BN, BK, WM, WN, STAGES, false>(acc, sA_u, sB_u, KG, wm, wn, lane, load_tile);
    __syncthreads();      // every warp is done reading the pipeline's shared memory

    // Epilogue through shared memory: the fp32 tile goes to smem (rows padded to BN+8 floats: the float2
    // fragment stores take the minimum 2 wavefronts), then each thread takes runs of 8 channels of one
    // output pixel (16-byte stores, coalesced along K for NHWC y) in a rolled loop, so the activation code
    // exists once rather than once per accumulator.
    constexpr int CLD = BN + 8;
    constexpr int CPR = BN / 8;                    // 8-channel runs per tile row
    static_assert(NT % CPR == 0, "a thread's run column must stay fixed");
    float* sC = reinterpret_cast<float*>(dsmem);   // [BM][CLD]
    const int g = lane >> 2, t = lane & 3;         // C fragment: c0,c1 at (row g, cols 2t,2t+1), c2,c3 at row g+8
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float* d = sC + (wm * WTM + i * 16 + h * 8 + g) * CLD + wn * WTN + j * 8 + t * 2;
                d[0] = acc[i][j][2 * h];
                d[1] = acc[i][j][2 * h + 1];
            }
    __syncthreads();
    const int rc = tid % CPR;
    const int k0 = n0 + rc * 8;
    const int cnt = imin(K - k0, 8);
    if (cnt <= 0) return;
    float sc[8], sh[8];
    load_ss<8>(scale, shift, k0, cnt, sc, sh);
#pragma unroll 1
    for (int row = tid / CPR; row < BM; row += NT / CPR) {
        const int m = m0 + row;
        if (m >= M) break;
        const int n = m / PQ, pq = m - n * PQ, p = pq / s.Q, q = pq - p * s.Q;
        float v[8];
        const f32x4 v0 = *reinterpret_cast<const f32x4*>(sC + row * CLD + rc * 8);
        const f32x4 v1 = *reinterpret_cast<const f32x4*>(sC + row * CLD + rc * 8 + 4);
        v[0] = v0.x; v[1] = v0.y; v[2] = v0.z; v[3] = v0.w; v[4] = v1.x; v[5] = v1.y; v[6] = v1.z; v[7] = v1.w;
        epilogue<DT, 8>(y + ((i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw + (i64)k0 * s.syk), s.syk, cnt, v,
                        sc, sh, s.act);
    }
}

template <class DT>
__device__ __forceinline__ void conv3_entry(const u16* __restrict__ x, const u16* __restrict__ w,
                                            const float* __restrict__ scale, const float* __restrict__ shift,
                                            u16* __restrict__ y, const Shape& s) {
    if (s.groups != 1) return;
    const bool al = (s.C & 7) == 0 && s.sxc == 1 && ((s.sxn | s.sxh | s.sxw) & 7) == 0 &&
                    (((u64)x | (u64)w) & 15) == 0;
    if (al)
        conv3_body<DT, CONV3_BM, CONV3_BN, CONV3_BK, CONV3_WM, CONV3_WN, CONV3_STAGES, true>(x, w, scale, shift, y, s);
    else
        conv3_body<DT, CONV3_BM, CONV3_BN, CONV3_BK, CONV3_WM, CONV3_WN, CONV3_STAGES, false>(x, w, scale, shift, y, s);
}

// ---------------------------------------------------------------------------------------------------
// 4) tiled SIMT fp32 implicit GEMM (gemm.cu's gemm2 with an im2col gather for A)
#define C4_BM 128
#define C4_BN 128
#define C4_BK 8
#define C4_LD (128 + 4)   // pad: the transposing stores of a warp (16 rows x 2 k-quads) hit 32 banks

typedef FfmaSmem<C4_BK, C4_LD> c4_smem;

template <bool AL>
__device__ __forceinline__ void conv4_body(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ scale, const float* __restrict__ shift,
                                           float* __restrict__ y, const Shape& s, c4_smem& sm) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int ty, tx;
    ffma_thread(warp, lane, ty, tx);
    const int M = s.N * s.P * s.Q, PQ = s.P * s.Q, K = s.K;
    const int KG = s.R * s.S * s.C;
    const int m0 = blockIdx.x * C4_BM, n0 = blockIdx.y * C4_BN;

    // loader: thread -> one row of the 128x8 A tile and of the B tile, 4 consecutive k
    const int lr = tid >> 1, lk = (tid & 1) * 4;
    int a_ih, a_iw;
    i64 a_base;
    const bool mok = m0 + lr < M;
    {
        const int m = mok ? m0 + lr : 0;
        const int n = m / PQ, pq = m - n * PQ, p = pq / s.Q, q = pq - p * s.Q;
        a_ih = p * s.sh - s.ph;
        a_iw = q * s.sw - s.pw;
        a_base = (i64)n * s.sxn + (i64)a_ih * s.sxh + (i64)a_iw * s.sxw;
    }
    const bool wok = n0 + lr < K;
    const float* wp = w + (wok ? (i64)(n0 + lr) * KG : 0);

    // (r, s, c) of k = k0 + lk in the float4 path, advanced by BK per gload call (k0 = 0, 8, 16, ...)
    int kr = 0, ks = 0, kc = 0;
    if constexpr (AL) {
        const int rs = lk / s.C;
        kc = lk - rs * s.C;
        kr = rs / s.S;
        ks = rs - kr * s.S;
    }

    float ra[4], rb[4];
    auto gload = [&](int k0) {
        const int k = k0 + lk;
        if constexpr (AL) {   // C % 4 == 0: a quad is 4 channels of one (r, s), entirely inside or outside K_gemm
            f32x4 va = {0.f, 0.f, 0.f, 0.f}, vb = {0.f, 0.f, 0.f, 0.f};
            const bool kok = k < KG;
            const int rdh = kr * s.dh, sdw = ks * s.dw;
            if (kok && mok && (unsigned)(a_ih + rdh) < (unsigned)s.H && (unsigned)(a_iw + sdw) < (unsigned)s.W)
                va = *reinterpret_cast<const f32x4*>(x + (a_base + (i64)rdh * s.sxh + (i64)sdw * s.sxw + kc));
            if (kok && wok) vb = *reinterpret_cast<const f32x4*>(wp + k);
            ra[0] = va.x; ra[1] = va.y; ra[2] = va.z; ra[3] = va.w;
            rb[0] = vb.x; rb[1] = vb.y; rb[2] = vb.z; rb[3] = vb.w;
            kc += C4_BK;
            while (kc >= s.C) {
                kc -= s.C;
                if (++ks == s.S) { ks = 0; ++kr; }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int ke = k + i;
                float va = 0.f, vb = 0.f;
                if (ke < KG) {
                    if (mok) {
                        const int rs = ke / s.C, c = ke - rs * s.C;
                        const int r = rs / s.S, q2 = rs - r * s.S;
                        const int rdh = r * s.dh, sdw = q2 * s.dw;
                        if ((unsigned)(a_ih + rdh) < (unsigned)s.H && (unsigned)(a_iw + sdw) < (unsigned)s.W)
                            va = x[a_base + (i64)rdh * s.sxh + (i64)sdw * s.sxw + (i64)c * s.sxc];
                    }
                    if (wok) vb = wp[ke];
                }
                ra[i] = va;
                rb[i] = vb;
            }
        }
    };
    auto sstore = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sm.A[buf][lk + i][lr] = ra[i];
            sm.B[buf][lk + i][lr] = rb[i];
        }
    };

    float acc[8][8];
    ffma_mainloop(acc, sm, KG, ty, tx, gload, sstore);

#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int m = m0 + ffma_row(i, ty);
        if (m >= M) continue;
        const int n = m / PQ, pq = m - n * PQ, p = pq / s.Q, q = pq - p * s.Q;
        float* yp = y + ((i64)n * s.syn + (i64)p * s.syh + (i64)q * s.syw);
#pragma unroll
        for (int j = 0; j < 8; j += 4) {
            const int k = n0 + ffma_col(j, tx);
            if (k >= K) continue;
            float sc[4], sh[4];
            load_ss<4>(scale, shift, k, K - k, sc, sh);
            epilogue<dt_f32, 4>(yp + (i64)k * s.syk, s.syk, imin(K - k, 4), &acc[i][j], sc, sh, s.act);
        }
    }
}

}  // namespace ck

// ---------------------------------------------------------------------------------------------------
// exported kernels (extern "C": the launcher looks them up by these names)
#define CONV1_THREADS 256
#define CONV2_THREADS 256
#define C4_THREADS 256
#define CONV_PARAMS(T)                                                                                      \
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ scale,                      \
    const float* __restrict__ shift, T* __restrict__ y, int N, int H, int W, int C, int K, int R, int S,    \
    int P, int Q, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups,       \
    int act, long long sxn, long long sxh, long long sxw, long long sxc, long long syn, long long syh,      \
    long long syw, long long syk
#define CONV_SHAPE                                                                                          \
    const ck::Shape s = {N, H, W, C, K, R, S, P, Q, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,         \
                         groups, act, sxn, sxh, sxw, sxc, syn, syh, syw, syk}

#define CONV1(name, DT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(CONV1_THREADS) name(CONV_PARAMS(ck::DT::T)) {                        \
        CONV_SHAPE;                                                                                         \
        ck::conv1_body<ck::DT>(x, w, scale, shift, y, s);                                                   \
    }
CONV1(conv1_direct_f32, dt_f32)
CONV1(conv1_direct_f16, dt_f16)
CONV1(conv1_direct_bf16, dt_bf16)

#define CONV2(name, DT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(CONV2_THREADS, 4) name(CONV_PARAMS(ck::DT::T)) {                     \
        CONV_SHAPE;                                                                                         \
        ck::conv2_entry<ck::DT>(x, w, scale, shift, y, s);                                                  \
    }
CONV2(conv2_depthwise_f32, dt_f32)
CONV2(conv2_depthwise_f16, dt_f16)
CONV2(conv2_depthwise_bf16, dt_bf16)

#define CONV3(name, DT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(CONV3_THREADS, CONV3_MINB) name(CONV_PARAMS(ck::u16)) {    \
        CONV_SHAPE;                                                                                         \
        ck::conv3_entry<ck::DT>(x, w, scale, shift, y, s);                                                  \
    }
CONV3(conv3_igemm_f16, dt_f16)
CONV3(conv3_igemm_bf16, dt_bf16)

extern "C" __global__ void __launch_bounds__(C4_THREADS, 2) conv4_igemm_f32(CONV_PARAMS(float)) {
    __shared__ ck::c4_smem sm;
    CONV_SHAPE;
    if (groups != 1) return;
    const bool al = (C & 3) == 0 && sxc == 1 && ((sxn | sxh | sxw) & 3) == 0 &&
                    ((((ck::u64)x) | ((ck::u64)w)) & 15) == 0;
    if (al) ck::conv4_body<true>(x, w, scale, shift, y, s, sm);
    else ck::conv4_body<false>(x, w, scale, shift, y, s, sm);
}
