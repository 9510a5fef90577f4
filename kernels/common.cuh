/*
libnn's shared device code for kernels/*.cu: storage types, fp16/bf16 conversions and the tensor-core
primitives as inline PTX (so that no CUDA toolkit header is needed and NVRTC from any wheel compiles
the kernels), dtype traits, and the activation every fused epilogue applies.

Activation codes (libnn/ops/activations.py KERNEL_CODES): 0 none, 1 relu, 2 relu6, 3 gelu (tanh
approximation), 4 silu. NaN propagates through each of them.
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
// 32-bit shared-window address, what cp.async / ldmatrix take
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16-byte global->shared async copy; src_bytes = 0 zero-fills the destination without reading src
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
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

// dtype traits: storage type + conversions to/from the fp32 compute type
struct dt_f32 {
    typedef float T;
    enum { bf16 = 0 };
    static __device__ __forceinline__ float ld(T v) { return v; }
    static __device__ __forceinline__ T st(float v) { return v; }
};
struct dt_f16 {
    typedef u16 T;
    enum { bf16 = 0 };
    static __device__ __forceinline__ float ld(T v) { return f16_to_f32(v); }
    static __device__ __forceinline__ T st(float v) { return f32_to_f16(v); }
};
struct dt_bf16 {
    typedef u16 T;
    enum { bf16 = 1 };
    static __device__ __forceinline__ float ld(T v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ T st(float v) { return f32_to_bf16(v); }
};


__device__ __forceinline__ float apply_act(float v, int act) {
    // comparisons written so that NaN falls through unchanged (fmaxf would turn it into 0)
    if (act == 1) return v < 0.f ? 0.f : v;
    if (act == 2) return v < 0.f ? 0.f : (v > 6.f ? 6.f : v);
    if (act == 3) return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    if (act == 4) return v / (1.f + expf(-v));
    return v;
}

}  // namespace libnn
