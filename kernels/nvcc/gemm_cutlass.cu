/*
linear's GEMM with the exact GELU in its epilogue, on CUTLASS 3 (NVIDIA's CUDA C++ template library):
y = gelu_erf(x @ w.T + bias + residual) in one kernel, for the one epilogue cuBLASLt lacks (its GELU
epilogues compute the tanh approximation only). The mainloop is CUTLASS's sm90 TMA + wgmma
warp-specialized collective; the epilogue is its visitor tree LinCombPerColBiasEltAct with libnn's own
activation functor, v·Φ(v) with Φ from kernels/common.cuh's normal_cdf, the same function every libnn
kernel computes for "gelu_erf".

Limits: sm_90a only (wgmma and TMA; built with -arch=sm_90a, loaded on compute capability 9.0);
fp16 and bf16 with fp32 accumulation; x (M, K), w (N, K), residual and y (M, N) row-major and bias (N,)
contiguous, with K and N multiples of 8 and 16-byte aligned pointers (TMA's 16-byte rows and boxes).

Unlike the other kernel files this one is compiled by nvcc, not NVRTC, into a shared library with a
small host entry point: a CUTLASS kernel's parameters (TMA descriptors among them) are built by its
host-side adapter, which only C++ can instantiate. Its build options and launch contract live in
libnn/backends/cutlass.py; the entry points are below.

The tiles: TILE_M x TILE_N x 64 with clusters of CLUSTER_M x 1 and the cooperative schedule (two
consumer warp groups share each tile), built per tile (the build's macros). Two builds are used
(libnn/backends/cutlass.py TILES, which picks one per shape): 128x256 in clusters of 2x1, of six tile and
schedule choices timed on the H100 (ping-pong 128x128 and 64x256, cooperative 256x128 and 128x256
without clusters among them) the fastest, or at most 5.1% behind, at every large BERT FFN shape
(benchmarks/RESULTS.md, ninth session); and 128x192 without clusters, for the shapes where 128x256's
last wave of tiles would leave most SMs idle (MiniLM's FFN at 4096x1536x384: 192 tiles of 128x256 on
132 SMs are 1.45 waves, the second more than half empty, where 256 tiles of 128x192 fill two; benchmarks/RESULTS.md,
eleventh session). ELEMENT (cutlass::half_t or cutlass::bfloat16_t), TILE_M, TILE_N and CLUSTER_M are
the build's macros: one shared library per dtype and tile.
*/
#include <cstdio>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "common.cuh"

#ifndef ELEMENT
#error "build with -DELEMENT=cutlass::half_t or -DELEMENT=cutlass::bfloat16_t"
#endif
#if !defined(TILE_M) || !defined(TILE_N) || !defined(CLUSTER_M)
#error "build with -DTILE_M, -DTILE_N and -DCLUSTER_M (the output tile and its cluster along M)"
#endif

using namespace cute;

// The exact GELU, v·Φ(v), as the epilogue's activation (CUTLASS applies it to fp32 fragments).
template <class T>
struct GeluErf {
    CUTLASS_HOST_DEVICE T operator()(T const& v) const {
#ifdef __CUDA_ARCH__
        const float f = static_cast<float>(v);
        return T(f * libnn::normal_cdf(f));
#else
        return v;  // never called on the host; the adapter instantiates the type there
#endif
    }
};
template <class T, int N>
struct GeluErf<cutlass::Array<T, N>> {
    CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v) const {
        cutlass::Array<T, N> y;
        GeluErf<T> act;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < N; ++i) y[i] = act(v[i]);
        return y;
    }
};

using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
using ClusterShape = Shape<Int<CLUSTER_M>, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

using Element = ELEMENT;
constexpr int kAlignment = 8;  // elements in 16 bytes
using LayoutX = cutlass::layout::RowMajor;     // x (M, K)
using LayoutW = cutlass::layout::ColumnMajor;  // w (N, K) row-major is B = w.T (K, N) column-major
using LayoutY = cutlass::layout::RowMajor;     // residual and y (M, N)

// y = GeluErf(beta·residual + (alpha·acc + bias)), bias broadcast down the columns
using Fusion = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<GeluErf, Element, float, Element, Element, float>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    Element, LayoutY, kAlignment, Element, LayoutY, kAlignment, EpilogueSchedule, Fusion>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, LayoutX, kAlignment, Element, LayoutW, kAlignment, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static int write_error(char* error, int capacity, const char* what, const char* detail) {
    if (error && capacity > 0) snprintf(error, capacity, "%s: %s", what, detail);
    return 1;
}

static int multiprocessors() {  // read once: the adapter would query the device on every call
    static int count = 0;
    if (count == 0) {
        int device = 0;
        cudaGetDevice(&device);
        count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    }
    return count;
}

// Launch y = gelu_erf(x @ w.T + bias + residual) on `stream`; bias and residual may be null (none).
// Returns 0, or 1 with CUTLASS's or the CUDA runtime's message in `error`. Thread-safe: no state but
// the multiprocessor count, and a fresh adapter per call.
extern "C" int libnn_gemm_gelu_erf(const void* x, const void* w, const void* bias, const void* residual, void* y,
                                   int M, int N, int K, void* stream, char* error, int capacity) {
    using StrideX = typename Gemm::GemmKernel::StrideA;
    using StrideW = typename Gemm::GemmKernel::StrideB;
    using StrideY = typename Gemm::GemmKernel::StrideD;
    const StrideX stride_x = cutlass::make_cute_packed_stride(StrideX{}, make_shape(M, K, 1));
    const StrideW stride_w = cutlass::make_cute_packed_stride(StrideW{}, make_shape(N, K, 1));
    const StrideY stride_y = cutlass::make_cute_packed_stride(StrideY{}, make_shape(M, N, 1));
    cutlass::KernelHardwareInfo hw_info;
    hw_info.sm_count = multiprocessors();
    // Without a residual, C is y itself with beta = 0: the epilogue then reads no C at all.
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const Element*>(x), stride_x, static_cast<const Element*>(w), stride_w},
        {{}, static_cast<const Element*>(residual ? residual : y), stride_y, static_cast<Element*>(y), stride_y},
        hw_info};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.f;
    fusion.beta = residual ? 1.f : 0.f;
    fusion.bias_ptr = static_cast<const Element*>(bias);

    Gemm gemm;
    if (Gemm::get_workspace_size(args) != 0)
        return write_error(error, capacity, "CUTLASS", "this configuration needs a workspace");
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
        return write_error(error, capacity, "CUTLASS can_implement", cutlassGetStatusString(status));
    status = gemm.initialize(args, nullptr, static_cast<cudaStream_t>(stream));
    if (status != cutlass::Status::kSuccess)
        return write_error(error, capacity, "CUTLASS initialize", cutlassGetStatusString(status));
    status = gemm.run(static_cast<cudaStream_t>(stream));
    if (status != cutlass::Status::kSuccess) {
        const cudaError_t launch = cudaGetLastError();
        return write_error(error, capacity, cutlassGetStatusString(status),
                           launch == cudaSuccess ? "no CUDA error recorded" : cudaGetErrorString(launch));
    }
    return 0;
}
