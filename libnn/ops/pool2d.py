"""max_pool2d and avg_pool2d over (kh, kw) windows, for NHWC or NCHW tensors.

cuDNN's graph API has no pooling node (the frontend 1.28 Python API exposes none), so the GPU path is
our own kernels/pool2d.cu, checked against the NumPy reference.

Semantics follow PyTorch: max pooling ignores padded positions and propagates NaN; average pooling
counts padded positions in the divisor unless `count_include_pad=False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from libnn import dtypes
from libnn.ops.spatial import LAYOUTS, nhwc_strides, pair
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import allocator, as_array, contiguous, copying_strided, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("pool2d", order=("custom", "reference"))


@dataclass(frozen=True)
class PoolProblem:
    mode: str              # "max" or "avg"
    N: int
    H: int
    W: int
    C: int
    P: int
    Q: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    count_include_pad: bool
    dtype: str
    layout: str
    device: str

    def describe(self) -> str:
        return (f"{self.mode}_pool2d N={self.N} C={self.C} {self.H}x{self.W} kernel {self.kernel} "
                f"stride {self.stride} pad {self.padding} {self.dtype} {self.layout}")

    @property
    def bytes_moved(self) -> int:
        return (self.N * self.C * (self.H * self.W + self.P * self.Q)) * np.dtype(dtypes.parse(self.dtype)).itemsize

    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.P, self.Q, self.C) if self.layout == "NHWC" else (self.N, self.C, self.P, self.Q)


def pool2d_problem(mode, x, kernel_size, stride, padding, count_include_pad, layout) -> PoolProblem:
    """The PoolProblem `mode`_pool2d ("max" or "avg") solves for x (already an array), after checking
    every argument as the op does; for tools that need its sizes (bytes_moved) without running it."""
    name = f"{mode}_pool2d"
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout must be one of {LAYOUTS}, got {layout!r}")
    if x.ndim != 4:
        raise ValueError(f"{name}: x must be 4-D ({', '.join(layout)}), got shape {tuple(x.shape)}")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"{name}: x must be a floating-point array, got {x.dtype}")
    if not isinstance(count_include_pad, (bool, np.bool_)):  # "no" would mean yes
        raise TypeError(f"{name}: count_include_pad must be True or False, got {type(count_include_pad).__name__} "
                        f"{count_include_pad!r}")
    kernel = pair(name, "kernel_size", kernel_size, 1)
    stride = kernel if stride is None else pair(name, "stride", stride, 1)
    padding = pair(name, "padding", padding, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"{name}: padding {padding} must be at most half the kernel size {kernel}")
    N, H, W, C = x.shape if layout == "NHWC" else (x.shape[0], x.shape[2], x.shape[3], x.shape[1])
    P = (H + 2 * padding[0] - kernel[0]) // stride[0] + 1
    Q = (W + 2 * padding[1] - kernel[1]) // stride[1] + 1
    if P < 1 or Q < 1:
        raise ValueError(f"{name}: the {kernel[0]}x{kernel[1]} window is larger than the padded "
                         f"{H + 2 * padding[0]}x{W + 2 * padding[1]} input")
    problem = PoolProblem(mode, N, H, W, C, P, Q, kernel, stride, padding, bool(count_include_pad),
                          dtypes.short_name(x.dtype), layout, device_of({"x": x}, name))
    if problem.device == "cpu":  # host arrays run on the reference path
        _reference_fits(problem)
    return problem


def _reference_fits(p: PoolProblem) -> None:
    """Refuse a problem whose reference computation would not fit in host RAM before any of it is
    allocated. The reference holds x and x padded in float64, and stacks every window position of
    the output: kh·kw output-sized arrays (a large kernel at a small stride multiplies them)."""
    padded = p.N * (p.H + 2 * p.padding[0]) * (p.W + 2 * p.padding[1]) * p.C
    output = p.N * p.P * p.Q * p.C
    memory.require(8 * (p.N * p.H * p.W * p.C + padded + (p.kernel[0] * p.kernel[1] + 2) * output), "cpu",
                   f"{p.mode}_pool2d", f"kernel_size {p.kernel} at stride {p.stride} on x of "
                   f"{p.N}x{p.H}x{p.W}x{p.C} (N, H, W, C) (the reference path's float64 buffers)")


def max_pool2d(x: Any, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0, *, layout: str = "NHWC", path: str = "auto") -> Any:
    """Max over each window; stride defaults to the kernel size (PyTorch's default)."""
    # each function builds its own key (no shared helper's frame per call); max's count_include_pad is
    # always True, so it is not keyed
    x = as_array(x, "max_pool2d", "x")
    key = ("max", signature(x), option_key(kernel_size), option_key(stride), option_key(padding), layout, path,
           stream_key())
    return op.call(key, pool2d_problem, path, x, checks=("max", x, kernel_size, stride, padding, True, layout))


def avg_pool2d(x: Any, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0, *, count_include_pad: bool = True, layout: str = "NHWC",
               path: str = "auto") -> Any:
    """Mean over each window; stride defaults to the kernel size (PyTorch's default)."""
    x = as_array(x, "avg_pool2d", "x")
    key = ("avg", signature(x), option_key(kernel_size), option_key(stride), option_key(padding),
           type(count_include_pad), count_include_pad, layout, path, stream_key())
    return op.call(key, pool2d_problem, path, x,
                   checks=("avg", x, kernel_size, stride, padding, count_include_pad, layout))


def _gpu_support(problem: PoolProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: PoolProblem, x):
    return bind_pool(problem, x)


_POOL = contracts.params("pool2d.cu", "POOL_PARAMS")  # every pooling kernel's parameters


def _pool_args(p: PoolProblem, x, y) -> tuple:
    """The arguments of every kernel of kernels/pool2d.cu, by the names POOL_PARAMS gives them."""
    (sxn, sxh, sxw, sxc), (syn, syh, syw, syc) = nhwc_strides(p.layout, p.C, p.H, p.W), nhwc_strides(p.layout, p.C,
                                                                                                       p.P, p.Q)
    (kh, kw), (stride_h, stride_w), (pad_h, pad_w) = p.kernel, p.stride, p.padding
    return _POOL.pack(x=x, y=y, N=p.N, H=p.H, W=p.W, C=p.C, P=p.P, Q=p.Q, kh=kh, kw=kw, stride_h=stride_h,
                      stride_w=stride_w, pad_h=pad_h, pad_w=pad_w, count_include_pad=int(p.count_include_pad),
                      sxn=sxn, sxh=sxh, sxw=sxw, sxc=sxc, syn=syn, syh=syh, syw=syw, syc=syc)


def bind_pool(problem: PoolProblem, x):
    """The runner of kernels/pool2d.cu for x of this signature: the 16-byte NHWC kernel for max pooling,
    the general one otherwise; a strided x is made contiguous first."""
    p = problem
    vectorized = p.mode == "max" and p.layout == "NHWC"
    name = "maxpool_nhwc_vec" if vectorized else f"{p.mode}pool"
    lanes = (4 if p.dtype == "fp32" else 8) if vectorized else 1
    threads_per_image = p.P * p.Q * -(-p.C // lanes)
    grid = (min(-(-threads_per_image // 256), launch.GRID_STRIDE_BLOCKS_X), min(p.N, launch.MAX_GRID_YZ))
    kernel = launch.bind("pool2d.cu", f"{name}_{dtypes.KERNEL_SUFFIX[p.dtype]}", grid, (256,),
                         _pool_args(p, launch.ARRAY, launch.ARRAY))
    new = allocator(p.output_shape(), x.dtype)

    def run(x):
        y = new()
        kernel(x, y)
        return y
    return copying_strided(run, x)


def launch_pool(problem: PoolProblem, x):
    """y for x with kernels/pool2d.cu (for benchmarks and tests; bound calls keep `bind_pool`'s runner)."""
    return bind_pool(problem, x)(x)


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: PoolProblem, x):
    p = problem
    x = contiguous(x)
    xs = x.astype(np.float64)
    if p.layout == "NCHW":
        xs = xs.transpose(0, 2, 3, 1)
    (kh, kw), (sh, sw), (ph, pw) = p.kernel, p.stride, p.padding
    fill = -np.inf if p.mode == "max" else 0.0
    padded = np.pad(xs, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=fill)
    windows = [padded[:, r: r + (p.P - 1) * sh + 1: sh, s: s + (p.Q - 1) * sw + 1: sw, :]
               for r in range(kh) for s in range(kw)]
    stack = np.stack(windows)
    if p.mode == "max":
        out = np.max(stack, axis=0)  # np.max propagates NaN
    elif p.count_include_pad:
        out = np.sum(stack, axis=0) / (kh * kw)
    else:
        valid = np.pad(np.ones((1, p.H, p.W, 1)), ((0, 0), (ph, ph), (pw, pw), (0, 0)))
        counts = sum(valid[:, r: r + (p.P - 1) * sh + 1: sh, s: s + (p.Q - 1) * sw + 1: sw, :]
                     for r in range(kh) for s in range(kw))
        out = np.sum(stack, axis=0) / counts
    if p.layout == "NCHW":
        out = out.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out).astype(x.dtype)
