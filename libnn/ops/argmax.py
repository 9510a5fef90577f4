"""argmax: the index of each row's largest value, along the last axis: a decoder's greedy next token (and
the Gumbel-max trick's draw when it samples) from its logits.

x is (..., N), N >= 1; the result is int64 (...), on x's device:

    y[...] = the first n whose x[..., n] is the row's largest value, a NaN counting as larger than any
             number (NumPy's argmax: the first NaN of a row that has one)

The result is exact on every path (no arithmetic: comparisons of values that fp16 and bf16 hold exactly in
fp32), so the paths agree element for element.

Paths, in `auto` order:
- custom:    kernels/argmax.cu, a block of 1024 threads per row, the row read in 16-byte vectors, four a
             thread in flight; fp16, bf16, fp32; rows of up to 2^31 - 1 values. Rows one stride apart with
             the last dimension contiguous are read in place (a slice of wider logits); any other layout is
             copied to a contiguous one first.
             CuPy's argmax of (1, 32000) fp16 logits, a 1.1B LLaMA's at batch 1, took 20 µs on the H100, and
             49 µs at batch 8 (`libnn bench argmax`; benchmarks/RESULTS.md, seventeenth session).
- cupy:      cupy.argmax(x, axis=-1), and where a row has a NaN the first one, by an argmax of isnan(x): the
             property test (tests/property_cases.py) found cupy.argmax alone off NumPy's index on rows with
             NaNs among its draws of dtypes and layouts (contiguous fp16 and fp32 rows of 1000 and 50257
             values agreed on the H100; which draws differed was not isolated). bf16 goes through its bits
             as float32 (CuPy's arithmetic takes no bf16; the order of the values is the same).
- reference: NumPy's argmax on the host (fp64 too; bf16 as float32, exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops.row_kernels import row_stride, strided_rows_runner
from libnn.registry import Op
from libnn.runtime import contracts, launch
from libnn.runtime.arrays import allocator, as_array, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")
DTYPES = GPU_DTYPES + ("fp64",)  # fp64: the reference path
INT32_MAX = 2**31 - 1  # the custom kernel's row length at most (int indices)

op = Op("argmax", order=("custom", "cupy", "reference"))


@dataclass(frozen=True)
class ArgmaxProblem:
    """Everything that decides how an argmax call runs."""
    shape: tuple[int, ...]  # x's shape, (..., N)
    dtype: str              # short name: fp16, bf16, fp32, fp64
    device: str             # "cpu" or "gpu:N"

    @property
    def N(self) -> int:
        return self.shape[-1]

    @property
    def M(self) -> int:
        """Rows: the product of x's leading dimensions."""
        return math.prod(self.shape[:-1])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.shape[:-1]

    def describe(self) -> str:
        return f"argmax M={self.M} N={self.N} {self.dtype}"


def argmax_problem(x) -> ArgmaxProblem:
    """The checked problem of an argmax call (errors name the op and the argument)."""
    if x.ndim < 1:
        raise ValueError("argmax: x must have at least 1 dimension (..., N), got a 0-d array")
    if not dtypes.is_float(x.dtype) or dtypes.short_name(x.dtype) not in DTYPES:
        raise TypeError(f"argmax: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError(f"argmax: x's last dimension must hold at least one value (an empty row has no "
                         f"largest), got shape {tuple(x.shape)}")
    return ArgmaxProblem(tuple(int(n) for n in x.shape), dtypes.short_name(x.dtype), device_of({"x": x}, "argmax"))


def argmax(x: Any, *, path: str = "auto") -> Any:
    """The index of the largest value of each row of x (..., N) along its last axis, the first one on ties
    and the first NaN where a row has one: a new int64 (...) array on x's device. `path` is "auto" or one
    of `libnn.paths("argmax")`."""
    x = as_array(x, "argmax", "x")
    key = (signature(x), path, stream_key())
    return op.call(key, argmax_problem, path, x, checks=(x,))


def _gpu_support(problem: ArgmaxProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


def _custom_support(problem: ArgmaxProblem) -> str | None:
    if problem.N > INT32_MAX:
        return f"rows of N = {problem.N} values exceed kernels/argmax.cu's int indices (N <= {INT32_MAX})"
    return _gpu_support(problem)


# --- custom path: kernels/argmax.cu ----------------------------------------------------------------------
_ARGMAX = contracts.params("argmax.cu", "ARGMAX_PARAMS")
ARGMAX_THREADS = contracts.constant("argmax.cu", "ARGMAX_THREADS")


def custom_launch(problem: ArgmaxProblem) -> tuple[str, tuple[int], tuple[int]]:
    """(kernel name, grid, block) from kernels/argmax.cu's LAUNCH table."""
    grid = (min(problem.M, launch.GRID_STRIDE_BLOCKS),)
    return f"argmax1_{dtypes.KERNEL_SUFFIX[problem.dtype]}", grid, (ARGMAX_THREADS,)


def bind_custom(problem: ArgmaxProblem, x):
    """The runner of kernels/argmax.cu for x of this signature: y from CuPy's pool, one packed launch; x
    copied first only where its rows are not one stride apart with a contiguous last dimension."""
    new = allocator(problem.out_shape, np.int64)
    if problem.M == 0:
        return lambda x: new()
    ldx = row_stride(x)
    copy = ldx is None
    name, grid, block = custom_launch(problem)
    kernel = launch.bind("argmax.cu", name, grid, block,
                         _ARGMAX.pack(x=launch.ARRAY, y=launch.ARRAY, M=problem.M, N=problem.N,
                                      ldx=problem.N if copy else ldx),
                         programmatic=launch.programmatic_supported(problem.device))
    return strided_rows_runner(kernel, new, copy)


op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)(bind_custom)


# --- cupy path --------------------------------------------------------------------------------------------
@op.path("cupy", kind="library", device="gpu", supports=_gpu_support)
def _cupy(problem: ArgmaxProblem, x):
    import cupy

    x = as_cupy_float(x)
    nan = cupy.isnan(x)
    return cupy.where(nan.any(axis=-1), cupy.argmax(nan, axis=-1), cupy.argmax(x, axis=-1))


def as_cupy_float(x):
    """x as CuPy compares it: bf16 as float32 (the same values, so the same order), else x."""
    return dtypes.bf16_as_float32(x) if dtypes.short_name(x.dtype) == "bf16" else x


# --- reference -------------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: ArgmaxProblem, x):
    values = x.astype(np.float32) if problem.dtype == "bf16" else x
    return np.asarray(np.argmax(values, axis=-1), dtype=np.int64)  # a 0-d array for one row, as CuPy's
