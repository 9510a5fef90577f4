"""linear_fp8: y = act(x @ W.T + b + residual) with the weight W in FP8 (E4M3) and x quantised to E4M3 at
every call: the fully connected layer on the FP8 tensor cores of Ada and Hopper GPUs.

w is (N, K) E4M3 codes in uint8 and w_scale float32, (N,) (one scale per output channel) or (1,) (one
for the tensor): W[n, k] = w_scale[n or 0] · e4m3(w[n, k]), what `quantize_weight` returns as an
Fp8Weight(data, scale) (so `linear_fp8(x, *weight, b)`), made once at load. x is (..., K); b (N,) and
the residual (..., N) are in x's dtype, and so is the result, on x's device. Each call quantises x with
one scale for the tensor (libnn/ops/quantize_fp8.py; on the GPU by kernels/quantize_fp8.cu, the scale
staying in device memory, so a call never waits for the GPU and can be captured in a CUDA graph):
    sx = max|x| / 448,   xq = e4m3(x / sx)
    y[m, n] = act(sx · w_scale[n] · Σ_k e4m3(xq[m, k]) · e4m3(w[n, k]) + b[n] + residual[m, n])
Activations as linear's: None, "relu", "gelu" (tanh) and "gelu_erf". NaN in x makes its rows NaN; an
inf does too (E4M3 has no infinity: it is quantised to NaN), and takes no part in sx.

Paths, in `auto` order:
- cublaslt:  cuBLASLt's FP8 GEMM (E4M3 inputs, fp32 accumulation, fp16/bf16 out) planned through
             nvmath-python's low-level bindings (libnn/backends/cublaslt.py says why not its Matmul):
             the scales as device pointers, bias, relu and gelu in the epilogue, the residual as C with
             β = 1, "gelu_erf" as the GEMM then kernels/epilogue.cu's bias/activation pass (as linear).
             Per-channel weight scales use cuBLASLt's outer-vector scaling (cuBLAS 12.9+). N and K
             multiples of 16 and w, w_scale, b and the residual 16-byte aligned (cuBLASLt's FP8
             requirements); anything else, or a problem cuBLASLt declines, runs on custom.
- custom:    kernels/linear_fp8.cu: the codes decoded to fp32 in shared memory, FFMA in fp32, scales,
             bias, residual and activation in the epilogue. Any shape; not tuned, the comparison. At
             decode-sized M (M <= 8, and x's codes within the GEMV's shared memory: K up to 36736 at
             M = 1, 4480 at M = 8) a decode GEMV that quantises x itself: one kernel per call, each
             weight byte read once; `auto` takes it there before cuBLASLt, whose FP8 GEMM at one row
             plus the two quantiser kernels took longer on the H100. At one row with K a multiple of 16
             (up to 24576) and w 16-byte aligned that is kernels/gemv.cu's E4M3 kernel (linear's batch-1
             GEMV streaming E4M3 codes, FFMA in fp32); elsewhere linear_fp8.cu's version 3, on the FP8
             tensor cores' mma.sync (benchmarks/RESULTS.md, twenty-first session, compares the two).
- reference: NumPy in float64 from the dequantised values: x quantised by the NumPy twin of the GPU
             quantiser (the same codes and scale, bit for bit), both operands decoded and scaled, the
             product and epilogue in float64, rounded to x's dtype once.

The GPU paths take x in fp16 or bf16 and need compute capability 8.9 or newer: on an older GPU they
refuse with that reason (NoPathError under `auto`), so FP8 never runs there by accident; the reference
takes any floating-point x.

`prefetch` is linear's hint (libnn/ops/linear.py, runtime/l2_prefetch.py): custom's version 3 prefetches
into L2 what the next kernel reads first; the other paths ignore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from libnn import dtypes
from libnn.backends import cublaslt
from libnn.ops import activations
from libnn.ops.linear import bind_epilogue_pass, bind_gemv_kernel, degenerate_result, gemv_support, read_in_place
from libnn.ops.quantize_fp8 import bind_quantize, decode_e4m3, fp8_gpu_missing, quantize_fp8
from libnn.registry import Op
from libnn.runtime import contracts, l2_prefetch, launch, memory
from libnn.runtime.device import gpu_index, multiprocessors
from libnn.runtime.arrays import allocator, as_array, contiguous, data_pointer, device_of, signature, stream_key

ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
FUSED_ACTIVATIONS = (None, "relu", "gelu")  # what cuBLASLt's epilogues compute
GPU_DTYPES = ("fp16", "bf16")               # FP8 GEMMs here write fp16 or bf16
CUBLASLT_MULTIPLE = 16                      # N and K, for cuBLASLt's FP8 kernels

op = Op("linear_fp8", order=("cublaslt", "custom", "reference"))


@dataclass(frozen=True)
class LinearFp8Problem:
    """Everything that decides how a linear_fp8 call runs; also the plan-cache key."""
    M: int
    N: int
    K: int
    dtype: str            # x's (and the output's) short name
    per_channel: bool     # w_scale (N,) with N > 1; else one scale for the weight
    has_bias: bool
    activation: str | None
    device: str           # "cpu" or "gpu:N"
    has_residual: bool = False
    # bytes of each array of the prefetch hint (runtime/l2_prefetch.py); not part of equality or the hash: a
    # library plan keyed by the problem is the same with and without a hint
    prefetch: tuple[int, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        epilogue = "+".join(filter(None, ["bias" if self.has_bias else None,
                                          "residual" if self.has_residual else None, self.activation])) or "no epilogue"
        scales = "per-channel" if self.per_channel else "per-tensor"
        return f"linear_fp8 M={self.M} N={self.N} K={self.K} {self.dtype} (E4M3 weight, {scales} scales; {epilogue})"

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes((self.M, self.N), dtypes.parse(self.dtype))

    @property
    def device_id(self) -> int:
        return gpu_index(self.device)


def linear_fp8_problem(x: Any, w: Any, w_scale: Any, b: Any, activation: str | None,
                       residual: Any = None, prefetch: tuple = ()) -> LinearFp8Problem:
    """The LinearFp8Problem linear_fp8(x, w, w_scale, b, activation, residual=, prefetch=) solves, after
    checking every argument as linear_fp8 does (arrays already, the hint a tuple of them); for tools that
    run one path themselves."""
    if w.ndim != 2 or w.dtype != np.uint8:
        raise TypeError(f"linear_fp8: w must be a 2-D uint8 array of E4M3 codes (out_features, in_features), what "
                        f"quantize_weight returns; got dtype {w.dtype} and shape {tuple(w.shape)}")
    N, K = w.shape
    if w_scale.dtype != np.float32 or tuple(w_scale.shape) not in ((1,), (N,)):
        raise TypeError(f"linear_fp8: w_scale must be float32 of shape (1,) (per tensor) or ({N},) (per output "
                        f"channel); got dtype {w_scale.dtype} and shape {tuple(w_scale.shape)}")
    if x.ndim < 1:
        raise ValueError("linear_fp8: x must have at least 1 dimension (..., in_features), got a scalar")
    if x.shape[-1] != K:
        raise ValueError(f"linear_fp8: x has {x.shape[-1]} features in its last dimension but w has {K} "
                         f"(w is (out_features, in_features) = {tuple(w.shape)}, x is {tuple(x.shape)})")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"linear_fp8: x must be a floating-point array (fp16, bf16 on the GPU; fp32, fp64 too on "
                        f"the reference path), got {x.dtype}")
    if b is not None and tuple(b.shape) != (N,):
        raise ValueError(f"linear_fp8: b must have shape ({N},) to match w's out_features, got {tuple(b.shape)}")
    out_shape = (*x.shape[:-1], N)
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"linear_fp8: residual must have the output's shape {out_shape} (x's leading dimensions, "
                         f"w's out_features), got {tuple(residual.shape)}")
    for name, a in (("b", b), ("residual", residual)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"linear_fp8: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    activations.check("linear_fp8", activation, ACTIVATIONS)
    device = device_of({"x": x, "w": w, "w_scale": w_scale, "b": b, "residual": residual}, "linear_fp8")
    return LinearFp8Problem(M=math.prod(x.shape[:-1]), N=N, K=K, dtype=dtypes.short_name(x.dtype),
                            per_channel=w_scale.shape[0] > 1, has_bias=b is not None, activation=activation,
                            device=device, has_residual=residual is not None,
                            prefetch=l2_prefetch.prefetch_bytes("linear_fp8", prefetch, device))


def linear_fp8(x: Any, w: Any, w_scale: Any, b: Any = None, activation: str | None = None, *,
               residual: Any = None, prefetch: Any = None, path: str = "auto") -> Any:
    """act(x @ (w_scale · e4m3(w)).T + b + residual) with x quantised to E4M3 per call, for x (..., K), w
    (N, K) uint8 E4M3 codes, w_scale float32 (1,) or (N,), b (N,) or None, residual (..., N) or None;
    returns a new (..., N) array in x's dtype, on x's device. `prefetch`: None, or what the next kernel
    reads first (the module docstring). `path` is "auto" or one of `libnn.paths("linear_fp8")`."""
    x, w = as_array(x, "linear_fp8", "x"), as_array(w, "linear_fp8", "w")
    w_scale = as_array(w_scale, "linear_fp8", "w_scale")
    b = None if b is None else as_array(b, "linear_fp8", "b")
    r = None if residual is None else as_array(residual, "linear_fp8", "residual")
    key = (signature(x), signature(w), signature(w_scale), signature(b), signature(r), activation, path, stream_key())
    if prefetch is None:
        return op.call(key, lambda: linear_fp8_problem(x, w, w_scale, b, activation, r), path, x, w, w_scale, b, r)
    pf = l2_prefetch.hinted_arrays("linear_fp8", prefetch)
    return op.call((*key, *map(signature, pf)), lambda: linear_fp8_problem(x, w, w_scale, b, activation, r, pf),
                   path, x, w, w_scale, b, r, pf)


def _gpu_support(problem: LinearFp8Problem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return fp8_gpu_missing(problem.device_id)


def _cublaslt_support(problem: LinearFp8Problem) -> str | None:
    if reason := _gpu_support(problem):
        return reason
    if problem.N % CUBLASLT_MULTIPLE or problem.K % CUBLASLT_MULTIPLE:
        return (f"N and K must be multiples of {CUBLASLT_MULTIPLE} (cuBLASLt's FP8 GEMMs), got N={problem.N} "
                f"K={problem.K}")
    return None


def _matrix(a, rows: int, cols: int):
    """`a` as a C-contiguous (rows, cols) matrix: itself when it is one already (the common case costs two
    attribute reads), else a contiguous copy reshaped."""
    if a.ndim == 2 and a.flags.c_contiguous:
        return a
    return contiguous(a).reshape(rows, cols)


def _bind_gpu(bind_gemm: Callable[..., Callable[..., Any]], scale_count: int, fused: bool, problem: LinearFp8Problem,
              x: Any, w: Any, w_scale: Any, b: Any, r: Any) -> Callable[[Any, Any, Any, Any, Any], Any]:
    """The runner of a GPU path: quantise x (kernels/quantize_fp8.cu, writing `scale_count` copies of its
    scale), then `bind_gemm(problem, xq, w, w_scale, x_scale, b, r)`'s runner gemm(xq, w, w_scale, b, r),
    with bias, residual and activation in its epilogue when `fused`, else the residual alone and one pass
    of kernels/epilogue.cu for the bias and activation. x and the residual of any rank and strides are
    read as contiguous matrices (copied where they are not); empty problems need no GEMM."""
    import cupy

    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return lambda x, w, w_scale, b, r: degenerate_result(problem, x, b, r)
    M, N, K = problem.M, problem.N, problem.K
    out_shape = None if x.ndim == 2 else (*x.shape[:-1], N)
    quantize, x_scale = bind_quantize(problem.dtype, M * K, scale_count)
    xq = cupy.zeros((M, K), cupy.uint8)  # what the GEMM is planned (and, autotuning, timed) with
    operands = (contiguous(w), contiguous(w_scale), None if b is None else contiguous(b),
                None if r is None else _matrix(r, M, N))
    if fused:
        gemm, epilogue = bind_gemm(problem, xq, operands[0], operands[1], x_scale, operands[2], operands[3]), None
    else:
        gemm = bind_gemm(replace(problem, has_bias=False, activation=None), xq, operands[0], operands[1], x_scale,
                         None, operands[3])
        epilogue = bind_epilogue_pass(problem.dtype, M, N, problem.activation)

    def run(x, w, w_scale, b, r):
        xq = cupy.empty((M, K), cupy.uint8)
        quantize(contiguous(x), xq)
        b = None if b is None else contiguous(b)
        y = gemm(xq, contiguous(w), contiguous(w_scale), b if fused else None, None if r is None else _matrix(r, M, N))
        if epilogue is not None:
            epilogue(y, b)
        return y if out_shape is None else y.reshape(out_shape)
    run.x_scale = x_scale  # held with the runner: the GEMM reads it
    return run


def _cublaslt_slower(problem: LinearFp8Problem) -> str | None:
    if gemv_fits(problem):
        return "decode-sized M: custom's GEMV quantises x itself and reads each weight byte once, in one kernel"
    return None


@op.path("cublaslt", kind="library", device="gpu", requires=("nvmath",), supports=_cublaslt_support,
         slower=_cublaslt_slower, binds=True)
def _cublaslt(problem: LinearFp8Problem, x, w, w_scale, b, r, pf=()):
    # outer-vector scaling takes one activation scale per row of x: the quantiser writes its scale M times
    scale_count = problem.M if problem.per_channel else 1
    return l2_prefetch.ignoring_hint(_bind_gpu(cublaslt.bind_linear_fp8, scale_count,
                                               problem.activation in FUSED_ACTIVATIONS, problem, x, w, w_scale, b,
                                               r), problem.prefetch)


# --- custom path: kernels/linear_fp8.cu --------------------------------------------------------------------
_GEMM = contracts.params("linear_fp8.cu", "FP8_GEMM_PARAMS")
_GEMV = contracts.params("linear_fp8.cu", "FP8_GEMV_PARAMS")
_G = contracts.constants("linear_fp8.cu")


def bind_custom(problem: LinearFp8Problem, xq: Any, w: Any, w_scale: Any, x_scale: Any, b: Any,
                r: Any = None) -> Callable[[Any, Any, Any, Any, Any], Any]:
    """The runner of kernels/linear_fp8.cu, run(xq, w, w_scale, b, r) -> y, for C-contiguous CuPy arrays
    of this signature (xq (M, K) and w (N, K) codes, w_scale float32, b (N,) and r (M, N) in the output's
    dtype, or None) and the quantiser's float32 buffer x_scale, read at every launch."""
    M, N, K = problem.M, problem.N, problem.K
    kernel = launch.bind("linear_fp8.cu", f"fp8_gemm1_tiled_{dtypes.KERNEL_SUFFIX[problem.dtype]}",
                         (-(-M // _G["FP8_GEMM_BM"]), -(-N // _G["FP8_GEMM_BN"])), (_G["FP8_GEMM_THREADS"],),
                         _GEMM.pack(xq=launch.ARRAY, wq=launch.ARRAY, x_scale=np.uint64(x_scale.data.ptr),
                                    w_scale=launch.ARRAY, bias=launch.ARRAY, residual=launch.ARRAY, y=launch.ARRAY,
                                    M=M, N=N, K=K, per_channel=int(problem.per_channel),
                                    act=activations.KERNEL_CODES[problem.activation]))
    shape, dtype = (M, N), dtypes.parse(problem.dtype)
    new = allocator(shape, dtype)

    def run(xq, w, w_scale, b, r):
        y = new()
        kernel(xq, w, w_scale, b, r, y)
        return y
    return run


def _gemv_x_stride(K: int) -> int:
    """Bytes between x's rows of codes in the GEMV's shared memory (kernels/linear_fp8.cu gemv3_x_stride)."""
    chunk = _G["FP8_GEMV3_CHUNK"]
    return -(-(-(-K // chunk) * chunk) // 128) * 128 + 64


def gemv3_support(M: int, N: int, K: int) -> str | None:
    """Why kernels/linear_fp8.cu's version 3 (the GEMV that quantises x itself) cannot take M rows of K
    features to N outputs (None: it can). It takes every shape kernels/gemv.cu's E4M3 kernel takes, so
    this is the decode GEMV's support."""
    if not 1 <= M <= _G["FP8_GEMV_MAX_M"]:
        return f"M={M}: the FP8 GEMV takes 1 to {_G['FP8_GEMV_MAX_M']} rows (a decode step's batch)"
    if N < 1 or K < 1:
        return f"N={N}, K={K}: the FP8 GEMV needs both >= 1"
    if M * _gemv_x_stride(K) > _G["FP8_GEMV3_XS_BYTES"]:
        return (f"M={M}, K={K}: x's codes need {M * _gemv_x_stride(K)} bytes of the FP8 GEMV's "
                f"{_G['FP8_GEMV3_XS_BYTES']} of shared memory")
    return None


def gemv_fits(problem: LinearFp8Problem) -> bool:
    """Whether the decode GEMV (bind_decode_gemv_kernel's kernels, which quantise x themselves) takes the
    problem."""
    return gemv3_support(problem.M, problem.N, problem.K) is None


def bind_gemv3_kernel(dtype: str, M: int, N: int, K: int, per_channel: bool, activation: str | None, device: str,
                      glu: bool = False, eps: float = 0.0, prefetch: tuple[int, ...] = (), early_start: bool = True):
    """kernels/linear_fp8.cu version 3's launch by its LAUNCH table: run(x, wq, w_scale, bias, residual, gamma,
    y, *hint), each a pointer or None; gamma (K,) RMS-normalises x with `eps` before it is quantised, and `glu`
    writes y (M, N / 2) = silu(gate) * up of the gate and up halves of w's rows (no activation then, and
    run with a null residual); `prefetch` the bytes of each array of the hint (runtime/l2_prefetch.py),
    which the launch takes last. Programmatic on sm_90 and newer unless `early_start` is False
    (linear.read_in_place)."""
    if glu and (activation is not None or N % 2):
        raise ValueError(f"linear_fp8: the GEMV's SwiGLU epilogue takes no activation and an even N, got "
                         f"{activation!r} and N={N}")
    sms = multiprocessors(gpu_index(device))
    return launch.bind("linear_fp8.cu", f"fp8_gemv3_{dtypes.KERNEL_SUFFIX[dtype]}",
                       (min(-(-N // _G["FP8_GEMV3_ROWS"]), _G["FP8_GEMV3_BLOCKS_PER_SM"] * sms),),
                       (_G["FP8_GEMV3_THREADS"],),
                       _GEMV.pack(x=launch.ARRAY, wq=launch.ARRAY, w_scale=launch.ARRAY, bias=launch.ARRAY,
                                  residual=launch.ARRAY, gamma=launch.ARRAY, y=launch.ARRAY, M=M, N=N, K=K,
                                  per_channel=int(per_channel), act=activations.KERNEL_CODES[activation], eps=eps,
                                  glu=int(glu), **l2_prefetch.kernel_parameters(prefetch)),
                       shared_mem=M * _gemv_x_stride(K),
                       programmatic=early_start and launch.programmatic_supported(device))


def bind_decode_gemv_kernel(dtype: str, M: int, N: int, K: int, per_channel: bool, activation: str | None,
                            device: str, w: Any, glu: bool = False, eps: float = 0.0, prefetch: tuple[int, ...] = (),
                            early_start: bool = True):
    """The decode GEMV's launch for the codes `w` (read only for its layout): run(x, wq, w_scale, bias,
    residual, gamma, y, *hint), as bind_gemv3_kernel's. At one row, K a multiple of 16 and w 16-byte aligned
    (or strided: copied, aligned, at every call), kernels/gemv.cu's E4M3 kernel, which streams w at close to
    the copy rate; else kernels/linear_fp8.cu's version 3 (any K within its shared memory, up to 8 rows).
    early_start False where the runner copies w, w_scale or gamma in the call (linear.read_in_place)."""
    if gemv_support(M, N, K, dtype, e4m3=True) is None and not (w.flags.c_contiguous and data_pointer(w) % 16):
        return bind_gemv_kernel(dtype, N, K, activation, glu, device, eps, prefetch, per_channel=per_channel,
                                early_start=early_start)
    return bind_gemv3_kernel(dtype, M, N, K, per_channel, activation, device, glu, eps, prefetch, early_start)


def bind_gemv(problem: LinearFp8Problem, x: Any, w: Any, w_scale: Any, b: Any,
              r: Any = None) -> Callable[[Any, Any, Any, Any, Any], Any]:
    """The runner of the decode GEMV (bind_decode_gemv_kernel), run(x, w, w_scale, b, r, pf=()) -> y: one launch
    that quantises x (as kernels/quantize_fp8.cu does) and computes the problem, for x of any rank and strides
    (copied to a contiguous (M, K) where it is not one) and the residual likewise; pf the problem's prefetch
    hint, where it has one."""
    M, N, K = problem.M, problem.N, problem.K
    kernel = bind_decode_gemv_kernel(problem.dtype, M, N, K, problem.per_channel, problem.activation,
                                     problem.device, w, prefetch=problem.prefetch,
                                     early_start=read_in_place(w, w_scale))   # strided ones are copied per call
    out_shape, dtype = (*x.shape[:-1], N), dtypes.parse(problem.dtype)
    new = allocator(out_shape, dtype)

    def run(x, w, w_scale, b, r, pf=()):
        y = new()
        kernel(_matrix(x, M, K), contiguous(w), contiguous(w_scale), None if b is None else contiguous(b),
               None if r is None else _matrix(r, M, N), None, y, *pf)
        return y
    return run


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: LinearFp8Problem, x, w, w_scale, b, r, pf=()):
    if gemv_fits(problem):
        return bind_gemv(problem, x, w, w_scale, b, r)
    return l2_prefetch.ignoring_hint(_bind_gpu(bind_custom, 1, True, problem, x, w, w_scale, b, r), problem.prefetch)


# --- reference: NumPy, float64, from the dequantised values ------------------------------------------------
def dequantized(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """scale · e4m3(codes) in float64: a weight (N, K) with scale (N,) or (1,), or activations with (1,)."""
    values = decode_e4m3(codes).astype(np.float64)
    return values * (scale.astype(np.float64)[:, None] if scale.shape[0] > 1 else scale.astype(np.float64)[0])


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LinearFp8Problem, x, w, w_scale, b, r, pf=()):
    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return degenerate_result(problem, x, b, r)
    M, N, K = problem.M, problem.N, problem.K
    # the float32 quantiser's copies of x, the codes, the float64 operands, the product (and residual), the result
    nbytes = 13 * M * K + 8 * N * K + 8 * M * N * (2 if r is not None else 1) + M * N * x.dtype.itemsize
    memory.require(nbytes, "cpu", "linear_fp8", f"the float64 reference (M={M}, N={N}, K={K})")
    xq, x_scale = quantize_fp8(x.reshape(M, K))
    y = dequantized(xq, x_scale) @ dequantized(w, w_scale).T
    if b is not None:
        y += b.astype(np.float64)
    if r is not None:
        y += r.astype(np.float64).reshape(y.shape)
    return activations.apply(y, problem.activation).astype(x.dtype).reshape(*x.shape[:-1], N)
