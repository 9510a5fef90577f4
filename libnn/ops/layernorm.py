"""layer_norm: y = (x − mean) / sqrt(var + eps) · weight + bias over the last dimension of x.

x is (..., N); weight and bias are (N,) or None (then 1 and 0); mean and the biased variance are
taken over each row of N elements, like torch.nn.functional.layer_norm(x, (N,), weight, bias, eps).
y has x's shape, dtype and device. fp16/bf16 compute in fp32 on the GPU paths.

Paths, in `auto` order (custom first: on the H100 it matched or beat cuDNN's bandwidth on the
common shapes, 2.72 vs 2.67 TB/s at 131072×768 fp16, and costs a third of the host time per call,
41 vs 124 µs; cuDNN is faster on the rows only the looping kernel takes, odd N past 1024 or longer
than a block holds, e.g. 1024×65536, so for those auto tries cudnn first):
- custom:    kernels/layernorm.cu (a row per warp up to N = 1024, a row per block in registers
             beyond, a looping row per block for the longest or unaligned rows).
- cudnn:     the cuDNN frontend's layernorm node in its INFERENCE phase (no mean or inv_var
             outputs), fp32 compute. cuDNN's node requires scale and bias tensors, so a missing
             weight or bias is passed as a cached vector of ones or zeros; eps is a pass-by-value
             input, so one graph serves every eps. A shape cuDNN declines raises LibraryError.
- reference: NumPy in float64, rounded to x's dtype once at the end.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.errors import LibraryError
from libnn.registry import Op
from libnn.runtime.arrays import (array_module, as_array, contiguous, device_constant, device_of, signature,
                                  stream_key)
from libnn.runtime.cache import PlanCache

GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("layer_norm", order=("custom", "cudnn", "reference"))


@dataclass(frozen=True)
class LayerNormProblem:
    """Everything that decides how a layer_norm call runs."""
    M: int                # rows: the product of x's leading dimensions
    N: int                # the normalized (last) dimension
    dtype: str            # short name: fp16, bf16, fp32, fp64
    has_weight: bool
    has_bias: bool
    eps: float
    device: str           # "cpu" or "gpu:N"

    def describe(self) -> str:
        affine = "+".join(filter(None, ["weight" if self.has_weight else None,
                                        "bias" if self.has_bias else None])) or "no affine"
        return f"layer_norm M={self.M} N={self.N} {self.dtype} eps={self.eps:g} ({affine})"

    @property
    def bytes_moved(self) -> int:
        """x read and y written once (weight and bias are negligible next to them)."""
        return 2 * self.M * self.N * dtypes.parse(self.dtype).itemsize


def _check(x, weight, bias, eps) -> LayerNormProblem:
    if x.ndim < 1:
        raise ValueError("layer_norm: x must have at least 1 dimension (..., N), got a 0-d array")
    if x.dtype.kind != "f" and dtypes.short_name(x.dtype) != "bf16":
        raise TypeError(f"layer_norm: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    N = x.shape[-1]
    for name, a in (("weight", weight), ("bias", bias)):
        if a is None:
            continue
        if tuple(a.shape) != (N,):
            raise ValueError(f"layer_norm: {name} must have shape ({N},) to match x's last dimension "
                             f"(x is {tuple(x.shape)}), got {tuple(a.shape)}")
        if a.dtype != x.dtype:
            raise TypeError(f"layer_norm: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) or not eps > 0 \
            or not math.isfinite(eps):
        raise ValueError(f"layer_norm: eps must be a finite number > 0, got {eps!r}")
    device = device_of({"x": x, "weight": weight, "bias": bias}, "layer_norm")
    return LayerNormProblem(M=math.prod(x.shape[:-1]), N=N, dtype=dtypes.short_name(x.dtype),
                            has_weight=weight is not None, has_bias=bias is not None, eps=float(eps),
                            device=device)


def layer_norm(x: Any, weight: Any = None, bias: Any = None, *, eps: float = 1e-5, path: str = "auto") -> Any:
    """(x − mean) / sqrt(var + eps) · weight + bias over x's last dimension N, for x (..., N) and
    weight, bias (N,) or None; returns y with x's shape, dtype and device. `path` is "auto" or one of
    `libnn.paths("layer_norm")`."""
    x = as_array(x, "layer_norm", "x")
    weight = None if weight is None else as_array(weight, "layer_norm", "weight")
    bias = None if bias is None else as_array(bias, "layer_norm", "bias")
    key = (signature(x), signature(weight), signature(bias), eps, path, stream_key())
    return op.call(key, lambda: _check(x, weight, bias, eps), path, x, weight, bias)


def _as_rows(run, problem: LayerNormProblem, x, weight, bias):
    """`run` (for C-contiguous (M, N) rows and (N,) vectors) wrapped for the signature of the arrays:
    y takes x's shape; copies only where the signature is not contiguous."""
    contiguous_in = all(a is None or a.flags.c_contiguous for a in (x, weight, bias))
    if x.ndim == 2 and contiguous_in:
        return run
    shape = x.shape

    def as_rows(x, weight, bias):
        rows = contiguous(x).reshape(problem.M, problem.N)
        y = run(rows, None if weight is None else contiguous(weight), None if bias is None else contiguous(bias))
        return y.reshape(shape)
    return as_rows


def _gpu_support(problem: LayerNormProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- cudnn path -------------------------------------------------------------------------------------
# UIDs of the graph's tensors in the variant pack
X, SCALE, BIAS, EPSILON, Y = 1, 2, 3, 4, 5


def graph_key(problem: LayerNormProblem) -> tuple:
    """Everything the cuDNN graph depends on: not eps (a pass-by-value input), not whether weight and
    bias were given (the graph always has both)."""
    return ("layer_norm", problem.M, problem.N, problem.dtype)


def _graph_builder(problem: LayerNormProblem):
    """x → layernorm(scale, bias, epsilon) → y. cuDNN normalizes over every dimension but the first, so
    the rows are [M, N, 1, 1] with strides [N, 1, N, N] (channels-last, as in cudnn-frontend's
    samples/python/22_layernorm_inference.ipynb and test/python/test_layernorm.py)."""
    def build(handle):
        import cudnn

        from libnn.backends.cudnn import data_type

        p, io, f32 = problem, data_type(problem.dtype), cudnn.data_type.FLOAT
        row_stride = [p.N, 1, p.N, p.N]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        x = g.tensor(dim=[p.M, p.N, 1, 1], stride=row_stride, data_type=io, uid=X)
        scale = g.tensor(dim=[1, p.N, 1, 1], stride=row_stride, data_type=io, uid=SCALE)
        bias = g.tensor(dim=[1, p.N, 1, 1], stride=row_stride, data_type=io, uid=BIAS)
        epsilon = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, is_pass_by_value=True, uid=EPSILON)
        y, _mean, _inv_var = g.layernorm(norm_forward_phase=cudnn.norm_forward_phase.INFERENCE, input=x,
                                         scale=scale, bias=bias, epsilon=epsilon, compute_data_type=f32)
        y.set_output(True).set_data_type(io).set_stride(row_stride).set_uid(Y)
        return g
    return build


class _HostScalar:
    """A float32 in host memory, for a pass-by-value graph input: cuDNN reads the value through the
    pointer when the graph is launched. It looks like an array to backends.cudnn.Graph.executor,
    which takes `.data.ptr` of every buffer."""

    def __init__(self, value: float):
        self.array = np.array([value], np.float32)
        self.data = _Pointer(self.array.ctypes.data)


@dataclass(frozen=True)
class _Pointer:
    ptr: int


_epsilons: PlanCache = PlanCache("layer_norm epsilons")


def _cudnn(problem: LayerNormProblem, x, weight, bias):
    """Binds the cuDNN graph of `problem` (the alignment of the arrays is part of the signature)."""
    import cupy

    from libnn.backends import cudnn as cudnn_backend

    if problem.M == 0 or problem.N == 0:
        return functools.partial(_empty_result, problem)
    rows = contiguous(x).reshape(problem.M, problem.N)
    misaligned = [name for name, a in (("x", rows), ("weight", weight), ("bias", bias))
                  if a is not None and a.data.ptr % 16]
    if misaligned:  # the frontend declares every tensor 16-byte aligned to cuDNN
        raise LibraryError(f"cuDNN needs 16-byte aligned buffers; {', '.join(misaligned)} "
                           f"{'is' if len(misaligned) == 1 else 'are'} not")
    execute = cudnn_backend.graph_for(graph_key(problem), _graph_builder(problem), problem.describe).executor(
        [X, SCALE, BIAS, EPSILON, Y])
    # cuDNN's node requires both: the identity's ones and zeros, made once
    ones, zeros = device_constant(problem.N, 1, x.dtype), device_constant(problem.N, 0, x.dtype)
    epsilon = _epsilons.get(problem.eps, lambda: _HostScalar(problem.eps))
    shape, dtype = (problem.M, problem.N), x.dtype

    def run(x, weight, bias):
        y = cupy.empty(shape, dtype)
        execute(x, ones if weight is None else weight, zeros if bias is None else bias, epsilon, y)
        return y
    return _as_rows(run, problem, x, weight, bias)


# --- custom path: kernels/layernorm.cu ----------------------------------------------------------------
WARP_MAX_N = 1024              # version 1 up to here (its largest VPT reaches it), version 2 beyond
BLOCK_MAX_THREADS = 512
_WARP_VPTS = {"fp32": (1, 2, 4, 8), "fp16": (1, 2, 4), "bf16": (1, 2, 4)}  # what kernels/layernorm.cu builds
_BLOCK_VPTS = (2, 4, 8)
_MAX_BLOCKS = 65535            # rows are grid-strided; this many blocks fill any GPU


def _group(dtype: str) -> int:
    """V: the elements of one 16-byte group (4 fp32, 8 fp16/bf16)."""
    return 4 if dtype == "fp32" else 8


def _aligned(problem: LayerNormProblem, *arrays) -> bool:
    """Whether the 16-byte (vec) kernels may run: whole groups per row and every pointer aligned."""
    return problem.N % _group(problem.dtype) == 0 and all(a.data.ptr % 16 == 0 for a in arrays if a is not None)


def custom_versions(problem: LayerNormProblem, aligned: bool = True) -> tuple[str, ...]:
    """The versions of kernels/layernorm.cu that can run `problem` (for tests and benchmarks)."""
    V, N = _group(problem.dtype), problem.N
    found = []
    if N <= 32 * _WARP_VPTS[problem.dtype][-1] * V:
        found.append("ln1_warp")
    if aligned and N <= BLOCK_MAX_THREADS * _BLOCK_VPTS[-1] * V:
        found.append("ln2_block")
    return (*found, "ln3_loop")


def custom_version(problem: LayerNormProblem, aligned: bool) -> str:
    """The version the custom path runs: a warp per row up to N = 1024, then a block per row in
    registers when the row can be moved 16 bytes at a time, else the loop."""
    if problem.N <= WARP_MAX_N:
        return "ln1_warp"
    return "ln2_block" if "ln2_block" in custom_versions(problem, aligned) else "ln3_loop"


def _launch(version: str, problem: LayerNormProblem, vec: bool) -> tuple[str, int, int]:
    """(kernel name without the dtype suffix, grid, block) from kernels/layernorm.cu's LAUNCH table."""
    groups = _ceil_div(problem.N, _group(problem.dtype))  # V-element groups in a row
    if version == "ln1_warp":
        vpt = next(v for v in _WARP_VPTS[problem.dtype] if 32 * v >= groups)
        return f"ln1_warp_{'vec' if vec else 'sca'}{vpt}", min(_ceil_div(problem.M, 4), _MAX_BLOCKS), 128
    if version == "ln2_block":
        vpt = next(v for v in _BLOCK_VPTS if BLOCK_MAX_THREADS * v >= groups)
        threads = 32 * _ceil_div(_ceil_div(groups, vpt), 32)  # the fewest warps that hold the row
        return f"ln2_block_vec{vpt}", min(problem.M, _MAX_BLOCKS), threads
    return "ln3_loop", min(problem.M, _MAX_BLOCKS), 512


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bind_custom(problem: LayerNormProblem, x, weight, bias, version: str | None = None):
    """The runner of one version of kernels/layernorm.cu (the default: the one the custom path picks)
    for (M, N) rows and (N,) vectors of this signature (their alignment included)."""
    import cupy

    from libnn.runtime import launch

    aligned = _aligned(problem, x, weight, bias)  # y comes from CuPy's pool: 256-byte aligned
    version = version or custom_version(problem, aligned)
    if version not in custom_versions(problem, aligned):
        raise ValueError(f"layer_norm: kernels/layernorm.cu version {version!r} cannot run {problem.describe()} "
                         f"({'16-byte aligned' if aligned else 'not 16-byte aligned'}); it can run "
                         f"{custom_versions(problem, aligned)}")
    name, grid, block = _launch(version, problem, aligned)
    kernel = launch.bind("layernorm.cu", f"{name}_{dtypes.KERNEL_SUFFIX[problem.dtype]}", (grid,), (block,),
                         (launch.ARRAY, launch.ARRAY, launch.ARRAY, launch.ARRAY, np.int64(problem.M),
                          np.int32(problem.N), np.float32(problem.eps)))
    shape, dtype = (problem.M, problem.N), x.dtype

    def run(x, weight, bias):
        y = cupy.empty(shape, dtype)
        kernel(x, weight, bias, y)
        return y
    return run


def launch_custom(problem: LayerNormProblem, x, weight, bias, version: str | None = None):
    """y for the (M, N) rows x with one version of kernels/layernorm.cu (for tests and benchmarks)."""
    return bind_custom(problem, x, weight, bias, version)(x, weight, bias)


def _custom_slower(problem: LayerNormProblem) -> str | None:
    """Rows that only the looping kernel takes (longer than a block holds, or an odd N past 1024)
    ran faster on cuDNN on the H100: 1024x65536 fp16 at 2.49 vs 0.71 TB/s, 8192x12289 at 1.69 vs 1.19."""
    aligned = problem.N % _group(problem.dtype) == 0
    if custom_version(problem, aligned) == "ln3_loop":
        return (f"rows of {problem.N} take kernels/layernorm.cu's looping kernel, which cuDNN outran on "
                "the H100 (1024x65536 fp16: 2.49 vs 0.71 TB/s)")
    return None


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, slower=_custom_slower, binds=True)
def _custom(problem: LayerNormProblem, x, weight, bias):
    if problem.M == 0 or problem.N == 0:
        return functools.partial(_empty_result, problem)
    rows = contiguous(x).reshape(problem.M, problem.N)
    return _as_rows(bind_custom(problem, rows, weight, bias), problem, x, weight, bias)


def _empty_result(problem: LayerNormProblem, x, weight, bias):
    """The result when there are no rows or no columns: nothing to normalize."""
    return array_module(x).empty(x.shape, x.dtype)


op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_gpu_support, binds=True)(_cudnn)


# --- reference --------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LayerNormProblem, x, weight, bias):
    if problem.M == 0 or problem.N == 0:
        return _empty_result(problem, x, weight, bias)
    rows = x.reshape(problem.M, problem.N).astype(np.float64)
    centered = rows - rows.mean(axis=1, keepdims=True)
    y = centered / np.sqrt((centered * centered).mean(axis=1, keepdims=True) + problem.eps)
    if weight is not None:
        y *= weight.astype(np.float64)
    if bias is not None:
        y += bias.astype(np.float64)
    return y.astype(x.dtype).reshape(x.shape)
