"""softmax: y = exp(x - max) / sum(exp(x - max)) along one dimension; with log=True the log-softmax
y = (x - max) - log(sum(exp(x - max))), computed as that difference (not as log(softmax)) so that
it stays finite where softmax underflows to 0.

x is any array of 1 or more dimensions; `dim` counts as in PyTorch (negative from the end) and
refers to the array's own axes (an NHWC image batch has its channels at dim=-1). y has x's shape,
dtype and device. Semantics follow PyTorch: NaN anywhere in a slice makes the whole slice NaN, and a
slice that is all -inf gives NaN.

Paths, in `auto` order:
- custom:    CuPy array arithmetic on the GPU (CuPy's generated elementwise and reduction kernels,
             hence kind "library"): max, subtract, exp, sum, one pass each; fp16/bf16 inputs are
             computed in fp32 and rounded once at the end.
- reference: NumPy in float64, rounded to x's dtype once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op
from libnn.runtime.arrays import as_array, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32", "fp64")

op = Op("softmax", order=("custom", "reference"))


@dataclass(frozen=True)
class SoftmaxProblem:
    shape: tuple[int, ...]
    dim: int               # normalised to 0..ndim-1
    log: bool
    dtype: str
    device: str

    def describe(self) -> str:
        return f"{'log_' if self.log else ''}softmax shape {self.shape} dim {self.dim} {self.dtype}"

    @property
    def bytes_moved(self) -> int:
        return 2 * int(np.prod(self.shape)) * np.dtype(dtypes.parse(self.dtype)).itemsize


def _check(x, dim, log: bool) -> SoftmaxProblem:
    name = "log_softmax" if log else "softmax"
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have at least 1 dimension, got a scalar (shape ())")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for x of shape {tuple(x.shape)} "
                         f"(expected {-x.ndim}..{x.ndim - 1})")
    if x.dtype.kind != "f" and dtypes.short_name(x.dtype) != "bf16":
        raise TypeError(f"{name}: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    return SoftmaxProblem(tuple(x.shape), int(dim) % x.ndim, bool(log), dtypes.short_name(x.dtype),
                          device_of({"x": x}, name))


def softmax(x: Any, dim: int = -1, *, log: bool = False, path: str = "auto") -> Any:
    """softmax (or, with log=True, log-softmax) of x along `dim`; returns an array of x's shape,
    dtype and device. `path` is "auto" or one of `libnn.paths("softmax")`."""
    x = as_array(x, "log_softmax" if log else "softmax", "x")
    key = (signature(x), dim, log, path, stream_key())
    return op.call(key, lambda: _check(x, dim, log), path, x)


def _formula(xp, x, dim: int, log: bool):
    """The max-subtracted formula in x's dtype (the caller picks the compute dtype)."""
    if x.size == 0:  # no slice to reduce (max of an empty axis is an error in NumPy and CuPy)
        return x.copy()
    z = x - x.max(axis=dim, keepdims=True)
    if log:
        return z - xp.log(xp.exp(z).sum(axis=dim, keepdims=True))
    e = xp.exp(z)
    return e / e.sum(axis=dim, keepdims=True)


def _gpu_support(problem: SoftmaxProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


@op.path("custom", kind="library", device="gpu", supports=_gpu_support)
def _custom(problem: SoftmaxProblem, x):
    import cupy

    compute = cupy.float64 if problem.dtype == "fp64" else cupy.float32  # fp16/bf16: exp and sum in fp32
    return _formula(cupy, x.astype(compute, copy=False), problem.dim, problem.log).astype(x.dtype, copy=False)


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: SoftmaxProblem, x):
    return _formula(np, x.astype(np.float64), problem.dim, problem.log).astype(x.dtype, copy=False)
