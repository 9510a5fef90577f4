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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops import activations
from libnn.registry import Op
from libnn.runtime.arrays import array_module, as_array, contiguous, device_of, signature
from libnn.runtime.cache import PlanCache

ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
FUSED_ACTIVATIONS = (None, "relu", "gelu")  # what cuBLASLt's epilogues and gemm.cu's compile
GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("linear")


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


# The checks and the path choice depend only on the arrays' types, shapes, dtypes and devices and on
# the options, so they are done once per such signature: a repeated call (a layer in a loop) only
# looks its signature up. This keeps the Python cost of a cached call to a few microseconds.
_calls: PlanCache = PlanCache("linear calls", maxsize=4096)


def linear(x: Any, w: Any, b: Any = None, activation: str | None = None, *, allow_tf32: bool = False,
           path: str = "auto") -> Any:
    """act(x @ w.T + b) for x (..., K), w (N, K), b (N,) or None; returns (..., N) in x's dtype, on
    x's device. `path` is "auto" or one of `libnn.paths("linear")`."""
    x, w = as_array(x, "linear", "x"), as_array(w, "linear", "w")
    b = None if b is None else as_array(b, "linear", "b")
    key = (signature(x), signature(w), signature(b), activation, allow_tf32, path)

    def plan_call():
        problem = _check(x, w, b, activation, allow_tf32)
        return problem, op.resolve(problem, path)

    problem, resolved = _calls.get(key, plan_call)
    x2d = contiguous(x)
    if x.ndim != 2:
        x2d = x2d.reshape(problem.M, problem.K)
    y = op.run(resolved, problem, x2d, contiguous(w), None if b is None else contiguous(b))
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], problem.N)


def _degenerate(problem: LinearProblem, x, b):
    """The result when M, N or K is 0 (no GEMM to run), else None."""
    xp = array_module(x)
    if problem.M == 0 or problem.N == 0:
        return xp.empty((problem.M, problem.N), x.dtype)
    if problem.K == 0:  # an empty sum: every output is act(bias)
        bias = xp.zeros(problem.N, xp.float64 if xp is np else xp.float32) if b is None else b.astype(xp.float32)
        return activations.apply(xp.broadcast_to(bias, (problem.M, problem.N)), problem.activation).astype(x.dtype)
    return None


def _gpu_support(problem: LinearProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


@op.path("cublaslt", kind="library", device="gpu", requires=("nvmath",), supports=_gpu_support)
def _cublaslt(problem: LinearProblem, x, w, b):
    from libnn.backends import cublaslt

    return _gemm_then_activation(cublaslt.linear, problem, x, w, b)


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support)
def _custom(problem: LinearProblem, x, w, b):
    return _gemm_then_activation(launch_custom, problem, x, w, b)


def _gemm_then_activation(gemm, problem: LinearProblem, x, w, b):
    """`gemm` with the activation in its epilogue, or, for one it has no epilogue for, followed by an
    element-wise pass of kernels/epilogue.cu."""
    degenerate = _degenerate(problem, x, b)
    if degenerate is not None:
        return degenerate
    if problem.activation in FUSED_ACTIVATIONS:
        return gemm(problem, x, w, b)
    from dataclasses import replace

    from libnn.runtime import kernels

    y = gemm(replace(problem, activation=None), x, w, b)
    kernel = kernels.function("epilogue.cu", f"channel_epilogue_{dtypes.KERNEL_SUFFIX[problem.dtype]}")
    null = np.uint64(0)
    kernel((min(-(-y.size // 256), 65535 * 8),), (256,), (y, null, null, np.int64(y.size), np.int32(1),
                                                         np.int64(1), np.int32(activations.KERNEL_CODES[problem.activation])))
    return y


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LinearProblem, x, w, b):
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


def launch_custom_version(version: str, x, w, b, activation: str | None):
    """y = act(x @ w.T + b) with one numbered version of kernels/gemm.cu (C-contiguous CuPy arrays)."""
    import cupy

    from libnn.runtime import kernels

    dtype = dtypes.short_name(x.dtype)
    if version not in _VERSIONS[dtype]:
        raise ValueError(f"linear: kernels/gemm.cu has no version {version!r} for {dtype}; "
                         f"it has {_VERSIONS[dtype]}")
    launch = _LAUNCH[version]
    M, K = x.shape
    N = w.shape[0]
    y = cupy.empty((M, N), x.dtype)
    kernel = kernels.function("gemm.cu", f"{launch.kernel}_{dtypes.KERNEL_SUFFIX[dtype]}", launch.dynamic_smem)
    bias = b if b is not None else np.uint64(0)  # a null pointer: no bias
    rows_per_launch = _MAX_GRID_Y * launch.tile_m  # grid.y is limited; larger M runs in slices
    for m0 in range(0, M, rows_per_launch):
        rows = min(rows_per_launch, M - m0)
        x_rows, y_rows = (x, y) if rows == M else (x[m0:m0 + rows], y[m0:m0 + rows])
        grid = (-(-N // launch.tile_n), -(-rows // launch.tile_m), 1)
        kernel(grid, launch.block, (x_rows, w, bias, y_rows, np.int32(rows), np.int32(N), np.int32(K),
                                    np.int32(activations.KERNEL_CODES[activation])), shared_mem=launch.dynamic_smem)
    return y


def launch_custom(problem: LinearProblem, x, w, b):
    return launch_custom_version(_VERSIONS[problem.dtype][-1], x, w, b, problem.activation)
