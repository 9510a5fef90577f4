"""linear: y = act(x @ w.T + b), the fully connected layer as one GEMM with a fused epilogue.

x is (..., K), w is (N, K) (PyTorch's (out_features, in_features)), b is (N,) or None.
Activations: None, "relu", "gelu", the tanh approximation 0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³)))
that cuBLASLt's epilogue computes, and "gelu_erf", the exact GELU of PyTorch's nn.GELU() and BERT.
The first three are fused into the GEMM's epilogue; cuBLASLt has no erf GELU, and compiling one into
gemm.cu's epilogue costs the main loop registers, so on the GPU "gelu_erf" is a second, memory-bound
pass (kernels/epilogue.cu) after the GEMM with its bias.

Paths, in `auto` order (fastest first on the H100, see `libnn bench linear`):
- cublaslt:  cuBLASLt through nvmath-python, bias and activation fused in its epilogue.
- custom:    kernels/gemm.cu, tensor cores (mma.sync) for fp16/bf16, tiled FFMA for fp32.
- reference: NumPy in float64, rounded to the input dtype once at the end.

fp16/bf16 accumulate in fp32 on the GPU paths. fp32 is exact fp32 unless `allow_tf32=True`, which
lets cuBLASLt use TF32 tensor cores (about 1e-3 relative error instead of 1e-6).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops import activations
from libnn.registry import Op
from libnn.runtime.arrays import array_module, as_array, contiguous, device_of, signature, stream_key

ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
FUSED_ACTIVATIONS = (None, "relu", "gelu")  # what cuBLASLt's epilogues and gemm.cu's compile
GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("linear", order=("cublaslt", "custom", "reference"))


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

    def describe(self) -> str:
        epilogue = "+".join(filter(None, ["bias" if self.has_bias else None, self.activation])) or "no epilogue"
        return f"linear M={self.M} N={self.N} K={self.K} {self.dtype} ({epilogue})"

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


def _check(x, w, b, activation, allow_tf32: bool) -> LinearProblem:
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
    if x.dtype.kind != "f" and dtypes.short_name(x.dtype) != "bf16":
        raise TypeError(f"linear: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    for name, a in (("w", w), ("b", b)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"linear: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    activations.check("linear", activation, ACTIVATIONS)
    device = device_of({"x": x, "w": w, "b": b}, "linear")
    return LinearProblem(M=math.prod(x.shape[:-1]), N=N, K=K, dtype=dtypes.short_name(x.dtype),
                         has_bias=b is not None, activation=activation, allow_tf32=bool(allow_tf32),
                         device=device)


def linear(x: Any, w: Any, b: Any = None, activation: str | None = None, *, allow_tf32: bool = False,
           path: str = "auto") -> Any:
    """act(x @ w.T + b) for x (..., K), w (N, K), b (N,) or None; returns (..., N) in x's dtype, on
    x's device. `path` is "auto" or one of `libnn.paths("linear")`."""
    x, w = as_array(x, "linear", "x"), as_array(w, "linear", "w")
    b = None if b is None else as_array(b, "linear", "b")
    key = (signature(x), signature(w), signature(b), activation, allow_tf32, path, stream_key())
    return op.call(key, lambda: _check(x, w, b, activation, allow_tf32), path, x, w, b)


def _as_matrices(gemm, problem: LinearProblem, x, w, b):
    """`gemm` (a runner for C-contiguous (M, K), (N, K), (N,) arrays) wrapped for the signature of x, w
    and b: x of any rank or strides is made a contiguous (M, K) matrix and the result given x's leading
    dimensions. The wrapper is only added where the signature needs it."""
    if x.ndim == 2 and x.flags.c_contiguous and w.flags.c_contiguous and (b is None or b.flags.c_contiguous):
        return gemm
    lead = x.shape[:-1]

    def run(x, w, b):
        y = gemm(contiguous(x).reshape(problem.M, problem.K), contiguous(w), None if b is None else contiguous(b))
        return y.reshape(*lead, problem.N)
    return run


def _degenerate(problem: LinearProblem, x, w, b):
    """The result when M, N or K is 0: no GEMM to run."""
    xp = array_module(x)
    lead = x.shape[:-1]
    if problem.M == 0 or problem.N == 0:
        return xp.empty((*lead, problem.N), x.dtype)
    # K == 0, an empty sum: every output is act(bias)
    bias = xp.zeros(problem.N, xp.float64 if xp is np else xp.float32) if b is None else b.astype(xp.float32)
    y = activations.apply(xp.broadcast_to(bias, (problem.M, problem.N)), problem.activation).astype(x.dtype)
    return y.reshape(*lead, problem.N)


def _gpu_support(problem: LinearProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


@op.path("cublaslt", kind="library", device="gpu", requires=("nvmath",), supports=_gpu_support, binds=True)
def _cublaslt(problem: LinearProblem, x, w, b):
    from libnn.backends import cublaslt

    return _bind_gpu(cublaslt.bind_linear, problem, x, w, b)


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: LinearProblem, x, w, b):
    return _bind_gpu(bind_custom, problem, x, w, b)


def _bind_gpu(bind_gemm, problem: LinearProblem, x, w, b):
    """The runner of a GPU path: `bind_gemm(problem, x, w, b)` binds the GEMM (with the activation in its
    epilogue, or, for one it has no epilogue for, followed by an element-wise pass of
    kernels/epilogue.cu); empty problems need no GEMM."""
    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return functools.partial(_degenerate, problem)
    matrices = (contiguous(x).reshape(problem.M, problem.K), contiguous(w), None if b is None else contiguous(b))
    if problem.activation in FUSED_ACTIVATIONS:
        return _as_matrices(bind_gemm(problem, *matrices), problem, x, w, b)
    gemm = bind_gemm(replace(problem, activation=None), *matrices)
    epilogue = bind_epilogue_pass(problem.dtype, problem.M * problem.N, problem.activation)

    def gemm_then_activation(x, w, b):
        y = gemm(x, w, b)
        epilogue(y)
        return y
    return _as_matrices(gemm_then_activation, problem, x, w, b)


def bind_epilogue_pass(dtype: str, size: int, activation: str | None):
    """y = act(y) in place over `size` elements, one pass of kernels/epilogue.cu."""
    from libnn.runtime import launch

    null = np.uint64(0)
    return launch.bind("epilogue.cu", f"channel_epilogue_{dtypes.KERNEL_SUFFIX[dtype]}",
                       (min(-(-size // 256), 65535 * 8),), (256,),
                       (launch.ARRAY, null, null, np.int64(size), np.int32(1), np.int64(1),
                        np.int32(activations.KERNEL_CODES[activation])))


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LinearProblem, x, w, b):
    if problem.M == 0 or problem.N == 0 or problem.K == 0:
        return _degenerate(problem, x, w, b)
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if b is not None:
        y += b.astype(np.float64)
    return activations.apply(y, problem.activation).astype(x.dtype)


# --- custom path: kernels/gemm.cu -------------------------------------------------------------------
# The numbered versions of kernels/gemm.cu per dtype, slowest first; the last one is the custom path.
_VERSIONS = {"fp32": ("v1", "v2"), "fp16": ("v1", "v3"), "bf16": ("v1", "v3")}


@dataclass(frozen=True)
class _Launch:
    """How kernels/gemm.cu's LAUNCH table says to run one version."""
    kernel: str            # name without the dtype suffix
    block: tuple[int, int, int]
    tile_n: int            # output columns per block (grid x)
    tile_m: int            # output rows per block (grid y)
    dynamic_smem: int = 0


_LAUNCH = {"v1": _Launch("gemm1_naive", (32, 8, 1), 32, 8),
           "v2": _Launch("gemm2_tiled", (256, 1, 1), 128, 128),
           "v3": _Launch("gemm3_mma", (256, 1, 1), 256, 128, dynamic_smem=98304)}
_MAX_GRID_Y = 65535


def custom_versions(dtype: str) -> tuple[str, ...]:
    """The versions of kernels/gemm.cu that compute `dtype`, for benchmarks and tests."""
    return _VERSIONS[dtype]


def bind_custom(problem: LinearProblem, x, w, b, version: str | None = None):
    """The runner of one version of kernels/gemm.cu (default: the custom path's) for C-contiguous
    (M, K), (N, K) and (N,) CuPy arrays; a null bias pointer means no bias."""
    import cupy

    from libnn.runtime import launch

    version = version or _VERSIONS[problem.dtype][-1]
    if version not in _VERSIONS[problem.dtype]:
        raise ValueError(f"linear: kernels/gemm.cu has no version {version!r} for {problem.dtype}; "
                         f"it has {_VERSIONS[problem.dtype]}")
    spec, (M, N, K) = _LAUNCH[version], (problem.M, problem.N, problem.K)
    rows_per_launch = _MAX_GRID_Y * spec.tile_m  # grid.y is limited; larger M runs in slices
    slices = [(m0, min(rows_per_launch, M - m0)) for m0 in range(0, M, rows_per_launch)]
    launches = [launch.bind("gemm.cu", f"{spec.kernel}_{dtypes.KERNEL_SUFFIX[problem.dtype]}",
                            (-(-N // spec.tile_n), -(-rows // spec.tile_m)), spec.block,
                            (launch.ARRAY, launch.ARRAY, launch.ARRAY, launch.ARRAY, np.int32(rows), np.int32(N),
                             np.int32(K), np.int32(activations.KERNEL_CODES[problem.activation])),
                            shared_mem=spec.dynamic_smem)
                for _, rows in slices]
    shape, dtype = (M, N), x.dtype
    if len(launches) == 1:
        (gemm,) = launches

        def run(x, w, b):
            y = cupy.empty(shape, dtype)
            gemm(x, w, b, y)
            return y
        return run

    def run_in_slices(x, w, b):
        y = cupy.empty(shape, dtype)
        for (m0, rows), gemm in zip(slices, launches):
            gemm(x[m0:m0 + rows], w, b, y[m0:m0 + rows])
        return y
    return run_in_slices


def launch_custom_version(version: str, x, w, b, activation: str | None):
    """y = act(x @ w.T + b) with one numbered version of kernels/gemm.cu (C-contiguous CuPy arrays),
    for benchmarks and tests."""
    return bind_custom(_check(x, w, b, activation, False), x, w, b, version)(x, w, b)
