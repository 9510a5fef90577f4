"""conv2d: y = act(scale ⊙ conv(x, w) + shift), a 2-D convolution for inference with batch norm,
bias and activation fused into one epilogue.

x is (N, H, W, C) for layout="NHWC" or (N, C, H, W) for layout="NCHW"; w is in the matching filter
layout: (K, R, S, C/groups) for NHWC, (K, C/groups, R, S) (PyTorch's) for NCHW; y has x's layout.
Bias and batch norm become one per-channel affine epilogue (computed in fp32):
    scale = gamma / sqrt(running_var + eps),  shift = beta - running_mean * scale + b * scale.
`bn` is (scale, shift) or (gamma, beta, running_mean, running_var, eps). b is in x's dtype, or fp32
for fp16/bf16 x (taken as is: the epilogue reads fp32, and a layer keeps its bias so converted once
rather than paying a conversion kernel per call). Activations: None, "relu",
"relu6", "gelu" (tanh approximation), "silu".

Paths, in `auto` order:
- cudnn:           one cuDNN frontend graph: conv_fprop → mul(scale) → add(shift) → activation.
- cudnn+epilogue:  cuDNN's conv alone, then our fused epilogue kernel (kernels/epilogue.cu); what
                   `auto` falls back to when cuDNN has no engine for the fused graph.
- custom:          kernels/conv2d.cu (implicit GEMM on tensor cores, depthwise, direct).
- reference:       NumPy in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from libnn import dtypes
from libnn.backends import cudnn as cudnn_backend
from libnn.ops import activations
from libnn.ops.spatial import LAYOUTS, is_int, nhwc_strides, pair
from libnn.registry import Op, option_key
from libnn.runtime import contracts, kernels, launch, memory
from libnn.runtime.arrays import (allocator, array_module, as_array, contiguous, device_of, is_cupy, signature,
                                  stream_key)

ACTIVATIONS = (None, "relu", "relu6", "gelu", "silu")  # what kernels/conv2d.cu compiles (ACT_CONV)
GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("conv2d", order=("cudnn", "cudnn+epilogue", "custom", "reference"))


@dataclass(frozen=True)
class ConvProblem:
    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    P: int
    Q: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: str
    layout: str
    has_scale: bool
    has_shift: bool
    activation: str | None
    allow_tf32: bool
    device: str
    aligned: bool = True  # x and w start on 16-byte boundaries (cuDNN's engines assume it)

    def describe(self) -> str:
        epilogue = "+".join(filter(None, ["scale" if self.has_scale else None, "shift" if self.has_shift else None,
                                          self.activation])) or "no epilogue"
        return (f"conv2d N={self.N} C={self.C} H={self.H} W={self.W} -> K={self.K} {self.R}x{self.S} "
                f"stride {self.stride} pad {self.padding} dil {self.dilation} groups {self.groups} "
                f"{self.dtype} {self.layout} ({epilogue})")

    @property
    def flops(self) -> int:
        return 2 * self.N * self.P * self.Q * self.K * self.R * self.S * (self.C // self.groups)

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes((self.N, self.K, self.P, self.Q), dtypes.parse(self.dtype))

    def x_strides(self) -> list[int]:
        """Element strides of x in cuDNN's dimension order (N, C, H, W)."""
        return _strides(self.layout, self.C, self.H, self.W)

    def y_strides(self) -> list[int]:
        return _strides(self.layout, self.K, self.P, self.Q)

    def w_strides(self) -> list[int]:
        return _strides(self.layout, self.C // self.groups, self.R, self.S)

    def epilogue_only(self) -> "ConvProblem":
        """The same convolution with no epilogue (what the unfused paths ask cuDNN for)."""
        return replace(self, has_scale=False, has_shift=False, activation=None)


def _strides(layout: str, C: int, H: int, W: int) -> list[int]:
    return [H * W * C, 1, W * C, C] if layout == "NHWC" else [C * H * W, H * W, W, 1]


def _groups(groups: Any) -> int:
    if not is_int(groups):
        raise TypeError(f"conv2d: groups must be an int, got {type(groups).__name__} {groups!r}")
    if groups < 1:
        raise ValueError(f"conv2d: groups must be a positive int, got {groups!r}")
    return int(groups)


def fold_batchnorm(gamma, beta, running_mean, running_var, eps: float):
    """(scale, shift) of batch norm in inference, in float32 on the arrays' device (float64 on the host)."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"conv2d: batch norm eps must be a real number, got {type(eps).__name__} {eps!r}")
    if not 0 < eps < math.inf:  # NaN included; an infinite eps would zero the scale
        raise ValueError(f"conv2d: batch norm eps must be > 0 and finite, got {eps!r}")
    xp = array_module(gamma)
    dt = np.float64 if xp is np else xp.float32
    scale = gamma.astype(dt) / xp.sqrt(running_var.astype(dt) + eps)
    return scale, beta.astype(dt) - running_mean.astype(dt) * scale


def _epilogue_vectors(bn, b, K: int, device_array):
    """Per-channel (scale, shift) of the fused epilogue, each None when it is the identity."""
    xp = array_module(device_array)
    dt = np.float64 if xp is np else xp.float32
    scale = shift = None
    if bn is not None:
        if not isinstance(bn, (tuple, list)):
            raise TypeError(f"conv2d: bn must be a tuple (scale, shift) or (gamma, beta, running_mean, running_var, "
                            f"eps), got {type(bn).__name__}")
        bn = [as_array(v, "conv2d", f"bn[{i}]") if i < 4 else v for i, v in enumerate(bn)]
        if len(bn) not in (2, 5):
            raise ValueError(f"conv2d: bn must be (scale, shift) or (gamma, beta, running_mean, running_var, eps), "
                             f"got {len(bn)} items")
        for i, v in enumerate(bn[:4]):
            if tuple(v.shape) != (K,):
                raise ValueError(f"conv2d: bn[{i}] must have shape ({K},) to match w's {K} output channels, "
                                 f"got {tuple(v.shape)}")
        # copy=False: (scale, shift) already in fp32, as a layer passes them, cost no kernel per call;
        # contiguous: the kernels and cuDNN read them as packed (K,) vectors, a strided view included
        scale, shift = fold_batchnorm(*bn) if len(bn) == 5 else (contiguous(bn[0].astype(dt, copy=False)),
                                                                  contiguous(bn[1].astype(dt, copy=False)))
    if b is not None:
        b = contiguous(b.astype(dt, copy=False))
        shift = b if scale is None else shift + b * scale
    return scale, shift


def conv2d_problem(x, w, b, bn, stride, padding, dilation, groups, activation, layout, allow_tf32) -> ConvProblem:
    """The ConvProblem conv2d(x, w, b, stride, padding, dilation, groups, bn, activation, layout,
    allow_tf32) solves, after checking every argument as conv2d does (x and w already arrays); for
    tools that build a path's plan themselves."""
    if layout not in LAYOUTS:
        raise ValueError(f"conv2d: layout must be one of {LAYOUTS}, got {layout!r}")
    if x.ndim != 4:
        raise ValueError(f"conv2d: x must be 4-D ({', '.join(layout)}), got shape {tuple(x.shape)}")
    if w.ndim != 4:
        filter_layout = "K, R, S, C/groups" if layout == "NHWC" else "K, C/groups, R, S"
        raise ValueError(f"conv2d: w must be 4-D ({filter_layout}), got shape {tuple(w.shape)}")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"conv2d: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"conv2d: w has dtype {dtypes.short_name(w.dtype)} but x has "
                        f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    if b is not None and b.dtype != x.dtype and not (b.dtype == np.float32 and x.dtype.itemsize == 2):
        raise TypeError(f"conv2d: b has dtype {dtypes.short_name(b.dtype)} but x has {dtypes.short_name(x.dtype)}; "
                        "pass b in x's dtype (or fp32 for fp16/bf16 x)")
    activations.check("conv2d", activation, ACTIVATIONS)
    if not isinstance(allow_tf32, (bool, np.bool_)):  # "no" would mean yes
        raise TypeError(f"conv2d: allow_tf32 must be True or False, got {type(allow_tf32).__name__} {allow_tf32!r}")
    groups = _groups(groups)
    stride, padding = pair("conv2d", "stride", stride, 1), pair("conv2d", "padding", padding, 0)
    dilation = pair("conv2d", "dilation", dilation, 1)
    if layout == "NHWC":
        (N, H, W, C), (K, R, S, Cg) = x.shape, w.shape
    else:
        (N, C, H, W), (K, Cg, R, S) = x.shape, w.shape
    if R == 0 or S == 0:  # a sum over no taps: the output would be zeros (or the bias) and look fine
        raise ValueError(f"conv2d: w's kernel must be at least 1x1, got {R}x{S} (w shape {tuple(w.shape)}, "
                         f"layout {layout})")
    if C % groups:
        raise ValueError(f"conv2d: groups={groups} does not divide x's {C} channels (layout {layout})")
    if K % groups:
        raise ValueError(f"conv2d: groups={groups} does not divide w's {K} output channels")
    if Cg != C // groups:
        raise ValueError(f"conv2d: w has {Cg} input channels per group but x has {C} channels in {groups} "
                         f"group(s), i.e. {C // groups} (layout {layout}, w shape {tuple(w.shape)})")
    if b is not None and tuple(b.shape) != (K,):
        raise ValueError(f"conv2d: b must have shape ({K},) to match w's output channels, got {tuple(b.shape)}")
    P = (H + 2 * padding[0] - dilation[0] * (R - 1) - 1) // stride[0] + 1
    Q = (W + 2 * padding[1] - dilation[1] * (S - 1) - 1) // stride[1] + 1
    if P < 1 or Q < 1:
        raise ValueError(f"conv2d: the {R}x{S} kernel (dilation {dilation}) is larger than the padded "
                         f"{H + 2 * padding[0]}x{W + 2 * padding[1]} input")
    device = device_of({"x": x, "w": w, "b": b}, "conv2d")
    has_bn = bn is not None
    problem = ConvProblem(N, H, W, C, K, R, S, P, Q, stride, padding, dilation, groups, dtypes.short_name(x.dtype),
                          layout, has_scale=has_bn, has_shift=has_bn or b is not None, activation=activation,
                          allow_tf32=bool(allow_tf32), device=device,
                          aligned=device == "cpu" or all(a.data.ptr % 16 == 0 for a in (x, w)))
    if device == "cpu":  # host arrays run on the reference path
        _reference_fits(problem)
    return problem


def _reference_fits(p: ConvProblem) -> None:
    """Refuse a problem whose reference computation would not fit in host RAM before any of it is
    allocated (huge padding would otherwise reach np.pad). The reference holds x padded, one window
    of it and the output in float64 at once, the output twice (accumulator and einsum's result)."""
    padded = p.N * (p.H + 2 * p.padding[0]) * (p.W + 2 * p.padding[1]) * p.C
    window, output = p.N * p.P * p.Q * p.C, p.N * p.P * p.Q * p.K
    memory.require(8 * (padded + window + 2 * output), "cpu", "conv2d",
                   f"padding {p.padding} on x of {p.N}x{p.H}x{p.W}x{p.C} (N, H, W, C) (the reference path's "
                   "float64 buffers)")


def conv2d(x: Any, w: Any, b: Any = None, *, stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
           dilation: int | Sequence[int] = 1, groups: int = 1, bn: Sequence[Any] | None = None,
           activation: str | None = None, layout: str = "NHWC", allow_tf32: bool = False, path: str = "auto") -> Any:
    """act(bn(conv(x, w) + b)) in `layout`; see the module docstring for shapes. Returns y in x's
    dtype, layout and device."""
    x, w = as_array(x, "conv2d", "x"), as_array(w, "conv2d", "w")
    b = None if b is None else as_array(b, "conv2d", "b")
    # an absent b or bn keys as None without a call; prepare's arguments go as checks=, not in a closure.
    # The options' part of the key is _options_key's (inline: a frame less per call), so conv2d and
    # conv2d_with find each other's bound calls.
    key = (signature(x), signature(w), None if b is None else signature(b), None if bn is None else _bn_signature(bn),
           activation, (option_key(stride), option_key(padding), option_key(dilation), option_key(groups), layout,
                        allow_tf32, path), stream_key())
    return op.call(key, _checked_problem, path, x, w, b, bn,
                   checks=(x, w, b, bn, activation, stride, padding, dilation, groups, layout, allow_tf32))


class ConvOptions(NamedTuple):
    """conv2d's options for calls that all pass the same ones (an nn.Conv2d's), with `key`, their part
    of the bound-call key, made once by conv_options rather than at every call (each option keyed with
    its type costs about 0.25 µs on a CPU for a pair). Checked as conv2d checks them, at each bind."""
    stride: Any
    padding: Any
    dilation: Any
    groups: Any
    layout: str
    allow_tf32: bool
    path: str
    key: tuple


def conv_options(*, stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                 dilation: int | Sequence[int] = 1, groups: int = 1, layout: str = "NHWC", allow_tf32: bool = False,
                 path: str = "auto") -> ConvOptions:
    """conv2d's keyword options (its defaults) held for conv2d_with."""
    return ConvOptions(stride, padding, dilation, groups, layout, allow_tf32, path,
                       _options_key(stride, padding, dilation, groups, layout, allow_tf32, path))


def conv2d_with(options: ConvOptions, x: Any, w: Any, b: Any = None, bn: Sequence[Any] | None = None,
                activation: str | None = None) -> Any:
    """conv2d(x, w, b, bn=bn, activation=activation) with the options `options` holds: the same checks,
    errors and bound calls, without keying the options again."""
    x, w = as_array(x, "conv2d", "x"), as_array(w, "conv2d", "w")
    b = None if b is None else as_array(b, "conv2d", "b")
    key = (signature(x), signature(w), None if b is None else signature(b), None if bn is None else _bn_signature(bn),
           activation, options.key, stream_key())
    return op.call(key, _checked_problem_with, options.path, x, w, b, bn, checks=(x, w, b, bn, activation, options))


def _options_key(stride, padding, dilation, groups, layout, allow_tf32, path) -> tuple:
    """The options' part of a bound call's key, each option with its type (conv2d builds it inline)."""
    return (option_key(stride), option_key(padding), option_key(dilation), option_key(groups), layout, allow_tf32,
            path)


def _checked_problem(x, w, b, bn, activation, stride, padding, dilation, groups, layout, allow_tf32) -> ConvProblem:
    """conv2d_problem, and bn's checks (_epilogue_vectors raises what is wrong with it): a bind's prepare."""
    problem = conv2d_problem(x, w, b, bn, stride, padding, dilation, groups, activation, layout, allow_tf32)
    _epilogue_vectors(bn, b, problem.K, x)  # validates bn
    return problem


def _checked_problem_with(x, w, b, bn, activation, options: ConvOptions) -> ConvProblem:
    o = options
    return _checked_problem(x, w, b, bn, activation, o.stride, o.padding, o.dilation, o.groups, o.layout, o.allow_tf32)


def _bn_signature(bn) -> tuple:
    """What the checks of `bn` read: its type, its length, its arrays' signatures and eps. An array that
    is neither NumPy's nor CuPy's (a torch tensor: its strides are a method) is keyed by its type and the
    signature of the array it is taken as (as_array, as the checks take it)."""
    try:
        return type(bn), *(_vector_signature(v, i) if hasattr(v, "shape") else option_key(v) for i, v in enumerate(bn))
    except TypeError:  # not a sequence: the checks say so
        return (type(bn),)


def _vector_signature(v, i: int) -> tuple | None:
    if is_cupy(v) or isinstance(v, np.ndarray):
        return signature(v)
    return type(v), signature(as_array(v, "conv2d", f"bn[{i}]"))


def _inputs(problem: ConvProblem, x, w, b, bn):
    """C-contiguous x and w and the fp32 (scale, shift) of the epilogue, for the GPU paths."""
    return contiguous(x), contiguous(w), *_epilogue_vectors(bn, b, problem.K, x)


def _bind_inputs(problem: ConvProblem, x, w, b, bn) -> Callable[..., tuple]:
    """`_inputs` for the calls of this signature, bn checked once here (as the bind's prepare did; again
    for a bind through Op.dispatch, which has no prepare). Where x and w are C-contiguous and the
    epilogue comes as the kernels read it (no bn and an fp32 b or none, or no b and bn an fp32 (scale,
    shift) pair: a layer's calls), the arrays pass as they are: the key holds every shape, stride, dtype
    and type those checks read, so a call of this signature passes them too. Otherwise every call folds
    and converts as `_inputs` does."""
    _epilogue_vectors(bn, b, problem.K, x)  # raises what is wrong with bn

    def as_read(v) -> bool:
        return is_cupy(v) and v.dtype == np.float32 and v.flags.c_contiguous

    if x.flags.c_contiguous and w.flags.c_contiguous:
        if bn is None and (b is None or as_read(b)):
            return lambda x, w, b, bn: (x, w, None, b)
        if b is None and len(bn) == 2 and all(as_read(v) for v in bn):
            return lambda x, w, b, bn: (x, w, bn[0], bn[1])
    return lambda x, w, b, bn: _inputs(problem, x, w, b, bn)


def output_shape(problem: ConvProblem) -> tuple[int, int, int, int]:
    p = problem
    return (p.N, p.P, p.Q, p.K) if p.layout == "NHWC" else (p.N, p.K, p.P, p.Q)


def _gpu_support(problem: ConvProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- cudnn paths ------------------------------------------------------------------------------------
def _cudnn_support(problem: ConvProblem) -> str | None:
    if reason := _gpu_support(problem):
        return reason
    if not problem.aligned:  # an offset view: the engines' vector loads fault (CUDA misaligned address)
        return "cuDNN's engines need x and w to start on 16-byte boundaries (a view offset into a larger array does not)"
    return None


def _fused_cudnn_support(problem: ConvProblem) -> str | None:
    """The fused graph's limits: those of cuDNN's convolution, and no NCHW 1×1 output with an epilogue,
    which cuDNN 9.19's fused conv→pointwise engines write misplaced (measured on the H100: y[n, k] at
    y[k, n], garbage for C > 1; describing y in NHWC form, or every intermediate with y's strides,
    did not help). cudnn+epilogue, the convolution alone then libnn's epilogue kernel, runs them."""
    if reason := _cudnn_support(problem):
        return reason
    p = problem
    if p.layout == "NCHW" and p.P * p.Q == 1 and (p.has_scale or p.has_shift or p.activation):
        return "cuDNN 9.19's fused engines misplace NCHW 1x1 outputs with an epilogue (wrong results on the H100)"
    return None


# The uids of the tensors in conv2d_graph_builder's graph, for a variant pack (scale and shift only
# when the problem has them).
UID_X, UID_W, UID_SCALE, UID_SHIFT, UID_Y = range(1, 6)


def conv2d_graph_builder(problem: ConvProblem):
    """The builder (handle -> cuDNN graph, not yet validated) of conv_fprop → mul(scale) → add(shift) →
    activation, one node per line; its tensors carry the uids UID_X ... UID_Y."""
    def build(handle):
        import cudnn

        p, io, f32 = problem, cudnn_backend.data_type(problem.dtype), cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        x = g.tensor(dim=[p.N, p.C, p.H, p.W], stride=p.x_strides(), data_type=io, uid=UID_X)
        w = g.tensor(dim=[p.K, p.C // p.groups, p.R, p.S], stride=p.w_strides(), data_type=io, uid=UID_W)
        y = g.conv_fprop(x, w, padding=list(p.padding), stride=list(p.stride), dilation=list(p.dilation),
                         compute_data_type=f32)
        if p.has_scale:
            y = g.mul(y, g.tensor(dim=[1, p.K, 1, 1], stride=[p.K, 1, p.K, p.K], data_type=f32, uid=UID_SCALE))
        if p.has_shift:
            y = g.add(y, g.tensor(dim=[1, p.K, 1, 1], stride=[p.K, 1, p.K, p.K], data_type=f32, uid=UID_SHIFT))
        if p.activation == "relu":
            y = g.relu(y)
        elif p.activation == "relu6":
            y = g.relu(y, lower_clip=0.0, upper_clip=6.0)
        elif p.activation == "gelu":
            y = g.gelu_approx_tanh(y)
        elif p.activation == "silu":
            y = g.swish(y)
        y.set_output(True).set_data_type(io).set_stride(p.y_strides()).set_uid(UID_Y)
        if p.dtype == "fp32" and not p.allow_tf32:  # exact fp32: no TF32 tensor-core engines
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS])
        return g
    return build


def bind_cudnn_graph(problem: ConvProblem):
    """run(x, w, scale, shift) -> y through the cuDNN graph of `problem` (LibraryError if cuDNN declines it)."""
    uids = [UID_X, UID_W] + ([UID_SCALE] if problem.has_scale else []) + ([UID_SHIFT] if problem.has_shift else []) \
        + [UID_Y]
    execute = cudnn_backend.graph_for(problem, conv2d_graph_builder(problem), problem.describe).executor(uids)
    shape, dtype = output_shape(problem), dtypes.parse(problem.dtype)
    new = allocator(shape, dtype)

    def run(x, w, scale, shift):
        y = new()
        if scale is not None:  # bn: a scale comes with its shift (_epilogue_vectors)
            execute(x, w, scale, shift, y)
        elif shift is not None:  # a bias alone
            execute(x, w, shift, y)
        else:
            execute(x, w, y)
        return y
    return run


@op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_fused_cudnn_support, binds=True)
def _cudnn(problem: ConvProblem, x, w, b, bn):
    graph, inputs = bind_cudnn_graph(problem), _bind_inputs(problem, x, w, b, bn)

    def run(x, w, b, bn):
        return graph(*inputs(x, w, b, bn))
    return run


@op.path("cudnn+epilogue", kind="library", device="gpu", requires=("cudnn",), supports=_cudnn_support,
         binds=True)
def _cudnn_then_epilogue(problem: ConvProblem, x, w, b, bn):
    graph, inputs = bind_cudnn_graph(problem.epilogue_only()), _bind_inputs(problem, x, w, b, bn)

    def run(x, w, b, bn):
        x, w, scale, shift = inputs(x, w, b, bn)
        return apply_epilogue_kernel(problem, graph(x, w, None, None), scale, shift)
    return run


def apply_epilogue_kernel(problem: ConvProblem, y, scale, shift):
    """y = act(y * scale[k] + shift[k]) in place with kernels/epilogue.cu; returns y."""
    if not (problem.has_scale or problem.has_shift or problem.activation):
        return y
    kernel = kernels.function("epilogue.cu", f"channel_epilogue_{dtypes.KERNEL_SUFFIX[problem.dtype]}")
    inner = 1 if problem.layout == "NHWC" else problem.P * problem.Q  # elements between channels
    threads = 256
    blocks = min(-(-y.size // threads), launch.GRID_STRIDE_BLOCKS_X)
    kernel((blocks,), (threads,), _CHANNEL_EPILOGUE.pack(y=y, scale=scale, shift=shift, total=y.size, K=problem.K,
                                                         inner=inner, act=activations.KERNEL_CODES[problem.activation]))
    return y


# --- custom path: kernels/conv2d.cu ------------------------------------------------------------------
_CONV = contracts.params("conv2d.cu", "CONV_PARAMS")  # every conv kernel's parameters
_CHANNEL_EPILOGUE = contracts.params("epilogue.cu", "channel_epilogue_##SUFFIX")
_K = contracts.constants("conv2d.cu")


def custom_version(problem: ConvProblem) -> str:
    """Which kernel of kernels/conv2d.cu runs this problem."""
    if problem.groups == problem.C == problem.K:
        return "conv2_depthwise"
    if problem.groups == 1:
        return "conv4_igemm" if problem.dtype == "fp32" else "conv3_igemm"
    return "conv1_direct"


def custom_versions(problem: ConvProblem, aligned: bool = True) -> tuple[str, ...]:
    """The numbered versions of kernels/conv2d.cu that can run `problem`, baseline first (for tests and
    benchmarks; `bind_custom(problem, version)` takes one): conv1_direct, which runs any problem, and the one
    custom_version picks. Each kernel checks alignment itself, so `aligned` changes nothing here."""
    chosen = custom_version(problem)
    return ("conv1_direct",) if chosen == "conv1_direct" else ("conv1_direct", chosen)


def _conv_launch(version: str, p: ConvProblem) -> tuple[tuple[int, ...], int, int]:
    """(grid, block, dynamic shared memory) from kernels/conv2d.cu's LAUNCH table, its constants read
    from the file."""
    images = min(p.N, launch.MAX_GRID_YZ)  # the grid-stride kernels spread images over grid y or z
    if version == "conv2_depthwise":
        vector = 4 if p.dtype == "fp32" else 8  # 16 bytes of the dtype (the kernel's DT::V)
        chunk, threads = _K["CONV2_CHUNK"], _K["CONV2_THREADS"]
        groups_per_pixel = -(-min(p.C, chunk) // vector)
        blocks = min(-(-p.P * p.Q // (threads // groups_per_pixel)), launch.GRID_STRIDE_BLOCKS_X)
        return (blocks, -(-p.C // chunk), images), threads, (p.R * p.S + 2) * chunk * 4
    if version == "conv3_igemm":
        bm, bn, bk = _K["CONV3_BM"], _K["CONV3_BN"], _K["CONV3_BK"]
        smem = max(_K["CONV3_STAGES"] * (bm + bn) * bk * 2, bm * (bn + 8) * 4)
        return (-(-p.N * p.P * p.Q // bm), -(-p.K // bn)), 32 * _K["CONV3_WM"] * _K["CONV3_WN"], smem
    if version == "conv4_igemm":
        return (-(-p.N * p.P * p.Q // _K["C4_BM"]), -(-p.K // _K["C4_BN"])), _K["C4_THREADS"], 0
    threads = _K["CONV1_THREADS"]
    return (min(-(-p.P * p.Q * p.K // threads), launch.GRID_STRIDE_BLOCKS_X), images), threads, 0


def _conv_args(p: ConvProblem) -> tuple:
    """The arguments of every kernel of kernels/conv2d.cu, by the names CONV_PARAMS gives them: the
    problem's scalars, and launch.ARRAY for the five arrays, whose pointers each launch writes."""
    (sxn, sxh, sxw, sxc), (syn, syh, syw, syk) = nhwc_strides(p.layout, p.C, p.H, p.W), nhwc_strides(p.layout, p.K,
                                                                                                       p.P, p.Q)
    (stride_h, stride_w), (pad_h, pad_w), (dil_h, dil_w) = p.stride, p.padding, p.dilation
    A = launch.ARRAY
    return _CONV.pack(x=A, w=A, scale=A, shift=A, y=A, N=p.N, H=p.H, W=p.W, C=p.C, K=p.K, R=p.R, S=p.S,
                      P=p.P, Q=p.Q, stride_h=stride_h, stride_w=stride_w, pad_h=pad_h, pad_w=pad_w, dil_h=dil_h,
                      dil_w=dil_w, groups=p.groups, act=activations.KERNEL_CODES[p.activation],
                      sxn=sxn, sxh=sxh, sxw=sxw, sxc=sxc, syn=syn, syh=syh, syw=syw, syk=syk)


def bind_custom(problem: ConvProblem, version: str | None = None) -> Callable[..., Any]:
    """run(x, w, scale, shift) -> y with one kernel of kernels/conv2d.cu (the default: the fastest that
    supports the problem) for C-contiguous x and w in the problem's layout and fp32 (K,) scale and shift
    (None where the problem has none: a null pointer). The kernel, its geometry and its scalars are
    found here, once; the runner allocates y and launches."""
    import cupy

    p = problem
    version = version or custom_version(p)
    grid, block, smem = _conv_launch(version, p)
    kernel = launch.bind("conv2d.cu", f"{version}_{dtypes.KERNEL_SUFFIX[p.dtype]}", grid, (block,), _conv_args(p),
                         shared_mem=smem)
    shape, dtype = output_shape(p), dtypes.parse(p.dtype)
    new = allocator(shape, dtype)
    to_krsc = p.layout == "NCHW" and p.groups != p.C  # the kernels read KRSC filters (depthwise: the same bytes)

    def run(x, w, scale, shift):
        if to_krsc:  # at every call: w's values may have changed since the last one
            w = cupy.ascontiguousarray(w.transpose(0, 2, 3, 1))
        y = new()
        kernel(x, w, scale, shift, y)
        return y
    return run


@op.path("custom", kind="custom", device="gpu", supports=_gpu_support, binds=True)
def _custom(problem: ConvProblem, x, w, b, bn):
    kernel, inputs = bind_custom(problem), _bind_inputs(problem, x, w, b, bn)

    def run(x, w, b, bn):
        return kernel(*inputs(x, w, b, bn))
    return run


# --- reference --------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: ConvProblem, x, w, b, bn):
    p = problem
    scale, shift = _epilogue_vectors(bn, b, p.K, x)
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64)
    if p.layout == "NCHW":  # compute in NHWC / KRSC
        x64, w64 = x64.transpose(0, 2, 3, 1), w64.transpose(0, 2, 3, 1)
    (sh, sw), (ph, pw), (dh, dw) = p.stride, p.padding, p.dilation
    padded = np.pad(x64, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    G, Cg, Kg = p.groups, p.C // p.groups, p.K // p.groups
    out = np.zeros((p.N, p.P, p.Q, G, Kg))
    filters = w64.reshape(G, Kg, p.R, p.S, Cg)
    for r in range(p.R):
        for s in range(p.S):
            window = padded[:, r * dh: r * dh + (p.P - 1) * sh + 1: sh, s * dw: s * dw + (p.Q - 1) * sw + 1: sw, :]
            out += np.einsum("npqgc,gkc->npqgk", window.reshape(p.N, p.P, p.Q, G, Cg), filters[:, :, r, s, :])
    out = out.reshape(p.N, p.P, p.Q, p.K)
    if scale is not None:
        out *= scale
    if shift is not None:
        out += shift
    out = activations.apply(out, p.activation)
    if p.layout == "NCHW":
        out = out.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out).astype(x.dtype)
