"""linear: y = act(x @ w.T + b + residual), the fully connected layer as one GEMM with a fused epilogue.

x is (..., K), w is (N, K) (PyTorch's (out_features, in_features)), b is (N,) or None, residual is None
or an array of the output's shape (..., N), added before the activation (the ResNet convention; a
transformer's post-norm skip connection, `x + linear(h)`, is `linear(h, w, b, residual=x)`).
Activations: None, "relu", "gelu", the tanh approximation 0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³)))
that cuBLASLt's epilogue computes, and "gelu_erf", the exact GELU of PyTorch's nn.GELU() and BERT.
"gelu" is never substituted for "gelu_erf".

Paths, in `auto` order (fastest first on the H100, see `libnn bench linear`):
- gemv:      one row of x (M = 1: a batch-1 decode step), fp16/bf16, K a multiple of 8 to 24576, x and
             w 16-byte aligned, w a weight (no kernel in flight writes it: the kernel reads w before it
             waits for the kernel ahead, see kernels/gemv.cu): kernels/gemv.cu, a bandwidth kernel that
             streams w once (each warp whole rows, fp32 FFMA, a fixed summation order) with bias,
             residual and every activation in its epilogue. At a decode step's shapes it matches or beats
             cuBLASLt, and a chain of them with the norms and SwiGLU fused (ops/rms_norm_linear.py) beats
             cuBLASLt's chain (benchmarks/RESULTS.md). It alone acts on `prefetch` (below).
- cutlass:   "gelu_erf" alone, on Hopper: CUTLASS 3's sm90 TMA + wgmma GEMM with bias, residual and the
             exact GELU in its epilogue (kernels/nvcc/gemm_cutlass.cu, built by nvcc at first use; needs
             the nvidia-cutlass headers and nvcc). One kernel where cuBLASLt needs a second pass.
             fp16/bf16, N and K multiples of 8, 16-byte aligned arrays (TMA). Tried last when its tiles
             do not fill the GPU (small M: an encoder at batch 1), where cuBLASLt's GEMM + pass wins.
- cublaslt:  cuBLASLt through nvmath-python: D = epilogue(A·B + β·C + bias) in one call, with the
             residual as C (β = 1) and bias, relu or gelu in the epilogue. cuBLASLt has no erf GELU, so
             "gelu_erf" is the GEMM (with the residual) followed by one memory-bound pass that adds the
             bias and applies the GELU (kernels/epilogue.cu bias_act_rows). Where cutlass cannot run,
             still first for "gelu_erf": at BERT's FFN shapes the GEMM + pass beat cudnn's fused kernel
             (benchmarks/RESULTS.md).
- cudnn:     one cuDNN frontend graph, matmul → add(bias) → add(residual) → activation, which cuDNN's
             runtime-fusion engines compile into one kernel, the exact GELU composed from ERF and
             arithmetic nodes (see exact_gelu). fp16/bf16 with N and K multiples of 8; a graph cuDNN
             declines raises LibraryError, and `auto` goes on to the next path with a FallbackWarning.
- custom:    kernels/gemm.cu, tensor cores (mma.sync) for fp16/bf16, tiled FFMA for fp32; bias, residual
             and activation in the kernel's epilogue, "gelu_erf" included for fp16/bf16 (kernels of
             their own, gemm3_mma_gelu_erf_*); fp32 "gelu_erf" takes the GEMM + pass route.
- reference: NumPy in float64, rounded to the input dtype once at the end.

fp16/bf16 accumulate in fp32 on the GPU paths. fp32 is exact fp32 unless `allow_tf32=True`, which
lets cuBLASLt use TF32 tensor cores (about 1e-3 relative error instead of 1e-6).

`prefetch` is a hint for a chain of decode GEMVs: the array (or up to two arrays) the next kernel reads
first, a weight, which the gemv path prefetches into L2 behind its own first loads (runtime/l2_prefetch.py
says what it takes). It changes no result, and the other paths ignore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.backends import cublaslt
from libnn.backends import cudnn as cudnn_backend
from libnn.backends import cutlass
from libnn.ops import activations
from libnn.registry import Op
from libnn.runtime import contracts, l2_prefetch, launch, memory
from libnn.runtime import device as device_info
from libnn.runtime.arrays import (allocator, array_module, as_array, contiguous, device_of, refuse_misaligned,
                                  signature, stream_key)

ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
FUSED_ACTIVATIONS = (None, "relu", "gelu")  # what cuBLASLt's epilogues compute (auto's first path)
GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("linear", order=("gemv", "cutlass", "cublaslt", "cudnn", "custom", "reference"))


@dataclass(frozen=True)
class LinearProblem:
    """Everything that decides how a linear call runs; also the plan-cache key."""
    M: int
    N: int
    K: int
    dtype: str            # short name: fp16, bf16, fp32, fp64
    has_bias: bool
    activation: str | None
    allow_tf32: bool
    device: str           # "cpu" or "gpu:N"
    has_residual: bool = False
    # bytes of each array of the prefetch hint (runtime/l2_prefetch.py); not part of equality or the hash: a
    # library plan keyed by the problem is the same with and without a hint
    prefetch: tuple[int, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        epilogue = "+".join(filter(None, ["bias" if self.has_bias else None,
                                          "residual" if self.has_residual else None, self.activation])) or "no epilogue"
        return f"linear M={self.M} N={self.N} K={self.K} {self.dtype} ({epilogue})"

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes((self.M, self.N), dtypes.parse(self.dtype))


def linear_problem(x, w, b, activation, allow_tf32: bool, residual=None, prefetch: tuple = ()) -> LinearProblem:
    """The LinearProblem linear(x, w, b, activation=, allow_tf32=, residual=, prefetch=) solves, after checking
    every argument as linear does (arrays already, the prefetch hint a tuple of them); for tools that run
    one kernel version themselves."""
    if w.ndim != 2:
        raise ValueError(f"linear: w must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.ndim < 1:
        raise ValueError("linear: x must have at least 1 dimension (..., in_features), got a scalar")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: x has {x.shape[-1]} features in its last dimension but w has {K} "
                         f"(w is (out_features, in_features) = {tuple(w.shape)}, x is {tuple(x.shape)})")
    if b is not None and tuple(b.shape) != (N,):
        raise ValueError(f"linear: b must have shape ({N},) to match w's out_features, got {tuple(b.shape)}")
    out_shape = (*x.shape[:-1], N)
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"linear: residual must have the output's shape {out_shape} (x's leading dimensions, "
                         f"w's out_features), got {tuple(residual.shape)}")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"linear: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    for name, a in (("w", w), ("b", b), ("residual", residual)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"linear: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    activations.check("linear", activation, ACTIVATIONS)
    if not isinstance(allow_tf32, (bool, np.bool_)):  # "no" would mean yes
        raise TypeError(f"linear: allow_tf32 must be True or False, got {type(allow_tf32).__name__} {allow_tf32!r}")
    device = device_of({"x": x, "w": w, "b": b, "residual": residual}, "linear")
    return LinearProblem(M=math.prod(x.shape[:-1]), N=N, K=K, dtype=dtypes.short_name(x.dtype),
                         has_bias=b is not None, activation=activation, allow_tf32=bool(allow_tf32),
                         device=device, has_residual=residual is not None,
                         prefetch=l2_prefetch.prefetch_bytes("linear", prefetch, device))


def linear(x: Any, w: Any, b: Any = None, activation: str | None = None, *, residual: Any = None,
           allow_tf32: bool = False, prefetch: Any = None, path: str = "auto") -> Any:
    """act(x @ w.T + b + residual) for x (..., K), w (N, K), b (N,) or None, residual (..., N) or None;
    returns a new (..., N) array in x's dtype, on x's device (the residual is read, never written).
    `prefetch`: None, or what the next kernel reads first (the module docstring). `path` is "auto" or one
    of `libnn.paths("linear")`."""
    x, w = as_array(x, "linear", "x"), as_array(w, "linear", "w")
    b = None if b is None else as_array(b, "linear", "b")
    r = None if residual is None else as_array(residual, "linear", "residual")
    key = (signature(x), signature(w), None if b is None else signature(b), None if r is None else signature(r),
           activation, allow_tf32, path, stream_key())
    if prefetch is None:
        return op.call(key, linear_problem, path, x, w, b, r, checks=(x, w, b, activation, allow_tf32, r))
    pf = l2_prefetch.hinted_arrays("linear", prefetch)
    return op.call((*key, *map(signature, pf)), linear_problem, path, x, w, b, r, pf,
                   checks=(x, w, b, activation, allow_tf32, r, pf))


def _as_matrices(gemm, problem: LinearProblem, x, w, b, r):
    """`gemm` (a runner for C-contiguous (M, K), (N, K), (N,), (M, N) arrays) wrapped for the signature
    of x, w, b and r: x and r of any rank or strides are made contiguous matrices and the result given
    x's leading dimensions. The wrapper is only added where the signature needs it."""
    if (x.ndim == 2 and x.flags.c_contiguous and w.flags.c_contiguous and (b is None or b.flags.c_contiguous)
            and (r is None or r.flags.c_contiguous)):
        return gemm
    lead = x.shape[:-1]

    def run(x, w, b, r, *pf):
        y = gemm(contiguous(x).reshape(problem.M, problem.K), contiguous(w), None if b is None else contiguous(b),
                 None if r is None else contiguous(r).reshape(problem.M, problem.N), *pf)
        return y.reshape(*lead, problem.N)
    return run


def degenerate_result(problem: Any, x: Any, b: Any, r: Any) -> Any:
    """The result when M, N or K is 0, for a problem with M, N and activation (linear's, linear_fp8's):
    no GEMM to run."""
    xp = array_module(x)
    lead = x.shape[:-1]
    if problem.M == 0 or problem.N == 0:
        return xp.empty((*lead, problem.N), x.dtype)
    # K == 0, an empty sum: every output is act(bias + residual)
    v = xp.zeros((problem.M, problem.N), xp.float64 if xp is np else xp.float32)
    if b is not None:
        v += b.astype(v.dtype)
    if r is not None:
        v += r.reshape(problem.M, problem.N).astype(v.dtype)
    return activations.apply(v, problem.activation).astype(x.dtype).reshape(*lead, problem.N)


def _gpu_support(problem: LinearProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# cuBLASLt computes D = epilogue(alpha·A·B + beta·C + bias): the bias is "added before applying the final
# postprocessing" (cublasLtEpilogue_t) and nvmath's matmul is documented as F(alpha·a @ b + beta·c) with F
# the epilog, so C = residual, beta = 1 is act(x @ w.T + b + residual), the op's order, for every fused
# activation. (test_linear_gpu's residual tests check this against the reference on the device.)
@op.path("cublaslt", kind="library", device="gpu", requires=("nvmath",), supports=_gpu_support,
         binds=True)
def _cublaslt(problem: LinearProblem, x, w, b, r, pf=()):
    return _bind_gpu(cublaslt.bind_linear, problem.activation in FUSED_ACTIVATIONS, problem, x, w, b, r)


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: LinearProblem, x, w, b, r, pf=()):
    return _bind_gpu(bind_custom, _custom_fuses(problem), problem, x, w, b, r)


def _bind_gpu(bind_gemm, fused: bool, problem: LinearProblem, x, w, b, r, prefetches: bool = False):
    """The runner of a GPU path: `bind_gemm(problem, x, w, b, r)` binds the GEMM, with bias, residual and
    activation in its epilogue when `fused`; otherwise the GEMM adds the residual alone and one pass of
    kernels/epilogue.cu adds the bias and applies the activation. Empty problems need no GEMM. With a
    prefetch hint the runner takes it last, and passes it on to the GEMM's runner where it `prefetches`."""
    runner = _gpu_runner(bind_gemm, fused, problem, x, w, b, r)
    return runner if prefetches else l2_prefetch.ignoring_hint(runner, problem.prefetch)


def _gpu_runner(bind_gemm, fused: bool, problem: LinearProblem, x, w, b, r):
    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return lambda x, w, b, r, *pf: degenerate_result(problem, x, b, r)
    matrices = (contiguous(x).reshape(problem.M, problem.K), contiguous(w), None if b is None else contiguous(b),
                None if r is None else contiguous(r).reshape(problem.M, problem.N))
    if fused:
        return _as_matrices(bind_gemm(problem, *matrices), problem, x, w, b, r)
    gemm = bind_gemm(replace(problem, has_bias=False, activation=None), matrices[0], matrices[1], None, matrices[3])
    epilogue = bind_epilogue_pass(problem.dtype, problem.M, problem.N, problem.activation)

    def gemm_then_pass(x, w, b, r):
        y = gemm(x, w, None, r)
        epilogue(y, b)
        return y
    return _as_matrices(gemm_then_pass, problem, x, w, b, r)


def bind_epilogue_pass(dtype: str, rows: int, N: int, activation: str | None):
    """run(y, b): y = act(y + b) in place for a row-major (rows, N) y and a bias b (N,) or None, one pass
    of kernels/epilogue.cu's bias_act_rows (16-byte accesses where N and the pointers allow)."""
    total = rows * N
    vector = 16 // dtypes.parse(dtype).itemsize
    sms = device_info.multiprocessors(device_info.current_device_id())
    blocks = max(1, min(-(-total // (256 * vector)), 32 * sms))
    return launch.bind("epilogue.cu", epilogue_pass_kernel(dtype, activation), (blocks,), (256,),
                       _BIAS_ACT_ROWS.pack(y=launch.ARRAY, bias=launch.ARRAY, total=total, N=N))


def epilogue_pass_kernel(dtype: str, activation: str | None) -> str:
    """The bias_act_rows kernel of `dtype` with `activation` compiled in."""
    return f"bias_act_rows_{activation or 'none'}_{dtypes.KERNEL_SUFFIX[dtype]}"


# --- cutlass path: kernels/nvcc/gemm_cutlass.cu ------------------------------------------------------
CUTLASS_DTYPES = ("fp16", "bf16")


def _cutlass_support(problem: LinearProblem) -> str | None:
    if problem.activation != "gelu_erf":
        return "only the gelu_erf epilogue (cuBLASLt fuses every other activation)"
    if problem.dtype not in CUTLASS_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(CUTLASS_DTYPES)})"
    if problem.N % 8 or problem.K % 8:
        return (f"N and K must be multiples of 8 (TMA's 16-byte rows of {problem.dtype}), got N={problem.N} "
                f"K={problem.K}")
    return cutlass.missing(device_info.gpu_index(problem.device))


def bind_cutlass(problem: LinearProblem, x, w, b, r=None):
    """The runner of the CUTLASS GEMM for C-contiguous (M, K), (N, K), (N,) and (M, N) CuPy arrays (b and
    r None where the problem has none). LibraryError if an array is not 16-byte aligned (TMA's boxes)."""
    refuse_misaligned("CUTLASS's TMA loads need 16-byte aligned buffers", {"x": x, "w": w, "b": b, "residual": r})
    gemm = cutlass.bind_gemm_gelu_erf(problem.dtype, problem.M, problem.N, problem.K, _cutlass_tile(problem))
    shape, dtype = (problem.M, problem.N), x.dtype
    new = allocator(shape, dtype)

    def run(x, w, b, r):
        y = new()
        gemm(x, w, b, r, y)
        return y
    return run


def _cutlass_tile(problem: LinearProblem) -> cutlass.Tile:
    return cutlass.tile_for(problem.M, problem.N, _multiprocessors(problem))


def _multiprocessors(problem: LinearProblem) -> int:
    return device_info.multiprocessors(device_info.gpu_index(problem.device))


def _cutlass_slower(problem: LinearProblem) -> str | None:
    """Fewer output tiles than SMs: the tiles leave SMs idle, where cuBLASLt picks a kernel for the shape
    (smaller tiles, split K). Measured on the H100: the encoders at batch 1 (FFN rows 4..128) ran 0.03-0.09
    ms slower per forward on cutlass than on cuBLASLt's GEMM + pass (benchmarks/RESULTS.md)."""
    sms = _multiprocessors(problem)
    tile = cutlass.tile_for(problem.M, problem.N, sms)
    tiles = tile.count(problem.M, problem.N)
    if tiles < sms:
        return f"{tiles} output tiles of {tile} fill less than the GPU's {sms} SMs"
    return None


@op.path("cutlass", kind="library", device="gpu", requires=("cutlass_library",), supports=_cutlass_support,
         slower=_cutlass_slower, binds=True)
def _cutlass(problem: LinearProblem, x, w, b, r, pf=()):
    return _bind_gpu(bind_cutlass, True, problem, x, w, b, r)


# --- cudnn path: one cuDNN frontend graph -------------------------------------------------------------
CUDNN_DTYPES = ("fp16", "bf16")
# The activations linear_graph_builder maps to a pointwise node (conv2d's builder shows the next ones:
# silu as swish, relu6 as relu with upper_clip=6).
CUDNN_ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
# The uids of the tensors in linear_graph_builder's graph, for a variant pack (bias and residual only
# when the problem has them).
UID_X, UID_W, UID_BIAS, UID_RESIDUAL, UID_Y = range(1, 6)
UID_INV_SQRT2, UID_HALF, UID_ONE = range(6, 9)  # exact_gelu's constants
UID_EXACT_GELU = [UID_INV_SQRT2, UID_HALF, UID_ONE]


def _cudnn_support(problem: LinearProblem) -> str | None:
    if problem.dtype not in CUDNN_DTYPES:
        return (f"dtype {problem.dtype} is not supported (supported: {', '.join(CUDNN_DTYPES)}; cuDNN's fused "
                "matmul engines run on tensor cores)")
    if problem.activation not in CUDNN_ACTIVATIONS:
        return f"activation {problem.activation!r} has no cuDNN pointwise mode here"
    if problem.N % 8 or problem.K % 8:
        # Conservative, not measured: cudnn-frontend's matmul fuzzer keeps N and K to multiples of 8 (16-byte
        # rows) outside its unaligned stress test, which skips what cuDNN declines. cuBLASLt and custom take
        # any shape, so refusing here costs a warning-free route to them, not a result.
        return f"N and K must be multiples of 8 (16-byte rows of {problem.dtype}), got N={problem.N} K={problem.K}"
    return None


def cudnn_graph_key(problem: LinearProblem) -> tuple:
    """Everything the graph depends on. The strides are not in it because they follow from M, N and K:
    the runner passes C-contiguous x (M, K), w (N, K), bias (N,), residual and y (M, N)."""
    return ("linear", problem.M, problem.N, problem.K, problem.dtype, problem.has_bias, problem.has_residual,
            problem.activation)


def _cudnn_uids(problem: LinearProblem) -> list[int]:
    """The variant pack in the order the runner passes its arrays: x, w, [bias], [residual], y,
    [exact_gelu's constants]."""
    return ([UID_X, UID_W] + [UID_BIAS] * problem.has_bias + [UID_RESIDUAL] * problem.has_residual + [UID_Y]
            + UID_EXACT_GELU * (problem.activation == "gelu_erf"))


def linear_graph_builder(problem: LinearProblem):
    """The builder (handle -> cuDNN graph, not yet validated) of x @ w.T → + bias → + residual →
    activation → y, one node per line, as a batch of one: x is [1, M, K] row-major; w, stored (N, K)
    row-major, is the matmul's B = w.T, [1, K, N] with strides [N·K, 1, K] (a column-major B, read in
    place, as cudnn-frontend's test_matmul_fuzzer lays out COL_MAJOR_PACKED operands); the bias is
    [1, 1, N], broadcast over the rows; the residual and y are [1, M, N] row-major. Everything between
    the matmul and y is virtual fp32: one kernel writes y."""
    def build(handle):
        import cudnn

        p, io, f32 = problem, cudnn_backend.data_type(problem.dtype), cudnn.data_type.FLOAT
        rows = [p.M * p.N, p.N, 1]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        x = g.tensor(dim=[1, p.M, p.K], stride=[p.M * p.K, p.K, 1], data_type=io, uid=UID_X)
        w_t = g.tensor(dim=[1, p.K, p.N], stride=[p.N * p.K, 1, p.K], data_type=io, uid=UID_W)
        y = g.matmul(A=x, B=w_t, compute_data_type=f32)
        if p.has_bias:
            y = g.add(a=y, b=g.tensor(dim=[1, 1, p.N], stride=[p.N, p.N, 1], data_type=io, uid=UID_BIAS),
                      compute_data_type=f32)
        if p.has_residual:
            y = g.add(a=y, b=g.tensor(dim=[1, p.M, p.N], stride=rows, data_type=io, uid=UID_RESIDUAL),
                      compute_data_type=f32)
        if p.activation == "relu":
            y = g.relu(input=y, compute_data_type=f32)
        elif p.activation == "gelu":  # cuDNN's GELU_APPROX_TANH_FWD is libnn's "gelu"
            y = g.gelu_approx_tanh(input=y, compute_data_type=f32)
        elif p.activation == "gelu_erf":
            y = exact_gelu(g, y)
        y.set_output(True).set_data_type(io).set_stride(rows).set_uid(UID_Y)
        return g
    return build


def exact_gelu(g, v):
    """0.5·v·(1 + erf(v/√2)) composed from cuDNN's ERF and arithmetic nodes, the constants passed by
    value. Not cuDNN's GELU_FWD node: in the matmul runtime-fusion engine of cuDNN 9.19 on the H100 it
    computes the tanh approximation (-3.637e-3 at v = -3, where the exact GELU is -4.050e-3)."""
    import cudnn

    f32 = cudnn.data_type.FLOAT

    def constant(uid):
        return g.tensor(dim=[1, 1, 1], stride=[1, 1, 1], data_type=f32, is_pass_by_value=True, uid=uid)
    erf = g.erf(input=g.mul(a=v, b=constant(UID_INV_SQRT2), compute_data_type=f32), compute_data_type=f32)
    half_v = g.mul(a=v, b=constant(UID_HALF), compute_data_type=f32)
    return g.mul(a=half_v, b=g.add(a=erf, b=constant(UID_ONE), compute_data_type=f32), compute_data_type=f32)


def _exact_gelu_constants() -> list:
    """The pass-by-value inputs of `exact_gelu`, in the order of UID_EXACT_GELU."""
    return [cudnn_backend.host_scalar(c) for c in (math.sqrt(0.5), 0.5, 1.0)]


def bind_cudnn(problem: LinearProblem, x, w, b, r=None):
    """The runner of the cuDNN graph of `problem` for C-contiguous (M, K), (N, K), (N,) and (M, N) CuPy
    arrays of this signature (b and r None where the problem has none). LibraryError where cuDNN
    declines the graph (no engine for the shape or the fusion; remembered, so a later bind fails fast)
    or an array is not 16-byte aligned (the frontend declares every tensor so)."""
    refuse_misaligned("cuDNN needs 16-byte aligned buffers", {"x": x, "w": w, "b": b, "residual": r})
    execute = cudnn_backend.graph_for(cudnn_graph_key(problem), linear_graph_builder(problem),
                                      problem.describe).executor(_cudnn_uids(problem))
    shape, dtype = (problem.M, problem.N), x.dtype
    new = allocator(shape, dtype)
    constants = _exact_gelu_constants() if problem.activation == "gelu_erf" else []

    def run(x, w, b, r):
        y = new()
        # b and r are None exactly when not in the graph
        execute(*[a for a in (x, w, b, r) if a is not None], y, *constants)
        return y
    return run


@op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_cudnn_support, binds=True)
def _cudnn(problem: LinearProblem, x, w, b, r, pf=()):
    return _bind_gpu(bind_cudnn, True, problem, x, w, b, r)


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LinearProblem, x, w, b, r, pf=()):
    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return degenerate_result(problem, x, b, r)
    M, N, K = problem.M, problem.N, problem.K
    # float64 copies of x and w, the float64 product (and the residual's copy), the result
    nbytes = 8 * (M * K + N * K + M * N * (2 if r is not None else 1)) + M * N * x.dtype.itemsize
    memory.require(nbytes, "cpu", "linear", f"the float64 reference of x @ w.T (M={M}, N={N}, K={K})")
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if b is not None:
        y += b.astype(np.float64)
    if r is not None:
        y += r.astype(np.float64).reshape(y.shape)
    return activations.apply(y, problem.activation).astype(x.dtype)


# --- gemv path: kernels/gemv.cu --------------------------------------------------------------------
_GEMV = contracts.params("gemv.cu", "GEMV_PARAMS")  # every gemv kernel's parameters (16-bit weights)
_GEMV_E4M3 = contracts.params("gemv.cu", "GEMV_E4M3_PARAMS")  # and with E4M3 weights
_GV = contracts.constants("gemv.cu")
GEMV_DTYPES = ("fp16", "bf16")


def gemv_support(M: int, N: int, K: int, dtype: str, e4m3: bool = False) -> str | None:
    """Why kernels/gemv.cu cannot take M rows of K features to N outputs in `dtype` (None: it can), with a
    weight in `dtype` or, with `e4m3`, in E4M3 codes (16 to a 16-byte chunk, so K a multiple of 16)."""
    if M != 1:
        faster = "; from 2 rows cuBLASLt is faster" if M > 1 and not e4m3 else ""
        return f"M={M}: the GEMV kernel takes one row (a batch-1 decode step){faster}"
    if N == 0:
        return "N=0: no output for the GEMV kernel to compute (the other paths return the empty result)"
    if dtype not in GEMV_DTYPES:
        return f"dtype {dtype} is not supported (supported: {', '.join(GEMV_DTYPES)})"
    multiple = 16 if e4m3 else 8
    if K % multiple or not multiple <= K <= _GV["GEMV_MAX_K"]:
        return f"K={K}: the GEMV kernel takes K a multiple of {multiple} from {multiple} to {_GV['GEMV_MAX_K']}"
    return None


def read_in_place(*arrays: Any) -> bool:
    """Whether a decode GEMV's runner passes each of `arrays` (those its kernel reads before its wait: w,
    w_scale, gamma) as it came, None or C-contiguous, rather than a copy made in the same call. A kernel
    launched programmatically may start before the kernel ahead of it ends, and a copy is such a kernel:
    where one is made, the GEMV waits for it (early_start=False)."""
    return all(a is None or a.flags.c_contiguous for a in arrays)


def bind_gemv_kernel(dtype: str, N: int, K: int, activation: str | None, glu: bool, device: str, eps: float = 0.0,
                     prefetch: tuple[int, ...] = (), per_channel: bool | None = None, early_start: bool = True):
    """kernels/gemv.cu's launch for y (R,) = act(x' @ w.T + bias + residual), or with `glu` SwiGLU of the
    (N,) result's halves (R = N / 2), by its LAUNCH table: run(x, w, bias, residual, gamma, y, *hint), each
    a pointer or None; gamma (K,) RMS-normalises x with `eps` first; `prefetch` the bytes of each array of
    the hint (runtime/l2_prefetch.py), which the launch takes last. Programmatic on sm_90 and newer unless
    `early_start` is False (see read_in_place). With `per_channel` True or False, w holds E4M3 codes scaled
    per output channel or per tensor and x is quantised as linear_fp8 quantises it: run(x, w, w_scale,
    bias, residual, gamma, y, *hint)."""
    rows = N // 2 if glu else N
    blocks = min(-(-rows // (_GV["GEMV_THREADS"] // 32)),
                 _GV["GEMV_BLOCKS_PER_SM"] * device_info.multiprocessors(device_info.gpu_index(device)))
    e4m3 = per_channel is not None
    kernel = f"gemv{'_glu' if glu else ''}{'_e4m3' if e4m3 else ''}_{dtypes.KERNEL_SUFFIX[dtype]}"
    arguments = dict(x=launch.ARRAY, w=launch.ARRAY, bias=launch.ARRAY, residual=launch.ARRAY, gamma=launch.ARRAY,
                     y=launch.ARRAY, N=N, K=K, eps=eps, act=activations.KERNEL_CODES[activation],
                     **l2_prefetch.kernel_parameters(prefetch))
    params = _GEMV_E4M3 if e4m3 else _GEMV
    if e4m3:
        arguments.update(w_scale=launch.ARRAY, per_channel=int(per_channel))
    return launch.bind("gemv.cu", kernel, (blocks,), (_GV["GEMV_THREADS"],), params.pack(**arguments),
                       shared_mem=4 * K, programmatic=early_start and launch.programmatic_supported(device))


def refuse_unaligned_gemv(x, w) -> None:
    """LibraryError unless x and w are 16-byte aligned, as kernels/gemv.cu's 16-byte loads need (None: an
    array the runner copies, aligned, at every call)."""
    refuse_misaligned("kernels/gemv.cu needs x and w 16-byte aligned", {"x": x, "w": w})


def _gemv_support(problem: LinearProblem) -> str | None:
    return gemv_support(problem.M, problem.N, problem.K, problem.dtype)


@op.path("gemv", kind="custom", device="gpu", supports=_gemv_support, binds=True)
def _gemv(problem: LinearProblem, x, w, b, r, pf=()):
    bind = partial(bind_gemv, early_start=read_in_place(w))  # a strided w is copied at each call
    return _bind_gpu(bind, True, problem, x, w, b, r, prefetches=True)


def bind_gemv(problem: LinearProblem, x, w, b, r=None, early_start: bool = True):
    """The runner of kernels/gemv.cu for C-contiguous (1, K), (N, K), (N,) and (1, N) CuPy arrays, and the
    problem's prefetch hint last where it has one; early_start as bind_gemv_kernel's."""
    refuse_unaligned_gemv(x, w)
    kernel = bind_gemv_kernel(problem.dtype, problem.N, problem.K, problem.activation, False, problem.device,
                              prefetch=problem.prefetch, early_start=early_start)
    new = allocator((problem.M, problem.N), x.dtype)

    def run(x, w, b, r, pf=()):
        y = new()
        kernel(x, w, b, r, None, y, *pf)
        return y
    return run


# --- custom path: kernels/gemm.cu -------------------------------------------------------------------
# The numbered versions of kernels/gemm.cu per dtype, slowest first; the last one is the custom path.
_VERSIONS = {"fp32": ("v1", "v2"), "fp16": ("v1", "v3"), "bf16": ("v1", "v3")}


_GEMM = contracts.params("gemm.cu", "GEMM_PARAMS")  # every gemm kernel's parameters
_BIAS_ACT_ROWS = contracts.params("epilogue.cu", "bias_act_rows_##ACT_NAME##_##SUFFIX")
_G = contracts.constants("gemm.cu")


@dataclass(frozen=True)
class _Launch:
    """How kernels/gemm.cu's LAUNCH table says to run one version (its constants read from the file)."""
    kernel: str            # name without the dtype suffix
    block: tuple[int, int, int]
    tile_n: int            # output columns per block (grid x)
    tile_m: int            # output rows per block (grid y)
    dynamic_smem: int = 0
    erf_kernel: str | None = None  # the kernel computing gelu_erf in its epilogue, if any


_LAUNCH = {"v1": _Launch("gemm1_naive", (_G["GEMM1_BX"], _G["GEMM1_BY"], 1), _G["GEMM1_BX"], _G["GEMM1_BY"],
                         erf_kernel="gemm1_naive"),
           "v2": _Launch("gemm2_tiled", (_G["G2_THREADS"], 1, 1), _G["G2_BN"], _G["G2_BM"]),
           "v3": _Launch("gemm3_mma", (32 * _G["GEMM3_WM"] * _G["GEMM3_WN"], 1, 1), _G["GEMM3_BN"], _G["GEMM3_BM"],
                         dynamic_smem=_G["GEMM3_STAGES"] * (_G["GEMM3_BM"] + _G["GEMM3_BN"]) * _G["GEMM3_BK"] * 2,
                         erf_kernel="gemm3_mma_gelu_erf")}


def custom_versions(problem: LinearProblem, aligned: bool = True) -> tuple[str, ...]:
    """The numbered versions of kernels/gemm.cu that can run `problem`, baseline first, the custom
    path's last (for tests and benchmarks; `launch_custom_version` takes one). Every version takes any
    alignment, so `aligned` (the shape every op's custom_versions has) changes nothing here."""
    return _VERSIONS[problem.dtype]


def _kernel(version: str, activation: str | None) -> str | None:
    """The kernel of `version` whose epilogue computes `activation` (None if it has none)."""
    spec = _LAUNCH[version]
    return spec.erf_kernel if activation == "gelu_erf" else spec.kernel


def _custom_fuses(problem: LinearProblem) -> bool:
    """Whether the custom path's kernel computes the problem's activation in its epilogue."""
    return _kernel(_VERSIONS[problem.dtype][-1], problem.activation) is not None


def bind_custom(problem: LinearProblem, x, w, b, r=None, version: str | None = None):
    """The runner of one version of kernels/gemm.cu (default: the custom path's) for C-contiguous
    (M, K), (N, K), (N,) and (M, N) CuPy arrays; a null bias or residual pointer means none."""
    version = version or _VERSIONS[problem.dtype][-1]
    if version not in _VERSIONS[problem.dtype]:
        raise ValueError(f"linear: kernels/gemm.cu has no version {version!r} for {problem.dtype}; "
                         f"it has {_VERSIONS[problem.dtype]}")
    if (kernel := _kernel(version, problem.activation)) is None:
        raise ValueError(f"linear: kernels/gemm.cu version {version} has no {problem.activation} epilogue")
    spec, (M, N, K) = _LAUNCH[version], (problem.M, problem.N, problem.K)
    rows_per_launch = launch.MAX_GRID_YZ * spec.tile_m  # grid.y is limited; larger M runs in slices
    slices = [(m0, min(rows_per_launch, M - m0)) for m0 in range(0, M, rows_per_launch)]
    launches = [launch.bind("gemm.cu", f"{kernel}_{dtypes.KERNEL_SUFFIX[problem.dtype]}",
                            (-(-N // spec.tile_n), -(-rows // spec.tile_m)), spec.block,
                            _GEMM.pack(x=launch.ARRAY, w=launch.ARRAY, bias=launch.ARRAY, residual=launch.ARRAY,
                                       y=launch.ARRAY, M=rows, N=N, K=K,
                                       act=activations.KERNEL_CODES[problem.activation]),
                            shared_mem=spec.dynamic_smem)
                for _, rows in slices]
    shape, dtype = (M, N), x.dtype
    new = allocator(shape, dtype)
    if len(launches) == 1:
        (gemm,) = launches

        def run(x, w, b, r):
            y = new()
            gemm(x, w, b, r, y)
            return y
        return run

    def run_in_slices(x, w, b, r):
        y = new()
        for (m0, rows), gemm in zip(slices, launches):
            gemm(x[m0:m0 + rows], w, b, None if r is None else r[m0:m0 + rows], y[m0:m0 + rows])
        return y
    return run_in_slices


def launch_custom_version(version: str, x, w, b, activation: str | None, residual=None):
    """y = act(x @ w.T + b + residual) with one numbered version of kernels/gemm.cu (C-contiguous 2-D
    CuPy arrays), for benchmarks and tests."""
    return bind_custom(linear_problem(x, w, b, activation, False, residual), x, w, b, residual, version)(x, w, b, residual)
