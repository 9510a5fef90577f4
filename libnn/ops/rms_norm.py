"""rms_norm: y = x / sqrt(mean(x²) + eps) · weight over the last dimension of x (LLaMA's RMSNorm).

x is (..., N); weight is (N,) or None (then 1); the mean of the squares is taken over each row of N
elements, like torch.nn.functional.rms_norm(x, (N,), weight, eps). y has x's shape, dtype and
device. fp16/bf16 compute in fp32 on the GPU paths and round once; Hugging Face's LlamaRMSNorm rounds
the normalized row to the dtype before the weight multiplies it, one rounding more (within the
fp16/bf16 tolerance of either).

Residual. `rms_norm(x, weight, residual=r)` normalizes h = x + r (r: x's shape, dtype and device) in
one pass: the custom kernels read r beside x and form h in fp32. `return_sum=True` also returns h
rounded to x's dtype, `y, h = rms_norm(a, w, residual=r, return_sum=True)`: what a pre-norm (LLaMA)
decoder block carries on to the next block while it normalizes it for its own attention or MLP. y is
the normalization of the unrounded h on the custom and reference paths; on cuDNN's, with
return_sum, of h as stored in x's dtype (the add's output is then a graph output), as in layer_norm.

Paths, in `auto` order (custom first, as for layer_norm, whose kernels of the same scheme matched or
beat cuDNN's bandwidth on the H100; rms_norm's own have not been timed against cuDNN yet, so no case
is declared slower):
- custom:    kernels/rms_norm.cu (libnn/ops/row_kernels.py's versions: a row per warp up to N = 1024,
             a row per block in registers beyond, a looping row per block for the longest or
             unaligned rows), one pass for the sum of squares.
- cudnn:     the cuDNN frontend's rmsnorm node in its INFERENCE phase (no inv_variance output), fp32
             compute, behind a pointwise add of the residual in the same graph. The node requires a
             scale, so a missing weight is passed as a cached vector of ones; its bias is left out;
             eps is a pass-by-value input, so one graph serves every eps. A graph cuDNN declines
             raises LibraryError, and `auto` goes on to the next path with a FallbackWarning.
- reference: NumPy in float64, rounded to x's dtype once at the end.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.backends import cudnn as cudnn_backend
from libnn.ops import row_kernels
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch
from libnn.runtime.arrays import (allocator, as_array, contiguous_arrays, copying_strided, device_constant, device_of,
                                  refuse_misaligned, signature, stream_key)

GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("rms_norm", order=("custom", "cudnn", "reference"))


@dataclass(frozen=True)
class RMSNormProblem:
    """Everything that decides how an rms_norm call runs."""
    M: int                # rows: the product of x's leading dimensions
    N: int                # the normalized (last) dimension
    dtype: str            # short name: fp16, bf16, fp32, fp64
    has_weight: bool
    has_residual: bool    # normalizes x + residual
    return_sum: bool      # also returns x + residual
    eps: float
    device: str           # "cpu" or "gpu:N"

    def describe(self) -> str:
        of = (" of x + residual" + (", returning the sum" if self.return_sum else "")) if self.has_residual else ""
        return (f"rms_norm{of} M={self.M} N={self.N} {self.dtype} eps={self.eps:g} "
                f"({'weight' if self.has_weight else 'no weight'})")

    @property
    def bytes_moved(self) -> int:
        """x (and the residual) read and y (and the sum) written once (the weight is negligible)."""
        arrays = 2 + self.has_residual + self.return_sum
        return arrays * self.M * self.N * dtypes.parse(self.dtype).itemsize


def rms_norm_problem(x, weight, residual, eps, return_sum) -> RMSNormProblem:
    """The checked problem of an rms_norm call (errors name the op and the argument)."""
    if x.ndim < 1:
        raise ValueError("rms_norm: x must have at least 1 dimension (..., N), got a 0-d array")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"rms_norm: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if weight is not None:
        row_kernels.check_affine("rms_norm", "weight", weight, x, "x", "last dimension")
    row_kernels.check_eps("rms_norm", eps)
    row_kernels.check_residual("rms_norm", residual, x, return_sum)
    device = device_of({"x": x, "weight": weight, "residual": residual}, "rms_norm")
    problem = RMSNormProblem(M=math.prod(x.shape[:-1]), N=x.shape[-1], dtype=dtypes.short_name(x.dtype),
                             has_weight=weight is not None, has_residual=residual is not None,
                             return_sum=bool(return_sum), eps=float(eps), device=device)
    if device == "cpu":  # host arrays run on the reference path
        row_kernels.reference_fits("rms_norm", problem.M, problem.N, problem.dtype, problem.return_sum,
                                   tuple(x.shape))
    return problem



def rms_norm(x: Any, weight: Any = None, *, residual: Any = None, eps: float = 1e-6, return_sum: bool = False,
             path: str = "auto") -> Any:
    """h / sqrt(mean(h²) + eps) · weight over the last dimension N of h = x, or of h = x + residual,
    for x (..., N), residual None or x's shape and dtype, and weight (N,) or None; returns y with x's
    shape, dtype and device, or with `return_sum` (residual required) the pair (y, h rounded to x's
    dtype). `path` is "auto" or one of `libnn.paths("rms_norm")`."""
    x = as_array(x, "rms_norm", "x")
    weight = None if weight is None else as_array(weight, "rms_norm", "weight")
    residual = None if residual is None else as_array(residual, "rms_norm", "residual")
    key = (signature(x), signature(weight), signature(residual), option_key(eps), option_key(return_sum), path,
           stream_key())
    return op.call(key, lambda: rms_norm_problem(x, weight, residual, eps, return_sum), path, x, weight, residual)


def _gpu_support(problem: RMSNormProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- custom path: kernels/rms_norm.cu --------------------------------------------------------------------
# rms1_warp, rms2_block, rms3_loop: libnn/ops/row_kernels.py's scheme over rows of N
_VERSIONS = row_kernels.RowKernels("rms", width="N")
_RMS = contracts.params("rms_norm.cu", "RMS_PARAMS")  # every RMS norm kernel's parameters

# The versions that can run a problem (baseline first; `aligned`: `_aligned` says), the one the custom
# path runs, and a version's (kernel name without the dtype suffix, grid, block): the row-kernel scheme's
custom_versions, custom_version, _launch = _VERSIONS.versions, _VERSIONS.version, _VERSIONS.launch


def _aligned(problem: RMSNormProblem, *arrays) -> bool:
    """Whether the 16-byte (vec) kernels may run: whole groups per row and every pointer aligned."""
    return row_kernels.aligned(problem.dtype, problem.N, arrays)


def bind_custom(problem: RMSNormProblem, x, weight, residual=None, version: str | None = None):
    """The runner of one version of kernels/rms_norm.cu (the default: the one the custom path picks)
    for C-contiguous x and residual (or None) of M rows of N, of any rank (the kernels read pointers),
    and an (N,) weight (or None) of this signature, their alignment included. The runner takes (x,
    weight, residual) and returns y, or (y, sum) with `problem.return_sum`, in x's shape."""
    aligned = _aligned(problem, x, weight, residual)  # y and the sum: CuPy's pool, 256-byte aligned
    version = version or custom_version(problem, aligned)
    row_kernels.require_version("rms_norm", version, problem, aligned, custom_versions(problem, aligned))
    name, grid, block = _launch(version, problem, aligned)
    A = launch.ARRAY  # a null residual: plain RMS norm; a null weight: 1; a null sum: not written
    kernel = launch.bind("rms_norm.cu", f"{name}_{dtypes.KERNEL_SUFFIX[problem.dtype]}", (grid,), (block,),
                         _RMS.pack(x=A, res=A, w=A, y=A, s=A, M=problem.M, N=problem.N, eps=problem.eps),
                         programmatic=launch.programmatic_supported(problem.device))
    new = allocator(tuple(x.shape), x.dtype)

    def run(x, weight, residual):
        y = new()
        kernel(x, residual, weight, y, None)
        return y

    def run_sum(x, weight, residual):
        y, h = new(), new()
        kernel(x, residual, weight, y, h)
        return y, h
    return run_sum if problem.return_sum else run


def launch_custom(problem: RMSNormProblem, x, weight, residual=None, version: str | None = None):
    """y, or (y, sum), for C-contiguous x (and residual) with one version of kernels/rms_norm.cu (for
    tests and benchmarks)."""
    return bind_custom(problem, x, weight, residual, version)(x, weight, residual)


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: RMSNormProblem, x, weight, residual):
    if problem.M == 0 or problem.N == 0:
        return functools.partial(row_kernels.empty_result, problem)
    return copying_strided(bind_custom(problem, *contiguous_arrays(x, weight, residual)), x, weight, residual)


# --- cudnn path ----------------------------------------------------------------------------------------
# UIDs of the graph's tensors in the variant pack
UID_X, UID_SCALE, UID_EPSILON, UID_Y, UID_RESIDUAL, UID_SUM = 1, 2, 3, 4, 5, 6


def graph_key(problem: RMSNormProblem) -> tuple:
    """Everything the cuDNN graph depends on: not eps (a pass-by-value input), not whether a weight was
    given (the graph always has a scale)."""
    return ("rms_norm", problem.M, problem.N, problem.dtype, problem.has_residual, problem.return_sum)


def _uids(problem: RMSNormProblem) -> list[int]:
    """The graph's variant pack in the order the runner passes its arrays."""
    return [UID_X, UID_SCALE, UID_EPSILON, UID_Y] + [UID_RESIDUAL] * problem.has_residual + \
        [UID_SUM] * problem.return_sum


def rms_norm_graph_builder(problem: RMSNormProblem):
    """[x + residual →] rmsnorm(scale, epsilon) → y [and the sum]. cuDNN normalizes over every dimension
    but the first, so the rows are [M, N, 1, 1] with strides [N, 1, N, N] (channels-last, as
    layer_norm's graph and cudnn-frontend's samples/python rmsnorm notebook lay them out). The add's
    output is virtual (fp32, the graph's intermediate type) unless the sum is returned."""
    def build(handle):
        import cudnn

        p, io, f32 = problem, cudnn_backend.data_type(problem.dtype), cudnn.data_type.FLOAT
        row_stride = [p.N, 1, p.N, p.N]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        x = g.tensor(dim=[p.M, p.N, 1, 1], stride=row_stride, data_type=io, uid=UID_X)
        scale = g.tensor(dim=[1, p.N, 1, 1], stride=row_stride, data_type=io, uid=UID_SCALE)
        epsilon = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, is_pass_by_value=True,
                           uid=UID_EPSILON)
        h = x
        if p.has_residual:
            residual = g.tensor(dim=[p.M, p.N, 1, 1], stride=row_stride, data_type=io, uid=UID_RESIDUAL)
            h = g.add(a=x, b=residual, compute_data_type=f32)
            h.set_stride(row_stride)
            if p.return_sum:
                h.set_output(True).set_data_type(io).set_uid(UID_SUM)
        y, _inv_variance = g.rmsnorm(norm_forward_phase=cudnn.norm_forward_phase.INFERENCE, input=h, scale=scale,
                                     epsilon=epsilon, compute_data_type=f32)
        y.set_output(True).set_data_type(io).set_stride(row_stride).set_uid(UID_Y)
        return g
    return build


@op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_gpu_support, binds=True)
def _cudnn(problem: RMSNormProblem, x, weight, residual):
    """Binds the cuDNN graph of `problem` (the alignment of the arrays is part of the signature). The graph
    reads pointers only, so contiguous x and residual go as they are, of any rank, and y takes x's shape."""
    if problem.M == 0 or problem.N == 0:
        return functools.partial(row_kernels.empty_result, problem)
    packed = contiguous_arrays(x, weight, residual)  # what the graph will read: their alignment is checked
    # the frontend declares every tensor 16-byte aligned to cuDNN
    refuse_misaligned("cuDNN needs 16-byte aligned buffers", dict(zip(("x", "weight", "residual"), packed)))
    execute = cudnn_backend.graph_for(graph_key(problem), rms_norm_graph_builder(problem),
                                      problem.describe).executor(_uids(problem))
    ones = device_constant(problem.N, 1, x.dtype)  # cuDNN's node requires a scale: the identity's, made once
    epsilon = cudnn_backend.host_scalar(problem.eps)
    new = allocator(tuple(x.shape), x.dtype)

    def run(x, weight, residual):
        y = new()
        execute(x, ones if weight is None else weight, epsilon, y)
        return y

    def run_residual(x, weight, residual):
        y = new()
        execute(x, ones if weight is None else weight, epsilon, y, residual)
        return y

    def run_sum(x, weight, residual):
        y, h = new(), new()
        execute(x, ones if weight is None else weight, epsilon, y, residual, h)
        return y, h
    runner = run_sum if problem.return_sum else run_residual if problem.has_residual else run
    return copying_strided(runner, x, weight, residual)


# --- reference -----------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: RMSNormProblem, x, weight, residual):
    if problem.M == 0 or problem.N == 0:
        return row_kernels.empty_result(problem, x, weight, residual)
    rows = row_kernels.reference_rows(problem, x, residual)
    y = rows / np.sqrt((rows * rows).mean(axis=1, keepdims=True) + problem.eps)
    if weight is not None:
        y *= weight.astype(np.float64)
    return row_kernels.reference_result(problem, x, y, rows)
