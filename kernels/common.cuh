/*
libnn's shared device code for the kernel files in kernels/: storage types, fp16/bf16 conversions and the
tensor-core and copy primitives as inline PTX (so that no CUDA toolkit header is needed and NVRTC from
any wheel compiles the kernels), dtype traits, and the activation every fused epilogue applies.

Activation codes (libnn/ops/activations.py KERNEL_CODES): 0 none, 1 relu, 2 relu6, 3 gelu (tanh
approximation), 4 silu, 5 gelu_erf (exact erf GELU). NaN propagates through each of them.
*/
#pragma once

namespace libnn {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct alignas(16) u32x4 { u32 a, b, c, d; };
struct alignas(16) f32x4 { float x, y, z, w; };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    float f; asm("mov.b32 %0, %1;" : "=f"(f) : "r"((u32)h << 16)); return f;
}
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// x / y with at most 2 ulp error over the full range, inline (IEEE '/' calls a slow-path subroutine,
// which would make the callers keep registers on the stack)
__device__ __forceinline__ float fdiv_full(float a, float b) {
    float d; asm("div.full.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d;
}
// bytes of dynamic shared memory this launch was given
__device__ __forceinline__ u32 dyn_smem_bytes() {
    u32 r; asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r)); return r;
}
// 32-bit shared-window address, what cp.async / ldmatrix take
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16-byte global->shared async copy; src_bytes = 0 zero-fills the destination without reading src.
// .cg caches in L2 only; .ca also in L1 (the im2col rows of neighbouring (r, s) overlap)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// .cg with L2's prefetch of the aligned 256 bytes around src (their other sectors read soon, by others)
__device__ __forceinline__ void cp_async16_l2_256(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_ca(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
// volatile: it reads shared memory behind the compiler's back and must stay between the barriers
__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
// d += a(16x16, row) * b(16x8, col), fp32 accumulate
template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, const u32* a, const u32* b) {
    if constexpr (BF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ float u32_as_f32(u32 u) {
    float f; asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u)); return f;
}
// NaN-propagating max: NaN if either input is NaN (packed: per half)
__device__ __forceinline__ u32 max_nan_f16x2(u32 a, u32 b) {
    u32 d; asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
__device__ __forceinline__ u32 max_nan_bf16x2(u32 a, u32 b) {
    u32 d; asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
__device__ __forceinline__ u32 max_nan_f32(u32 a, u32 b) {   // on the bits of two floats
    u32 d; asm("max.NaN.f32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}

// dtype traits: storage type, conversions to/from the fp32 compute type, V = elements per 16 bytes,
// vmax = NaN-propagating max of two 32-bit words of packed elements, NINF = a word of packed -inf
struct dt_f32 {
    typedef float T;
    enum { bf16 = 0, V = 4 };
    static constexpr u32 NINF = 0xff800000u;
    static __device__ __forceinline__ float ld(T v) { return v; }
    static __device__ __forceinline__ T st(float v) { return v; }
    static __device__ __forceinline__ u32 vmax(u32 a, u32 b) { return max_nan_f32(a, b); }
};
struct dt_f16 {
    typedef u16 T;
    enum { bf16 = 0, V = 8 };
    static constexpr u32 NINF = 0xfc00fc00u;
    static __device__ __forceinline__ float ld(T v) { return f16_to_f32(v); }
    static __device__ __forceinline__ T st(float v) { return f32_to_f16(v); }
    static __device__ __forceinline__ u32 vmax(u32 a, u32 b) { return max_nan_f16x2(a, b); }
};
struct dt_bf16 {
    typedef u16 T;
    enum { bf16 = 1, V = 8 };
    static constexpr u32 NINF = 0xff80ff80u;
    static __device__ __forceinline__ float ld(T v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ T st(float v) { return f32_to_bf16(v); }
    static __device__ __forceinline__ u32 vmax(u32 a, u32 b) { return max_nan_bf16x2(a, b); }
};
// fp64 loads and stores as they are (softmax and masked_mean compute fp64 in fp64; no packed max)
struct dt_f64 {
    typedef double T;
    enum { bf16 = 0, V = 2 };
    static __device__ __forceinline__ double ld(T v) { return v; }
    static __device__ __forceinline__ T st(double v) { return v; }
};

// (p, q, ch) of output element `idx` of one image of a P x Q x CH output: ch fastest when the output is
// channels-last (consecutive threads then write consecutive channels), q fastest otherwise.
__device__ __forceinline__ void unflatten_pqc(int idx, int P, int Q, int CH, bool ch_fastest, int& p, int& q,
                                              int& ch) {
    if (ch_fastest) {
        const int pq = idx / CH;
        ch = idx - pq * CH;
        p = pq / Q;
        q = pq - p * Q;
    } else {
        const int cp = idx / Q;
        q = idx - cp * Q;
        ch = cp / P;
        p = cp - ch * P;
    }
}

// 2^x by the MUFU alone (ex2.approx.ftz: ~2 ulp, results below 2^-126 flush to 0): exp2f compiles to the
// non-ftz ex2, which ptxas wraps in a fix-up for subnormal results
__device__ __forceinline__ float exp2_ftz(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
// 1/x by the MUFU alone (rcp.approx.ftz: ~1 ulp)
__device__ __forceinline__ float rcp_ftz(float x) {
    float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}

// Φ(v) = (1 + erf(v/√2)) / 2, the standard normal CDF, for the exact GELU v·Φ(v). Computed from erfc(|v|/√2)
// by the Chebyshev fit erfc(z) = t·exp(-z² + P(t)), t = 1/(1 + z/2), P of degree 9, whose fractional
// error is below 1.2e-7 for every z >= 0 (Press et al., Numerical Recipes, 2nd ed., §6.2 erfcc); then
// Φ = erfc/2 for v < 0 and 1 - erfc/2 otherwise. So v·Φ(v) keeps its relative accuracy for negative v,
// where the textbook 0.5·v·(1 + erff(v/√2)) cancels as erf nears -1, and it takes fewer instructions
// than erff (accuracy and speed of both measured on the H100: benchmarks/RESULTS.md, seventh session).
// NaN stays NaN; Φ(+inf) = 1, Φ(-inf) = 0.
__device__ __forceinline__ float normal_cdf(float v) {
    const float z = fabsf(v) * 0.7071067811865476f;
    const float t = rcp_ftz(fmaf(0.5f, z, 1.f));
    float p = 0.17087277f;
    p = fmaf(p, t, -0.82215223f);
    p = fmaf(p, t, 1.48851587f);
    p = fmaf(p, t, -1.13520398f);
    p = fmaf(p, t, 0.27886807f);
    p = fmaf(p, t, -0.18628806f);
    p = fmaf(p, t, 0.09678418f);
    p = fmaf(p, t, 0.37409196f);
    p = fmaf(p, t, 1.00002368f);
    p = fmaf(p, t, -1.26551223f);
    const float half_erfc = 0.5f * t * exp2_ftz((p - z * z) * 1.4426950408889634f);
    return v < 0.f ? half_erfc : 1.f - half_erfc;
}

// ACTS is a bit mask of the codes a kernel compiles (bit i: code i). The epilogue is inlined for every
// accumulator a thread holds, so a GEMM with 128 accumulators per thread that compiled all five ran
// markedly slower (benchmarks/RESULTS.md, linear): kernels compile only the codes their op offers.
// The activation codes (libnn/ops/activations.py reads them from here).
constexpr int ACT_NONE = 0;
constexpr int ACT_RELU = 1;
constexpr int ACT_RELU6 = 2;
constexpr int ACT_GELU = 3;       // the tanh approximation
constexpr int ACT_SILU = 4;
constexpr int ACT_GELU_ERF = 5;   // the exact 0.5·v·(1 + erf(v/√2))

enum : unsigned { ACT_ALL = 0x3f, ACT_CONV = 0x1f, ACT_LINEAR = (1u << 0) | (1u << 1) | (1u << 3) };

template <unsigned ACTS = ACT_ALL>
__device__ __forceinline__ float apply_act(float v, int act) {
    // comparisons written so that NaN falls through unchanged (fmaxf would turn it into 0)
    if ((ACTS & 2u) && act == ACT_RELU) return v < 0.f ? 0.f : v;
    if ((ACTS & 4u) && act == ACT_RELU6) return v < 0.f ? 0.f : (v > 6.f ? 6.f : v);
    if ((ACTS & 8u) && act == ACT_GELU) {  // 0.5·v·(1 + tanh(z)) written as v·sigmoid(2z): where tanh(z) ≈ -1,
        // 1 + tanhf(z) cancels to a few bits (2e-3 relative error seen at v ≈ -4 in fp32); this does not
        const float z = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        return fdiv_full(v, 1.f + expf(-2.f * z));
    }
    if ((ACTS & 16u) && act == ACT_SILU) return fdiv_full(v, 1.f + expf(-v));
    if ((ACTS & 32u) && act == ACT_GELU_ERF) return v * normal_cdf(v);
    return v;
}

// The helpers below were added for kernels/attention.cu.

// ldmatrix with .trans: each 8x8 matrix arrives transposed, so a [k][n] row-major tile in shared memory
// (attention's V: keys x head dim) loads straight into mma's col-major B fragments
__device__ __forceinline__ void ldsm_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
// two floats rounded (to nearest) into one word of packed fp16 / bf16, lo in the low half: an mma A
// fragment from fp32 accumulators, or two adjacent output elements
template <bool BF16>
__device__ __forceinline__ u32 pack_f32x2(float lo, float hi) {
    u32 r;
    if constexpr (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}


// the sum of v over the warp: a butterfly (__shfl_xor_sync), which leaves every lane the bitwise-same sum
// (fp addition commutes) in a fixed order
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Programmatic dependent launch (sm_90 and newer; no-ops below). A kernel launched with the programmatic
// stream serialization attribute (runtime/launch.py, programmatic=True) may start before the kernel ahead of it
// in the stream has finished: `pdl_wait` blocks until that kernel has completed and its writes are visible, so a
// dependent calls it before reading what the kernel ahead wrote or writing anything it may still read (reading
// what no kernel writes, a weight, may come first). `pdl_launch_dependents` lets such a dependent start now.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// L2 prefetch of what the next kernel reads first (runtime/l2_prefetch.py; sm_90 and newer, nothing below): a
// decode GEMV, which streams its weight once, also brings the first bytes of the next projection's weight into
// L2, so that DRAM stays busy while this kernel drains and the next one starts. Caller `part` of `parts`
// prefetches its share of [p, p + bytes), narrowed to whole 16-byte units (the bulk prefetch's), with bulk
// prefetches of at most L2_PREFETCH_PIECE bytes (null or 0 bytes: nothing). p must be what no kernel in flight
// writes (a weight).
constexpr int L2_PREFETCH_BYTES = 8388608;  // the budget a kernel prefetches for the next one (8 MiB, measured)
constexpr int L2_PREFETCH_PIECE = 65536;    // bytes per cp.async.bulk.prefetch
__device__ __forceinline__ void l2_prefetch_share(const void* p, i64 bytes, int part, int parts) {
#if __CUDA_ARCH__ >= 900
    if (!p) return;
    const u64 lead = (16 - ((u64)p & 15)) & 15;
    if (bytes <= (i64)lead) return;
    p = (const char*)p + lead;
    bytes = (bytes - (i64)lead) & ~(i64)15;
    const i64 share = ((bytes + parts - 1) / parts + 15) / 16 * 16, begin = (i64)part * share;
    const i64 end = begin + share < bytes ? begin + share : bytes;
    for (i64 o = begin; o < end; o += L2_PREFETCH_PIECE) {
        const u32 n = (u32)(end - o < L2_PREFETCH_PIECE ? end - o : L2_PREFETCH_PIECE);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"((const char*)p + o), "r"(n) : "memory");
    }
#endif
}
// A kernel's whole hint, the two ranges of its prefetch0/prefetch1 parameters, caller `part` of `parts`.
__device__ __forceinline__ void l2_prefetch_hint(const void* p0, i64 bytes0, const void* p1, i64 bytes1, int part,
                                                 int parts) {
    l2_prefetch_share(p0, bytes0, part, parts);
    l2_prefetch_share(p1, bytes1, part, parts);
}

}  // namespace libnn
