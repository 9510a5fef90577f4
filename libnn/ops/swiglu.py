"""swiglu: y = silu(gate) · up, the gated activation of LLaMA's MLP, with gate and up the two halves of
the last dimension of one array: what one GEMM on the concatenated gate_proj and up_proj weights gives.

x is (..., 2F): x[..., :F] is the gate, x[..., F:] is up (Hugging Face's gate_proj rows first, then
up_proj's, in the gate_up weight); y is (..., F), in x's dtype, on x's device:

    y = silu(x[..., :F]) * x[..., F:],   silu(v) = v / (1 + exp(-v))

fp16/bf16 compute in fp32 on the GPU and round once; Hugging Face's LlamaMLP rounds silu(gate) to the
activations' dtype before the product, one rounding more (within the fp16/bf16 tolerance of either).
NaN propagates; silu(-inf) is NaN (-inf / inf), as PyTorch's x · sigmoid(x) gives.

Paths, in `auto` order (no library path: cuBLASLt's epilogues have no gated activation, and the
cuDNN frontend would need a slice of one tensor into two, which its graph API does not express):
- custom:    kernels/swiglu.cu, one memory-bound pass: 16-byte loads of gate and up and a 16-byte store
             where F and x's row stride are multiples of 16 bytes and x is 16-byte aligned (swiglu2),
             an element per thread otherwise (swiglu1); fp16, bf16, fp32. x's rows may lie at any
             stride with the last dimension contiguous (a slice of a wider array is read in place);
             any other layout is copied to a contiguous one first.
- reference: NumPy in float64, rounded to x's dtype once at the end (fp64 too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op
from libnn.runtime import contracts, launch, memory
from libnn.ops.row_kernels import row_stride, strided_rows_runner
from libnn.runtime.arrays import allocator, as_array, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")
DTYPES = GPU_DTYPES + ("fp64",)  # fp64: the reference path

op = Op("swiglu", order=("custom", "reference"))


@dataclass(frozen=True)
class SwigluProblem:
    """Everything that decides how a swiglu call runs."""
    shape: tuple[int, ...]  # x's shape, (..., 2F)
    dtype: str              # short name: fp16, bf16, fp32, fp64
    device: str             # "cpu" or "gpu:N"

    @property
    def F(self) -> int:
        """The output's last dimension: half of x's."""
        return self.shape[-1] // 2

    @property
    def M(self) -> int:
        """Rows: the product of x's leading dimensions."""
        return math.prod(self.shape[:-1])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.F)

    def describe(self) -> str:
        return f"swiglu M={self.M} F={self.F} {self.dtype}"

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes(self.out_shape, dtypes.parse(self.dtype))

    @property
    def bytes_moved(self) -> int:
        """gate and up read, y written, once."""
        return 3 * self.output_bytes


def swiglu_problem(x) -> SwigluProblem:
    """The checked problem of a swiglu call (errors name the op and the argument)."""
    if x.ndim < 1:
        raise ValueError("swiglu: x must have at least 1 dimension (..., 2F), got a 0-d array")
    # float128 too: the reference would compute it in float64
    if not dtypes.is_float(x.dtype) or dtypes.short_name(x.dtype) not in DTYPES:
        raise TypeError(f"swiglu: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: x's last dimension must be even, gate and up halves of 2F (one gate_up GEMM's "
                         f"output), got {x.shape[-1]} (x of shape {tuple(x.shape)})")
    return SwigluProblem(tuple(int(n) for n in x.shape), dtypes.short_name(x.dtype), device_of({"x": x}, "swiglu"))


def swiglu(x: Any, *, path: str = "auto") -> Any:
    """silu(x[..., :F]) * x[..., F:] for x (..., 2F); returns a new (..., F) array in x's dtype, on x's
    device. `path` is "auto" or one of `libnn.paths("swiglu")`."""
    x = as_array(x, "swiglu", "x")
    key = (signature(x), path, stream_key())
    return op.call(key, lambda: swiglu_problem(x), path, x)


def _gpu_support(problem: SwigluProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- custom path: kernels/swiglu.cu ----------------------------------------------------------------------
_SWIGLU = contracts.params("swiglu.cu", "SWIGLU_PARAMS")  # every swiglu kernel's parameters
SWIGLU_THREADS = contracts.constant("swiglu.cu", "SWIGLU_THREADS")
VERSIONS = ("swiglu1_scalar", "swiglu2_vec")


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def aligned(problem: SwigluProblem, ldx: int, x_pointer: int, y_pointer: int) -> bool:
    """Whether swiglu2 (16-byte vectors) may run: F and the row stride whole vectors, x and y 16-byte
    aligned."""
    vector = 16 // dtypes.parse(problem.dtype).itemsize
    return problem.F % vector == 0 and ldx % vector == 0 and x_pointer % 16 == 0 and y_pointer % 16 == 0


def custom_versions(problem: SwigluProblem, aligned: bool = True) -> tuple[str, ...]:
    """The versions of kernels/swiglu.cu that can run `problem`, baseline first, the custom path's last."""
    return VERSIONS if aligned else VERSIONS[:1]


def custom_launch(problem: SwigluProblem, version: str) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """(kernel name, grid, block) from kernels/swiglu.cu's LAUNCH table."""
    cols = problem.F // (16 // dtypes.parse(problem.dtype).itemsize) if version == "swiglu2_vec" else problem.F
    bx = min(SWIGLU_THREADS, max(32, _pow2_at_least(cols)))
    by = SWIGLU_THREADS // bx
    grid = (min(-(-cols // bx), launch.GRID_STRIDE_BLOCKS), min(-(-problem.M // by), launch.GRID_STRIDE_BLOCKS))
    return f"{version}_{dtypes.KERNEL_SUFFIX[problem.dtype]}", grid, (bx, by)


def bind_custom(problem: SwigluProblem, x, version: str | None = None, geometry=None):
    """The runner of kernels/swiglu.cu for x of this signature: y from CuPy's pool (256-byte aligned),
    one packed launch; x copied first only where its rows are not one stride apart with a contiguous
    last dimension. `version` forces one of custom_versions (tests); `geometry`, (grid, block), replaces
    the LAUNCH table's (both loops are grid-strided, so any grid >= 1 and block up to SWIGLU_THREADS
    threads is correct)."""
    out_shape, dtype = problem.out_shape, x.dtype
    new = allocator(out_shape, dtype)
    if problem.M == 0 or problem.F == 0:  # nothing to compute
        return lambda x: new()
    ldx = row_stride(x)
    copy = ldx is None
    if copy:
        ldx = 2 * problem.F
    # y comes from CuPy's pool (256-byte aligned); x's pointer alignment is part of the signature
    versions = custom_versions(problem, aligned(problem, ldx, 0 if copy else x.data.ptr, 0))
    version = version or versions[-1]
    if version not in versions:
        raise ValueError(f"swiglu: kernels/swiglu.cu version {version!r} cannot run {problem.describe()} with this "
                         f"layout (F, row stride {ldx} and x's alignment allow {versions})")
    name, grid, block = custom_launch(problem, version)
    grid, block = geometry or (grid, block)
    kernel = launch.bind("swiglu.cu", name, grid, block,
                         _SWIGLU.pack(x=launch.ARRAY, y=launch.ARRAY, M=problem.M, F=problem.F, ldx=ldx),
                         programmatic=launch.programmatic_supported(problem.device))
    return strided_rows_runner(kernel, new, copy)


op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)(bind_custom)


def launch_custom(x, version: str | None = None, geometry=None):
    """y for x (a CuPy array) with one version of kernels/swiglu.cu and, optionally, another launch
    geometry (for tests and benchmarks)."""
    x = as_array(x, "swiglu", "x")
    return bind_custom(swiglu_problem(x), x, version, geometry)(x)


# --- reference -------------------------------------------------------------------------------------------
REFERENCE_COPIES = 4  # float64 arrays of y's size alive at once: gate, up, exp(-gate), the result


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: SwigluProblem, x):
    memory.require(REFERENCE_COPIES * problem.M * problem.F * 8, "cpu", "swiglu",
                   f"x of shape {problem.shape} in float64 ({REFERENCE_COPIES} arrays of the output's size)")
    F = problem.F
    gate, up = x[..., :F].astype(np.float64), x[..., F:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # exp(-gate) = inf below -709: silu is -0 there
        y = gate / (1.0 + np.exp(-gate)) * up
    return y.astype(x.dtype)
