/*
Batched complex-to-complex FFT in fp32, power-of-two lengths, in the style of llm.c dev/cuda (versions 1-3),
and the element-wise passes fft_conv's cuFFT path runs around cuFFT's transforms (4-6).

    in, out   complex64 as interleaved (re, im) float pairs (cf32 below, 8-byte aligned)
    transform b (0 <= b < batch), element e (0 <= e < n = 2^log2n):
        x_b[e] = in[b*batch_stride + e*elem_stride],   X_b[k] is written to out[b*batch_stride + k*elem_stride]
    forward (inverse == 0): X[k] = sum_e x[e] exp(-2*pi*i*e*k/n)
    inverse (inverse != 0): X[k] = sum_e x[e] exp(+2*pi*i*e*k/n)     unnormalized: no 1/n, the caller scales

Strides are in complex elements, so one kernel transforms the rows (elem_stride = 1, batch_stride = row
length) or the columns (elem_stride = row length, batch_stride = 1) of a 2-D array. in == out (in place)
is allowed: a block reads every element of the transforms it holds before it writes any of them, and
distinct transforms must not share elements (as with any sane strides). Lengths above 4096 are the
caller's: the four-step algorithm (libnn/ops/fft_conv_kernels.py) = column FFTs, fft_twiddle, row FFTs and a
transpose.

Limits: n = 2^log2n with 1 <= log2n <= 12 (2 .. 4096 points; the whole transform lives in one block's
shared memory), fp32 storage and arithmetic, power-of-two lengths only, batch < 2^31.

Twiddles: every block first fills a shared table tw[k] = exp(-+2*pi*i*k/n), k < n/2, with sincospif on the
exact argument k/(n/2) (n is a power of two, so the argument is a float with no rounding; sincospif is
accurate to 1 ulp, no reduction of a large argument by an inexact pi), and looks up W_n^k for
n/2 <= k < n as -tw[k - n/2]. No twiddle is ever obtained by a recurrence or from a product of others, so
each butterfly contributes O(eps) error and the transform's relative rms error grows like
eps * log2(n) (eps = 2^-24 ~ 6e-8): ~1e-6 * log2(n) is a generous bound. The fast __sinf/__cosf are not
used. The table is built once per block and reused for all the transforms a block handles (blocks
grid-stride over the batch), so a grid of a few waves of blocks amortizes it.

Versions:

1) fft_radix2_c2c
   Iterative radix-2 Cooley-Tukey, decimation in time, in place in shared memory: the load scatters
   x[e] to a[bitreverse(e)] (global reads stay coalesced for rows), then log2n stages; stage s (span
   m = 2^s) does the n/2 butterflies a[i0], a[i0+m/2] <- u + w*v, u - w*v with i0 = (b / (m/2))*m + b % (m/2),
   w = W_m^(b % (m/2)) = tw[(b % (m/2)) * n/m]; one barrier per stage, the result is in natural order.
   One transform at a time per block; any blockDim (the loops stride over it). The obviously-correct
   baseline.

2) fft_radix4_c2c
   Stockham autosort, radix 4 with one final radix-2 stage when log2n is odd, values exchanged through one
   shared buffer. Stage with radix R in {4, 2} after previous radices whose product is Ns, butterfly
   j < n/R:  v[r] = a[j + r*n/R] * W_{Ns*R}^(r*(j % Ns)),  v = DFT_R(v),
             a[(j / Ns)*Ns*R + (j % Ns) + r*Ns] = v[r]          (r < R)
   A thread keeps all its butterflies' values in registers (at most 4 radix-4 or 4 radix-2 butterflies),
   so a stage is: read + compute, barrier, write, barrier. The final radix-2 stage (Ns = n/2) writes
   exactly the two elements it read, so it needs no barrier in between. Half the shared-memory traffic
   and half the barriers of version 1 (log4 instead of log2 stages).
   A block of blockDim threads (a power of two) holds P = blockDim / T transforms at a time, T =
   min(max(n/4, 1), blockDim) threads each, so small n still fills the block (n <= 1024: P*n = 4*blockDim).
   Two layouts, chosen by the kernel per launch (a uniform branch):
     rows    (batch_stride >= elem_stride): shared a[p*n + e], threads numbered with the butterfly index
             fastest, global accesses walk e fastest (coalesced for elem_stride == 1);
     columns (batch_stride <  elem_stride): shared a[e*P + p], threads numbered with the transform fastest,
             global accesses walk the transform index fastest, so P neighbouring columns are read and
             written as one contiguous run per element (coalesced once P >= 4, i.e. n <= 256); for
             n >= 1024 (P = 1) a column's elements are read one 8-byte word per row.
   Needs n <= 16*blockDim (at most 4 butterflies per thread per stage); otherwise the block returns without
   writing anything. Same results as version 1 up to rounding.

3) fft_twiddle
   data viewed as batch matrices of (n1, n2) row-major complex (n = n1*n2, matrix b at data + b*batch_stride)
   is multiplied in place element-wise by W_n^(i*j) = exp(-+2*pi*i * i*j / n) (sign by inverse), the middle
   step of the four-step FFT. The phase is reduced exactly in integers: k = (i*j) mod n, shifted to
   (-n/2, n/2], then sincospif(2k/n) on an exact float argument (n <= 2^25), so large n lose no accuracy
   to the argument. One grid-stride pass, memory-bound.

The kernels below serve fft_conv (libnn/ops/fft_conv.py), around cuFFT's real-to-complex transforms:
one pass each before, between and after them, so that a bound call launches pad, R2C, multiply, C2R,
crop and nothing else. Spatial shapes are 2-D; the 1-D op passes H = kh = Fh = 1.

4) fft_pad_{f32,f16,bf16}
   Zero-padded fp32 copies of x and w in one buffer of rows_x + rows_w rows of Fh x Fw, the input of one
   batched R2C transform: row r < rows_x (r = n*C + c) holds x[n, c] at offset (ph, pw), row rows_x + r
   (r = k*C + c) holds w[k, c] at (0, 0); everything else is written 0 (cuFFT may reuse the buffer's
   contents, and a reused workspace must not carry the last call's values). The cast to fp32 happens here.
5) fft_cmul
   Y[n, k, f] = sum_c X[n, c, f] * conj(W[k, c, f]) for every frequency bin f < bins, with X the first
   N*C spectra of `spectra` and W the K*C after them (cross-correlation: the filter spectrum conjugated).
   One thread per (n, k, f), f fastest (coalesced); for the few channel pairs it is used for (C*K <= 16,
   libnn/ops/fft_conv.py GEMM_CHANNEL_PAIRS) the c loop is short and its re-reads of X hit L1.
6) fft_crop_{f32,f16,bf16}
   out[n, k, p, q] = T(y[n, k, p, q] * scale + bias[k]) for p < OH, q < OW of the C2R output y (N*K rows of
   Fh x Fw): the crop, the 1/(Fh*Fw) normalisation cuFFT leaves out, the bias (null: none) and the cast
   to the output dtype in one pass. bias has the output's dtype and is added in fp32.

LAUNCH (n = 2^log2n; dynamic shared memory in bytes; grid may be smaller than the number of work items:
every kernel grid-strides, so any grid >= 1 is correct; a grid of about one resident wave amortizes the
twiddle table best):
    kernel            block                       grid (at most)          dynamic smem
    fft_radix2_c2c    min(max(n/2, 32), 256)       batch                   (n + n/2) * 8     (<= 48 KB)
    fft_radix4_c2c    256                          ceil(batch / P)         (P*n + n/2) * 8   (<= 48 KB)
                      (P = 256 / min(max(n/4, 1), 256): n=2,4: 256; n<=1024: 1024/n; else 1)
    fft_twiddle       256                          ceil(batch*n1*n2/256)   0
    fft_pad_*         256                          ceil(total/256)         0     (total = rows*Fh*Fw)
    fft_cmul          256                          ceil(N*K*bins/256)      0
    fft_crop_*        256                          ceil(total/256)         0     (total = N*K*OH*OW)
parameters:
    fft_radix2_c2c, fft_radix4_c2c: (const cf32* input, cf32* out, int log2n, int batch,
                                     long long elem_stride, long long batch_stride, int inverse)
    fft_twiddle:                    (cf32* data, int log2n1, int log2n2, long long batch_stride, int batch,
                                     int inverse)
    fft_pad_*:                      (const T* x, const T* w, float* out, long long rows_x, long long total,
                                     int H, int W, int ph, int pw, int kh, int kw, int Fh, int Fw)
    fft_cmul:                       (const cf32* spectra, cf32* y, int N, int C, int K, long long bins)
    fft_crop_*:                     (const float* y, const T* bias, T* out, long long total, int K, int OH,
                                     int OW, int Fh, int Fw, float scale)
*/
#include "common.cuh"

using namespace libnn;

struct alignas(8) cf32 { float re, im; };

__device__ __forceinline__ cf32 cadd(cf32 a, cf32 b) { return {a.re + b.re, a.im + b.im}; }
__device__ __forceinline__ cf32 csub(cf32 a, cf32 b) { return {a.re - b.re, a.im - b.im}; }
__device__ __forceinline__ cf32 cmul(cf32 a, cf32 b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }

extern __shared__ cf32 fft_smem[];

// tw[k] = W_n^k = (cos(2*pi*k/n), sgn*sin(2*pi*k/n)) for k < n/2; sgn = -1 forward, +1 inverse.
// k/(n/2) is exact in fp32 (n a power of two), so sincospif sees the exact phase.
__device__ __forceinline__ void fill_twiddles(cf32* tw, int log2n, float sgn) {
    const int half = 1 << (log2n - 1);
    const float step = 1.0f / (float)half;  // a power of two: k * step is exact
    for (int k = threadIdx.x; k < half; k += blockDim.x) {
        float s, c;
        sincospif((float)k * step, &s, &c);
        tw[k] = {c, sgn * s};
    }
}

// W_n^k for 0 <= k < n from the half table: W_n^(k + n/2) = -W_n^k
__device__ __forceinline__ cf32 twiddle_at(const cf32* tw, int k, int log2n) {
    const int half = 1 << (log2n - 1);
    const cf32 w = tw[k & (half - 1)];
    const float s = (k & half) ? -1.f : 1.f;
    return {s * w.re, s * w.im};
}

// ---- 1) radix-2 Cooley-Tukey (DIT, bit-reversed load), one transform per block at a time ------------
extern "C" __global__ void __launch_bounds__(256)
fft_radix2_c2c(const cf32* input, cf32* out, int log2n, int batch, i64 elem_stride, i64 batch_stride, int inverse) {
    if (log2n < 1 || log2n > 12) return;
    const int n = 1 << log2n, half = n >> 1;
    cf32* a = fft_smem;        // n values
    cf32* tw = fft_smem + n;   // n/2 twiddles
    fill_twiddles(tw, log2n, inverse ? 1.f : -1.f);  // the first barrier below publishes the table

    for (i64 b = blockIdx.x; b < batch; b += gridDim.x) {
        const cf32* src = input + (i64)b * batch_stride;
        cf32* dst = out + (i64)b * batch_stride;
        for (int e = threadIdx.x; e < n; e += blockDim.x)
            a[__brev((unsigned)e) >> (32 - log2n)] = src[e * elem_stride];
        __syncthreads();
        for (int s = 1; s <= log2n; ++s) {
            const int hm = 1 << (s - 1);  // half the span m = 2^s
            for (int bf = threadIdx.x; bf < half; bf += blockDim.x) {
                const int j = bf & (hm - 1);
                const int i0 = ((bf >> (s - 1)) << s) + j;
                const cf32 w = tw[j << (log2n - s)];  // W_m^j = W_n^(j * n/m), j * n/m < n/2
                const cf32 u = a[i0], v = cmul(w, a[i0 + hm]);
                a[i0] = cadd(u, v);
                a[i0 + hm] = csub(u, v);
            }
            __syncthreads();
        }
        for (int e = threadIdx.x; e < n; e += blockDim.x)
            dst[e * elem_stride] = a[e];
        __syncthreads();  // the next transform's load overwrites a
    }
}

// ---- 2) Stockham radix-4 (+ one radix-2), P transforms per block, values exchanged via registers ------
#define FFT4_MAX_BF 4  // butterflies per thread per stage (n <= 16 * blockDim)

// in-register DFT of 4 points; sgn = -1 forward, +1 inverse
__device__ __forceinline__ void dft4(cf32* v, float sgn) {
    const cf32 a = cadd(v[0], v[2]), b = csub(v[0], v[2]);
    const cf32 c = cadd(v[1], v[3]), d = csub(v[1], v[3]);
    const cf32 e = {-sgn * d.im, sgn * d.re};  // sgn*i*d: -i*d forward, +i*d inverse
    v[0] = cadd(a, c);
    v[1] = cadd(b, e);
    v[2] = csub(a, c);
    v[3] = csub(b, e);
}

extern "C" __global__ void __launch_bounds__(256)
fft_radix4_c2c(const cf32* input, cf32* out, int log2n, int batch, i64 elem_stride, i64 batch_stride, int inverse) {
    if (log2n < 1 || log2n > 12) return;
    const int n = 1 << log2n;
    const int log2bd = 31 - __clz((int)blockDim.x);
    if ((1 << log2bd) != (int)blockDim.x) return;           // blockDim must be a power of two
    const int log2T = imin(imax(log2n - 2, 0), log2bd);     // threads per transform
    const int log2P = log2bd - log2T;                       // transforms per block
    const int T = 1 << log2T, P = 1 << log2P;
    const int log2bf = (log2n & 1) ? log2n - 1 : log2n - 2;  // log2 of the widest stage's butterflies
    if (log2bf - log2T > 2) return;                           // more than FFT4_MAX_BF per thread
    const float sgn = inverse ? 1.f : -1.f;

    const bool columns = batch_stride < elem_stride;
    const int sp = columns ? 1 : n, se = columns ? P : 1;  // shared index of (transform p, element e): p*sp + e*se
    const int tid = threadIdx.x;
    const int p = columns ? (tid & (P - 1)) : (tid >> log2T);
    const int t = columns ? (tid >> log2P) : (tid & (T - 1));
    cf32* a = fft_smem;                 // P*n values
    cf32* tw = fft_smem + (P << log2n); // n/2 twiddles
    fill_twiddles(tw, log2n, sgn);
    cf32* my = a + p * sp;              // this thread's transform: element e at my[e*se]

    for (i64 b0 = (i64)blockIdx.x * P; b0 < batch; b0 += (i64)gridDim.x * P) {
        for (int idx = tid; idx < (P << log2n); idx += blockDim.x) {
            const int pp = columns ? (idx & (P - 1)) : (idx >> log2n);
            const int e = columns ? (idx >> log2P) : (idx & (n - 1));
            if (b0 + pp < batch) a[pp * sp + e * se] = input[(b0 + pp) * batch_stride + e * elem_stride];
        }
        __syncthreads();

        int lns = 0;  // log2(Ns)
        for (; lns + 2 <= log2n; lns += 2) {  // radix-4 stages, n/4 butterflies
            const int quarter = n >> 2, shift = log2n - lns - 2;  // W_{4Ns}^x = W_n^(x << shift)
            cf32 v[FFT4_MAX_BF][4];
#pragma unroll
            for (int k = 0; k < FFT4_MAX_BF; ++k) {
                const int j = t + (k << log2T);
                if (j < quarter) {
                    const int jj = j & ((1 << lns) - 1);
                    v[k][0] = my[j * se];
#pragma unroll
                    for (int r = 1; r < 4; ++r)
                        v[k][r] = cmul(my[(j + r * quarter) * se], twiddle_at(tw, (r * jj) << shift, log2n));
                    dft4(v[k], sgn);
                }
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < FFT4_MAX_BF; ++k) {
                const int j = t + (k << log2T);
                if (j < quarter) {
                    const int jj = j & ((1 << lns) - 1);
                    const int base = ((j >> lns) << (lns + 2)) + jj;
#pragma unroll
                    for (int r = 0; r < 4; ++r) my[(base + (r << lns)) * se] = v[k][r];
                }
            }
            __syncthreads();
        }
        if (lns < log2n) {  // final radix-2 stage, Ns = n/2: butterfly j reads and writes j and j + n/2
            const int halfn = n >> 1;
#pragma unroll
            for (int k = 0; k < FFT4_MAX_BF; ++k) {
                const int j = t + (k << log2T);
                if (j < halfn) {
                    const cf32 u = my[j * se], v = cmul(my[(j + halfn) * se], tw[j]);  // W_n^j, j < n/2
                    my[j * se] = cadd(u, v);
                    my[(j + halfn) * se] = csub(u, v);
                }
            }
            __syncthreads();
        }

        for (int idx = tid; idx < (P << log2n); idx += blockDim.x) {
            const int pp = columns ? (idx & (P - 1)) : (idx >> log2n);
            const int e = columns ? (idx >> log2P) : (idx & (n - 1));
            if (b0 + pp < batch) out[(b0 + pp) * batch_stride + e * elem_stride] = a[pp * sp + e * se];
        }
        __syncthreads();  // the next group's load overwrites a
    }
}

// ---- 3) four-step twiddle: data[b][i][j] *= W_n^(i*j), n = n1*n2 ----------------------------------------
extern "C" __global__ void __launch_bounds__(256)
fft_twiddle(cf32* data, int log2n1, int log2n2, i64 batch_stride, int batch, int inverse) {
    const int log2n = log2n1 + log2n2;
    const i64 n = (i64)1 << log2n, total = n * batch;
    const float sgn = inverse ? 1.f : -1.f;
    const float step = 2.0f / (float)n;  // a power of two: k * step is exact for |k| <= 2^24
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 b = idx >> log2n, r = idx & (n - 1);
        const i64 i = r >> log2n2, j = r & (((i64)1 << log2n2) - 1);
        i64 k = (i * j) & (n - 1);   // phase 2*pi*k/n, reduced exactly
        if (k > (n >> 1)) k -= n;    // k in (-n/2, n/2]: sincospif argument in (-1, 1]
        float s, c;
        sincospif((float)k * step, &s, &c);
        cf32* q = data + b * batch_stride + r;
        *q = cmul(*q, {c, sgn * s});
    }
}

// ---- 4) fft_conv: x and w zero-padded into one fp32 buffer, the input of one batched R2C ----------------
template <class DT>
__device__ __forceinline__ void fft_pad(const typename DT::T* x, const typename DT::T* w, float* out, i64 rows_x,
                                        i64 total, int H, int W, int ph, int pw, int kh, int kw, int Fh, int Fw) {
    const i64 plane = (i64)Fh * Fw;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / plane;
        const int rem = (int)(idx - r * plane);
        const int i = rem / Fw, j = rem - i * Fw;
        float v = 0.f;
        if (r < rows_x) {
            const int ii = i - ph, jj = j - pw;
            if (ii >= 0 && ii < H && jj >= 0 && jj < W) v = DT::ld(x[r * H * W + (i64)ii * W + jj]);
        } else if (i < kh && j < kw) {
            v = DT::ld(w[(r - rows_x) * kh * kw + i * kw + j]);
        }
        out[idx] = v;
    }
}

#define FFT_PAD(SUFFIX, DT)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
    fft_pad_##SUFFIX(const DT::T* x, const DT::T* w, float* out, i64 rows_x, i64 total, int H, int W,      \
                     int ph, int pw, int kh, int kw, int Fh, int Fw) {                                     \
        fft_pad<DT>(x, w, out, rows_x, total, H, W, ph, pw, kh, kw, Fh, Fw);                                \
    }
FFT_PAD(f32, dt_f32)
FFT_PAD(f16, dt_f16)
FFT_PAD(bf16, dt_bf16)

// ---- 5) fft_conv: Y[n, k] = sum_c X[n, c] * conj(W[k, c]) per frequency bin ----------------------------
extern "C" __global__ void __launch_bounds__(256)
fft_cmul(const cf32* spectra, cf32* y, int N, int C, int K, i64 bins) {
    const i64 total = (i64)N * K * bins;
    const cf32* wf = spectra + (i64)N * C * bins;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 nk = idx / bins, f = idx - nk * bins;
        const int n = (int)(nk / K), k = (int)(nk - (i64)n * K);
        const cf32* xs = spectra + (i64)n * C * bins + f;
        const cf32* ws = wf + (i64)k * C * bins + f;
        cf32 acc = {0.f, 0.f};
        for (int c = 0; c < C; ++c) {
            const cf32 a = xs[c * bins], b = ws[c * bins];
            acc.re += a.re * b.re + a.im * b.im;   // a * conj(b)
            acc.im += a.im * b.re - a.re * b.im;
        }
        y[idx] = acc;
    }
}

// ---- 6) fft_conv: crop, normalise, add the bias and cast, one pass -------------------------------------
template <class DT>
__device__ __forceinline__ void fft_crop(const float* y, const typename DT::T* bias, typename DT::T* out, i64 total,
                                         int K, int OH, int OW, int Fh, int Fw, float scale) {
    const i64 plane = (i64)OH * OW;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 nk = idx / plane;
        const int rem = (int)(idx - nk * plane);
        const int p = rem / OW, q = rem - p * OW;
        float v = y[nk * Fh * Fw + (i64)p * Fw + q] * scale;
        if (bias) v += DT::ld(bias[(int)(nk % K)]);
        out[idx] = DT::st(v);
    }
}

#define FFT_CROP(SUFFIX, DT)                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
    fft_crop_##SUFFIX(const float* y, const DT::T* bias, DT::T* out, i64 total, int K, int OH, int OW,     \
                      int Fh, int Fw, float scale) {                                                       \
        fft_crop<DT>(y, bias, out, total, K, OH, OW, Fh, Fw, scale);                                       \
    }
FFT_CROP(f32, dt_f32)
FFT_CROP(f16, dt_f16)
FFT_CROP(bf16, dt_bf16)
