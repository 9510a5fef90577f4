"""softmax: y = exp(x - max) / sum(exp(x - max)) along one dimension; with log=True the log-softmax
y = (x - max) - log(sum(exp(x - max))), computed as that difference (not as log(softmax)) so that
it stays finite where softmax underflows to 0.

x is any array of 1 or more dimensions; `dim` counts as in PyTorch (negative from the end) and
refers to the array's own axes (an NHWC image batch has its channels at dim=-1). y has x's shape,
dtype and device. Semantics follow PyTorch: NaN anywhere in a slice makes the whole slice NaN, and a
slice that is all -inf (or holds +inf) gives NaN.

Paths, in `auto` order:
- custom:    kernels/softmax.cu, one launch: x seen as (outer, n, inner) around `dim`, a row per warp
             group in registers for the last dim up to n = 1024, a row per block beyond, threads over
             the inner positions otherwise (see the kernel file). fp16/bf16/fp32 compute in fp32, fp64
             in fp64. A strided x is copied to a contiguous one first (one more pass, as pool2d does),
             so every layout is taken.
- cupy:      CuPy array arithmetic on the GPU (CuPy's generated elementwise and reduction kernels,
             hence kind "library"): max, subtract, exp, sum, one pass each; fp16/bf16 inputs are
             computed in fp32 and rounded once at the end. Kept to compare against: four passes
             launched from Python, where custom's bound call is one allocation and one launch (host
             cost per call: benchmarks/RESULTS.md).
- reference: NumPy in float64, rounded to x's dtype once at the end; it refuses, before allocating,
             an x whose float64 copy and temporaries would not fit in host RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import allocator, as_array, copying_strided, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32", "fp64")

op = Op("softmax", order=("custom", "cupy", "reference"))


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
    def output_bytes(self) -> int:
        return memory.array_bytes(self.shape, dtypes.parse(self.dtype))

    @property
    def bytes_moved(self) -> int:
        return 2 * self.output_bytes

    @property
    def outer(self) -> int:
        """The slices before `dim`: x is (outer, n, inner) around it."""
        return int(np.prod(self.shape[:self.dim], dtype=object))

    @property
    def n(self) -> int:
        return self.shape[self.dim]

    @property
    def inner(self) -> int:
        return int(np.prod(self.shape[self.dim + 1:], dtype=object))


def softmax_problem(x, dim, log: bool) -> SoftmaxProblem:
    name = "log_softmax" if log else "softmax"
    if not isinstance(log, (bool, np.bool_)):  # log="no" would otherwise read as true
        raise TypeError(f"softmax: log must be a bool, got {type(log).__name__} {log!r}")
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have at least 1 dimension, got a scalar (shape ())")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for x of shape {tuple(x.shape)} "
                         f"(expected {-x.ndim}..{x.ndim - 1})")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"{name}: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    return SoftmaxProblem(tuple(x.shape), int(dim) % x.ndim, bool(log), dtypes.short_name(x.dtype),
                          device_of({"x": x}, name))


def softmax(x: Any, dim: int = -1, *, log: bool = False, path: str = "auto") -> Any:
    """softmax (or, with log=True, log-softmax) of x along `dim`; returns an array of x's shape,
    dtype and device. `path` is "auto" or one of `libnn.paths("softmax")`."""
    x = as_array(x, "log_softmax" if log else "softmax", "x")
    # option_key's keys without its call in the common cases: an exact int dim is its own key, and log is
    # keyed with its type (log=1 never finds the bound call of True and skips the check that refuses it)
    key = (signature(x), dim if type(dim) is int else option_key(dim), type(log), log, path, stream_key())
    return op.call(key, softmax_problem, path, x, checks=(x, dim, log))


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


# --- custom path: kernels/softmax.cu -----------------------------------------------------------------
KERNEL_SUFFIX = dtypes.KERNEL_SUFFIX_WITH_F64  # softmax.cu also builds fp64 kernels
WARP_MAX_N = 1024              # softmax_warp* up to here (32 lanes x its largest VPT), softmax_block_* beyond
_SM = contracts.params("softmax.cu", "SM_PARAMS")  # every softmax kernel's parameters
_WARP_VPTS = (1, 2, 4, 8, 16, 32)  # what kernels/softmax.cu builds
_WARP_BLOCK = 128
COLS_MAX_Y = contracts.constant("softmax.cu", "COLS_MAX_Y")  # threads per slice in softmax_cols_*


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def custom_launch(problem: SoftmaxProblem) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(kernel name without the dtype suffix, grid, block) from kernels/softmax.cu's LAUNCH table."""
    outer, n, inner = problem.outer, problem.n, problem.inner
    if inner == 1 and n <= WARP_MAX_N:
        lanes = min(32, _pow2_at_least(n))  # the kernel derives the same group size from n
        vpt = next(v for v in _WARP_VPTS if lanes * v >= n)
        return (f"softmax_warp{vpt}", (min(_ceil_div(outer, _WARP_BLOCK // lanes), launch.GRID_STRIDE_BLOCKS),),
                (_WARP_BLOCK,))
    if inner == 1:
        # about 8 elements a thread before the block grows to 1024: long rows, often few of them, get
        # every thread a block may have (not yet tuned on the H100)
        return "softmax_block", (min(outer, launch.GRID_STRIDE_BLOCKS),), (min(1024, _pow2_at_least(_ceil_div(n, 8))),)
    # threads per slice: about n / 8, so short slices (3 channels) leave no thread without an element
    y = min(COLS_MAX_Y, _pow2_at_least(_ceil_div(n, 8)))
    return "softmax_cols", (min(_ceil_div(outer * inner, 32), launch.GRID_STRIDE_BLOCKS),), (32, y)


def bind_custom(problem: SoftmaxProblem, x, grid: tuple[int, ...] | None = None):
    """The runner of kernels/softmax.cu for x of this signature: y from CuPy's pool, one packed
    launch; a strided x is made contiguous first. `grid` replaces the LAUNCH table's grid (tests:
    every kernel strides over its rows or slices, so any grid >= 1 is correct)."""
    new = allocator(problem.shape, x.dtype)
    if 0 in problem.shape:  # no slice to normalise, nothing to launch
        return lambda x: new()
    name, table_grid, block = custom_launch(problem)
    kernel = launch.bind("softmax.cu", f"{name}_{KERNEL_SUFFIX[problem.dtype]}", grid or table_grid, block,
                         _SM.pack(x=launch.ARRAY, y=launch.ARRAY, outer=problem.outer, n=problem.n,
                                  inner=problem.inner, log=problem.log))

    def run(x):
        y = new()
        kernel(x, y)
        return y
    return copying_strided(run, x)


op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)(bind_custom)


# --- cupy path ---------------------------------------------------------------------------------------
@op.path("cupy", kind="library", device="gpu", supports=_gpu_support)
def _cupy(problem: SoftmaxProblem, x):
    import cupy

    compute = cupy.float64 if problem.dtype == "fp64" else cupy.float32  # fp16/bf16: exp and sum in fp32
    return _formula(cupy, x.astype(compute, copy=False), problem.dim, problem.log).astype(x.dtype, copy=False)


# --- reference ---------------------------------------------------------------------------------------
REFERENCE_COPIES = 4  # float64 arrays of x's size alive at once: x's copy, x - max, exp, the quotient


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: SoftmaxProblem, x):
    memory.require(REFERENCE_COPIES * x.size * 8, "cpu", "log_softmax" if problem.log else "softmax",
                   f"x of shape {problem.shape} in float64 (a copy and {REFERENCE_COPIES - 1} temporaries "
                   "of its size)")
    return _formula(np, x.astype(np.float64), problem.dim, problem.log).astype(x.dtype, copy=False)
