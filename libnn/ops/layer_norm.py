"""layer_norm: y = (x − mean) / sqrt(var + eps) · weight + bias over the last dimension of x.

x is (..., N); weight and bias are (N,) or None (then 1 and 0); mean and the biased variance are
taken over each row of N elements, like torch.nn.functional.layer_norm(x, (N,), weight, bias, eps).
y has x's shape, dtype and device. fp16/bf16 compute in fp32 on the GPU paths.

Residual. `layer_norm(x, weight, bias, residual=r)` normalizes h = x + r (r: x's shape, dtype and
device), what a post-LN transformer block computes after attention and after the feed-forward
(`norm(x + sublayer(x))`), in one pass: the custom kernels read r beside x and form h in fp32, where
a separate add would write h and read it back. `return_sum=True` also returns h rounded to x's dtype,
`y, h = layer_norm(a, w, b, residual=r, return_sum=True)`, for a pre-LN stack, which carries h on to
the next block. y is the normalization of the unrounded h on the custom and reference paths; on
cuDNN's, with return_sum, of h as stored in x's dtype (the add's output is then a graph output).

Paths, in `auto` order (custom first: on the H100 it matched or beat cuDNN's bandwidth on the
common shapes and costs less host time per call; cuDNN is faster on the rows only the looping kernel
takes, odd N past 1024 or longer than a block holds, e.g. 1024×65536, so for those auto tries cudnn
first; figures in benchmarks/RESULTS.md, layer_norm):
- custom:    kernels/layer_norm.cu (a row per warp up to N = 1024, a row per block in registers
             beyond, a looping row per block for the longest or unaligned rows).
- cudnn:     the cuDNN frontend's layernorm node in its INFERENCE phase (no mean or inv_var
             outputs), fp32 compute, behind a pointwise add of the residual in the same graph.
             cuDNN's node requires scale and bias tensors, so a missing weight or bias is passed as
             a cached vector of ones or zeros; eps is a pass-by-value input, so one graph serves
             every eps. A graph cuDNN declines (a shape, or no engine for the add → layernorm
             fusion) raises LibraryError, and `auto` goes on to the next path with a FallbackWarning.
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

op = Op("layer_norm", order=("custom", "cudnn", "reference"))


@dataclass(frozen=True)
class LayerNormProblem:
    """Everything that decides how a layer_norm call runs."""
    M: int                # rows: the product of x's leading dimensions
    N: int                # the normalized (last) dimension
    dtype: str            # short name: fp16, bf16, fp32, fp64
    has_weight: bool
    has_bias: bool
    has_residual: bool    # normalizes x + residual
    return_sum: bool      # also returns x + residual
    eps: float
    device: str           # "cpu" or "gpu:N"

    def describe(self) -> str:
        affine = "+".join(filter(None, ["weight" if self.has_weight else None,
                                        "bias" if self.has_bias else None])) or "no affine"
        of = (" of x + residual" + (", returning the sum" if self.return_sum else "")) if self.has_residual else ""
        return f"layer_norm{of} M={self.M} N={self.N} {self.dtype} eps={self.eps:g} ({affine})"

    @property
    def bytes_moved(self) -> int:
        """x (and the residual) read and y (and the sum) written once (weight and bias are negligible
        next to them)."""
        arrays = 2 + self.has_residual + self.return_sum
        return arrays * self.M * self.N * dtypes.parse(self.dtype).itemsize


def layer_norm_problem(x, weight, bias, residual, eps, return_sum) -> LayerNormProblem:
    if x.ndim < 1:
        raise ValueError("layer_norm: x must have at least 1 dimension (..., N), got a 0-d array")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"layer_norm: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    N = x.shape[-1]
    for name, a in (("weight", weight), ("bias", bias)):
        if a is not None:
            row_kernels.check_affine("layer_norm", name, a, x, "x", "last dimension")
    row_kernels.check_eps("layer_norm", eps)
    row_kernels.check_residual("layer_norm", residual, x, return_sum)
    device = device_of({"x": x, "weight": weight, "bias": bias, "residual": residual}, "layer_norm")
    problem = LayerNormProblem(M=math.prod(x.shape[:-1]), N=N, dtype=dtypes.short_name(x.dtype),
                               has_weight=weight is not None, has_bias=bias is not None,
                               has_residual=residual is not None, return_sum=bool(return_sum), eps=float(eps),
                               device=device)
    if device == "cpu":  # host arrays run on the reference path
        row_kernels.reference_fits("layer_norm", problem.M, problem.N, problem.dtype, problem.return_sum,
                                   tuple(x.shape))
    return problem



def layer_norm(x: Any, weight: Any = None, bias: Any = None, *, residual: Any = None, eps: float = 1e-5,
               return_sum: bool = False, path: str = "auto") -> Any:
    """(h − mean) / sqrt(var + eps) · weight + bias over the last dimension N of h = x, or of
    h = x + residual, for x (..., N), residual None or x's shape and dtype, and weight, bias (N,) or
    None; returns y with x's shape, dtype and device, or with `return_sum` (residual required) the
    pair (y, h rounded to x's dtype). `path` is "auto" or one of `libnn.paths("layer_norm")`."""
    x = as_array(x, "layer_norm", "x")
    weight = None if weight is None else as_array(weight, "layer_norm", "weight")
    bias = None if bias is None else as_array(bias, "layer_norm", "bias")
    residual = None if residual is None else as_array(residual, "layer_norm", "residual")
    # The key of signature() and option_key() without their calls in the common cases: an absent array's
    # signature is None; an exact float eps is its own key (of the other keys, only an exact int's can equal
    # it, and the checks take that int as the same eps); return_sum is keyed with its type, so that 0 never
    # finds the bound call of False and skips the check that refuses it.
    key = (signature(x), None if weight is None else signature(weight), None if bias is None else signature(bias),
           None if residual is None else signature(residual), eps if type(eps) is float else option_key(eps),
           type(return_sum), return_sum, path, stream_key())
    return op.call(key, layer_norm_problem, path, x, weight, bias, residual,
                   checks=(x, weight, bias, residual, eps, return_sum))


def _gpu_support(problem: LayerNormProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- cudnn path -------------------------------------------------------------------------------------
# UIDs of the graph's tensors in the variant pack
X, SCALE, BIAS, EPSILON, Y, RESIDUAL, SUM = 1, 2, 3, 4, 5, 6, 7


def graph_key(problem: LayerNormProblem) -> tuple:
    """Everything the cuDNN graph depends on: not eps (a pass-by-value input), not whether weight and
    bias were given (the graph always has both)."""
    return ("layer_norm", problem.M, problem.N, problem.dtype, problem.has_residual, problem.return_sum)


def _uids(problem: LayerNormProblem) -> list[int]:
    """The graph's variant pack in the order the runner passes its arrays."""
    return [X, SCALE, BIAS, EPSILON, Y] + [RESIDUAL] * problem.has_residual + [SUM] * problem.return_sum


def _graph_builder(problem: LayerNormProblem):
    """[x + residual →] layernorm(scale, bias, epsilon) → y [and the sum]. cuDNN normalizes over every
    dimension but the first, so the rows are [M, N, 1, 1] with strides [N, 1, N, N] (channels-last, as
    in cudnn-frontend's samples/python/22_layernorm_inference.ipynb and test/python/test_layernorm.py).
    The add's output is virtual (fp32, the graph's intermediate type) unless the sum is returned."""
    def build(handle):
        import cudnn

        p, io, f32 = problem, cudnn_backend.data_type(problem.dtype), cudnn.data_type.FLOAT
        row_stride = [p.N, 1, p.N, p.N]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        x = g.tensor(dim=[p.M, p.N, 1, 1], stride=row_stride, data_type=io, uid=X)
        scale = g.tensor(dim=[1, p.N, 1, 1], stride=row_stride, data_type=io, uid=SCALE)
        bias = g.tensor(dim=[1, p.N, 1, 1], stride=row_stride, data_type=io, uid=BIAS)
        epsilon = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, is_pass_by_value=True, uid=EPSILON)
        h = x
        if p.has_residual:
            residual = g.tensor(dim=[p.M, p.N, 1, 1], stride=row_stride, data_type=io, uid=RESIDUAL)
            h = g.add(a=x, b=residual, compute_data_type=f32)
            h.set_stride(row_stride)
            if p.return_sum:
                h.set_output(True).set_data_type(io).set_uid(SUM)
        y, _mean, _inv_var = g.layernorm(norm_forward_phase=cudnn.norm_forward_phase.INFERENCE, input=h,
                                         scale=scale, bias=bias, epsilon=epsilon, compute_data_type=f32)
        y.set_output(True).set_data_type(io).set_stride(row_stride).set_uid(Y)
        return g
    return build


def _cudnn(problem: LayerNormProblem, x, weight, bias, residual):
    """Binds the cuDNN graph of `problem` (the alignment of the arrays is part of the signature). The graph
    reads pointers only, so x and the residual go as they are, of any rank, and y takes x's shape."""
    if problem.M == 0 or problem.N == 0:
        return functools.partial(row_kernels.empty_result, problem)
    arrays = contiguous_arrays(x, weight, bias, residual)
    # the frontend declares every tensor 16-byte aligned to cuDNN
    refuse_misaligned("cuDNN needs 16-byte aligned buffers", dict(zip(("x", "weight", "bias", "residual"), arrays)))
    execute = cudnn_backend.graph_for(graph_key(problem), _graph_builder(problem), problem.describe).executor(
        _uids(problem))
    # cuDNN's node requires both: the identity's ones and zeros, made once
    ones, zeros = device_constant(problem.N, 1, x.dtype), device_constant(problem.N, 0, x.dtype)
    epsilon = cudnn_backend.host_scalar(problem.eps)
    new = allocator(tuple(x.shape), x.dtype)

    def run(x, weight, bias, residual):
        y = new()
        execute(x, ones if weight is None else weight, zeros if bias is None else bias, epsilon, y)
        return y

    def run_residual(x, weight, bias, residual):
        y = new()
        execute(x, ones if weight is None else weight, zeros if bias is None else bias, epsilon, y, residual)
        return y

    def run_sum(x, weight, bias, residual):
        y, h = new(), new()
        execute(x, ones if weight is None else weight, zeros if bias is None else bias, epsilon, y, residual, h)
        return y, h
    runner = run_sum if problem.return_sum else run_residual if problem.has_residual else run
    return copying_strided(runner, x, weight, bias, residual)


# --- custom path: kernels/layer_norm.cu ----------------------------------------------------------------
# ln1_warp, ln2_block, ln3_loop: libnn/ops/row_kernels.py's scheme over rows of N
_VERSIONS = row_kernels.RowKernels("ln", width="N")
_LN = contracts.params("layer_norm.cu", "LN_PARAMS")  # every layer norm kernel's parameters


def _aligned(problem: LayerNormProblem, *arrays) -> bool:
    """Whether the 16-byte (vec) kernels may run: whole groups per row and every pointer aligned."""
    return row_kernels.aligned(problem.dtype, problem.N, arrays)


# The versions that can run a problem (baseline first; `aligned`: `_aligned` says), the one the custom
# path runs, and a version's (kernel name without the dtype suffix, grid, block): the row-kernel scheme's
custom_versions, custom_version, _launch = _VERSIONS.versions, _VERSIONS.version, _VERSIONS.launch


def bind_custom(problem: LayerNormProblem, x, weight, bias, residual=None, version: str | None = None):
    """The runner of one version of kernels/layer_norm.cu (the default: the one the custom path picks)
    for C-contiguous x and residual (or None) of M rows of N, of any rank (the kernels read pointers),
    and (N,) vectors of this signature (their alignment included). The runner takes (x, weight, bias,
    residual) and returns y, or (y, sum) with `problem.return_sum`, in x's shape."""
    aligned = _aligned(problem, x, weight, bias, residual)  # y and the sum: CuPy's pool, 256-byte aligned
    version = version or custom_version(problem, aligned)
    row_kernels.require_version("layer_norm", version, problem, aligned, custom_versions(problem, aligned))
    name, grid, block = _launch(version, problem, aligned)
    # Without a residual, the residual and the sum are null pointers packed once (plain layer norm, no sum);
    # a launch is passed only the arrays packed as ARRAY, in the kernel's order: x, res, w, b, y, s.
    A = launch.ARRAY
    R, S = (A if problem.has_residual else None), (A if problem.return_sum else None)
    kernel = launch.bind("layer_norm.cu", f"{name}_{dtypes.KERNEL_SUFFIX[problem.dtype]}", (grid,), (block,),
                         _LN.pack(x=A, res=R, w=A, b=A, y=A, s=S, M=problem.M, N=problem.N, eps=problem.eps))
    new = allocator(tuple(x.shape), x.dtype)

    def run(x, weight, bias, residual):
        y = new()
        kernel(x, weight, bias, y)
        return y

    def run_residual(x, weight, bias, residual):
        y = new()
        kernel(x, residual, weight, bias, y)
        return y

    def run_sum(x, weight, bias, residual):
        y, h = new(), new()
        kernel(x, residual, weight, bias, y, h)
        return y, h
    return run_sum if problem.return_sum else run_residual if problem.has_residual else run


def launch_custom(problem: LayerNormProblem, x, weight, bias, residual=None, version: str | None = None):
    """y, or (y, sum), for the C-contiguous x (and residual) with one version of kernels/layer_norm.cu
    (for tests and benchmarks)."""
    return bind_custom(problem, x, weight, bias, residual, version)(x, weight, bias, residual)


def _custom_slower(problem: LayerNormProblem) -> str | None:
    """Rows that only the looping kernel takes (longer than a block holds, or an odd N past 1024)
    ran faster on cuDNN on the H100 (benchmarks/RESULTS.md, layer_norm)."""
    aligned = problem.N % row_kernels.group(problem.dtype) == 0
    if custom_version(problem, aligned) == _VERSIONS.loop:
        return (f"rows of {problem.N} take kernels/layer_norm.cu's looping kernel, which cuDNN outran on "
                "the H100 (benchmarks/RESULTS.md, layer_norm)")
    return None


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, slower=_custom_slower, binds=True)
def _custom(problem: LayerNormProblem, x, weight, bias, residual):
    if problem.M == 0 or problem.N == 0:
        return functools.partial(row_kernels.empty_result, problem)
    return copying_strided(bind_custom(problem, *contiguous_arrays(x, weight, bias, residual)), x, weight, bias,
                           residual)


op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_gpu_support, binds=True)(_cudnn)


# --- reference --------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: LayerNormProblem, x, weight, bias, residual):
    if problem.M == 0 or problem.N == 0:
        return row_kernels.empty_result(problem, x, weight, bias, residual)
    rows = row_kernels.reference_rows(problem, x, residual)
    centered = rows - rows.mean(axis=1, keepdims=True)
    y = centered / np.sqrt((centered * centered).mean(axis=1, keepdims=True) + problem.eps)
    if weight is not None:
        y *= weight.astype(np.float64)
    if bias is not None:
        y += bias.astype(np.float64)
    return row_kernels.reference_result(problem, x, y, rows)
