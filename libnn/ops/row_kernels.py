"""The version scheme of libnn's row kernels, written once: kernels/layer_norm.cu (prefix "ln") and
kernels/embedding.cu ("emb") build the same three numbered versions over a row of width n, and the
same LAUNCH table; each op names its file's prefix and asks here which versions can run a row, which
one its custom path runs, and with what grid and block.

1) <prefix>1_warp_{vec,sca}{VPT}: a row per warp, 4 rows per 128-thread block, up to n = 1024.
2) <prefix>2_block_vec{VPT}: a row per block of up to 512 threads, in registers; 16-byte accesses only.
3) <prefix>3_loop: a row per 512-thread block, any n and alignment.

It also holds what the row-normalizing ops (layer_norm, rms_norm, embedding's fused LayerNorm) share
on the host: the checks of a weight or bias vector against the rows, of eps, of a fused residual and
return_sum, and the memory check of the float64 reference; and what layer_norm's and rms_norm's paths
share: the result of an empty problem and the float64 reference's rows and result (both ops' GPU runners
read pointers of C-contiguous arrays of any rank: runtime.arrays.copying_strided wraps them). And the row
stride that swiglu's and argmax's kernels read their rows at in place (row_stride), and their runner
(strided_rows_runner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.runtime import launch, memory
from libnn.runtime.arrays import array_module

WARP_MAX = 1024                # version 1 up to here (its largest VPT reaches it), version 2 beyond
BLOCK_MAX_THREADS = 512
WARP_VPTS = {"fp32": (1, 2, 4, 8), "fp16": (1, 2, 4), "bf16": (1, 2, 4)}  # what both kernel files build
BLOCK_VPTS = (2, 4, 8)
WARP_BLOCK_THREADS = 128       # version 1: 4 rows (warps) per block


def group(dtype: str) -> int:
    """V: the elements of one 16-byte group (4 fp32, 8 fp16/bf16)."""
    return 4 if dtype == "fp32" else 8


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def aligned(dtype: str, n: int, arrays) -> bool:
    """Whether the 16-byte (vec) kernels may run: whole groups per row and every array's pointer 16-byte
    aligned (None: an absent array)."""
    return n % group(dtype) == 0 and all(a.data.ptr % 16 == 0 for a in arrays if a is not None)


def row_stride(x) -> int | None:
    """The stride in elements between the rows of x (..., W) seen as (M, W), where a row kernel can read x as
    it lies (the last dimension contiguous, the leading dimensions one stride apart, rows not overlapping);
    None where x must be copied first (swiglu's and argmax's GPU paths)."""
    if x.ndim < 2:
        return x.shape[-1] if x.flags.c_contiguous else None
    strides, shape, size = x.strides, x.shape, x.itemsize
    if (x.shape[-1] > 1 and strides[-1] != size) or any(s % size for s in strides):
        return None
    lead = [(n, s // size) for n, s in zip(shape[:-1], strides[:-1]) if n > 1]
    if not lead:  # one row
        return shape[-1]
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != n * inner:  # the leading dimensions do not flatten to one stride
            return None
    ldx = lead[-1][1]
    return ldx if ldx >= shape[-1] else None  # rows must not overlap


def strided_rows_runner(kernel, new, copy: bool):
    """run(x) -> y for a row kernel launched as kernel(x, y) (swiglu's and argmax's custom paths): y from
    `new`, x read as it lies at its row_stride, or first copied to a contiguous array where `copy` (x's
    rows had no single stride)."""
    import cupy

    def run(x):
        y = new()
        kernel(cupy.ascontiguousarray(x) if copy else x, y)
        return y
    return run


@dataclass(frozen=True)
class RowKernels:
    """The versions of one kernel file, by its kernel names' prefix ("ln", "emb"), for problems whose row
    width is the attribute `width` ("N", "H") and whose rows are `problem.M`; `problem.dtype` is the
    short dtype name. An op's custom_versions, custom_version and launch geometry are this object's
    methods."""
    prefix: str
    width: str

    @property
    def warp(self) -> str:
        return f"{self.prefix}1_warp"

    @property
    def block(self) -> str:
        return f"{self.prefix}2_block"

    @property
    def loop(self) -> str:
        return f"{self.prefix}3_loop"

    def versions(self, problem, aligned: bool = True) -> tuple[str, ...]:
        """The numbered versions of the kernel file that can run `problem`, baseline first (for tests and
        benchmarks; the op's launch_custom takes one). `aligned`: whether the arrays allow the 16-byte
        kernels (`aligned()` says)."""
        V, n = group(problem.dtype), getattr(problem, self.width)
        found = []
        if n <= 32 * WARP_VPTS[problem.dtype][-1] * V:
            found.append(self.warp)
        if aligned and n <= BLOCK_MAX_THREADS * BLOCK_VPTS[-1] * V:
            found.append(self.block)
        return (*found, self.loop)

    def version(self, problem, aligned: bool) -> str:
        """The version the custom path runs: a warp per row up to width 1024, then a block per row in
        registers when the row can be moved 16 bytes at a time, else the loop."""
        if getattr(problem, self.width) <= WARP_MAX:
            return self.warp
        return self.block if self.block in self.versions(problem, aligned) else self.loop

    def launch(self, version: str, problem, vec: bool) -> tuple[str, int, int]:
        """(kernel name without the dtype suffix, grid, block) from the kernel file's LAUNCH table; `vec`:
        the 16-byte variant of version 1."""
        groups = ceil_div(getattr(problem, self.width), group(problem.dtype))  # V-element groups in a row
        if version == self.warp:
            vpt = next(v for v in WARP_VPTS[problem.dtype] if 32 * v >= groups)
            return (f"{self.warp}_{'vec' if vec else 'sca'}{vpt}",
                    min(ceil_div(problem.M, WARP_BLOCK_THREADS // 32), launch.GRID_STRIDE_BLOCKS), WARP_BLOCK_THREADS)
        if version == self.block:
            vpt = next(v for v in BLOCK_VPTS if BLOCK_MAX_THREADS * v >= groups)
            threads = 32 * ceil_div(ceil_div(groups, vpt), 32)  # the fewest warps that hold the row
            return f"{self.block}_vec{vpt}", min(problem.M, launch.GRID_STRIDE_BLOCKS), threads
        return self.loop, min(problem.M, launch.GRID_STRIDE_BLOCKS), BLOCK_MAX_THREADS


def require_version(op: str, version: str, problem: Any, aligned: bool, versions: tuple[str, ...]) -> None:
    """Refuse a version of kernels/<op>.cu that cannot run `problem` (`versions`: those that can)."""
    if version not in versions:
        raise ValueError(f"{op}: kernels/{op}.cu version {version!r} cannot run {problem.describe()} "
                         f"({'16-byte aligned' if aligned else 'not 16-byte aligned'}); it can run {versions}")


def check_affine(op: str, name: str, vector: Any, like: Any, like_name: str, width: str) -> None:
    """A LayerNorm's weight or bias, `vector`, of shape (N,) for `like`'s last dimension N and in its
    dtype; `width` says what N is (layer_norm's "last dimension", embedding's "hidden size")."""
    N = like.shape[-1]
    if tuple(vector.shape) != (N,):
        raise ValueError(f"{op}: {name} must have shape ({N},) to match {like_name}'s {width} "
                         f"({like_name} is {tuple(like.shape)}), got {tuple(vector.shape)}")
    if vector.dtype != like.dtype:
        raise TypeError(f"{op}: {name} has dtype {dtypes.short_name(vector.dtype)} but {like_name} has "
                        f"{dtypes.short_name(like.dtype)}; cast them to one dtype")


def check_eps(op: str, eps: Any) -> None:
    """A LayerNorm's eps: a finite number > 0 (TypeError for anything but a real number)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: eps must be a finite number > 0, got {type(eps).__name__} {eps!r}")
    if not eps > 0 or not math.isfinite(eps):
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")


def check_residual(op: str, residual: Any, x: Any, return_sum: Any) -> None:
    """A fused residual of x's shape and dtype (or None), and return_sum, which needs one."""
    if residual is not None:
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual has dtype {dtypes.short_name(residual.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    if not isinstance(return_sum, (bool, np.bool_)):
        raise TypeError(f"{op}: return_sum must be True or False, got {return_sum!r}")
    if return_sum and residual is None:
        raise ValueError(f"{op}: return_sum=True returns x + residual, but residual is None; pass "
                         "residual=, or leave return_sum False")


REFERENCE_COPIES = 3  # float64 arrays of x's size alive at once: the rows, a temporary (centered or squared), y


def reference_fits(op: str, M: int, N: int, dtype: str, return_sum: bool, shape: tuple[int, ...]) -> None:
    """Refuse, before any of it is allocated, a row normalization whose float64 reference would not fit
    in host RAM: its rows and temporaries, and the result (and the sum) in x's dtype."""
    outputs = 1 + return_sum
    memory.require(M * N * (8 * REFERENCE_COPIES + outputs * dtypes.parse(dtype).itemsize), "cpu", op,
                   f"x of shape {shape} in float64 (a copy and {REFERENCE_COPIES - 1} temporaries of its size)")


# --- layer_norm's and rms_norm's paths ---------------------------------------------------------------------
def empty_result(problem: Any, x: Any, *args: Any) -> Any:
    """The result when there are no rows or no columns: nothing to normalize (nor to add). `args`, the
    op's other arrays, are not read."""
    xp = array_module(x)
    y = xp.empty(x.shape, x.dtype)
    return (y, xp.empty(x.shape, x.dtype)) if problem.return_sum else y


def reference_rows(problem: Any, x: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    """h = x, or x + residual, as (M, N) rows in float64: what the references normalize."""
    rows = x.reshape(problem.M, problem.N).astype(np.float64)
    if residual is not None:
        rows += residual.reshape(problem.M, problem.N).astype(np.float64)
    return rows


def reference_result(problem: Any, x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> Any:
    """The float64 (M, N) result y, and with return_sum the rows h = x + residual, rounded once to x's dtype
    in x's shape."""
    y = y.astype(x.dtype).reshape(x.shape)
    return (y, rows.astype(x.dtype).reshape(x.shape)) if problem.return_sum else y
