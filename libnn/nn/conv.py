"""The convolution layer (direct or FFT) and the conv→BN→activation fusion that `Sequential` applies
on its own. Batch norm is in nn/norm.py, activations in nn/activation.py, pooling in nn/pool.py.

Weights are stored in PyTorch's layout and names (Conv2d.weight is (K, C/groups, R, S)), so a PyTorch
state_dict loads as it is. A layer computes in its `layout` ("NHWC" by default: the layout cuDNN's
fused engines and our kernels are fastest in); the weight is converted to that layout once and the
conversion cached until the weight changes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.nn import checks
from libnn.nn.module import Module, init_uniform, uninitialised
from libnn.nn.norm import BatchNorm2d
from libnn.ops import activations
from libnn.ops.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
from libnn.ops.conv2d import LAYOUTS, ConvOptions, conv2d_with, conv_options, fold_batchnorm
from libnn.ops.fft_conv import fft_conv2d
from libnn.runtime.arrays import array_module, as_array, is_cupy


# The smallest kernel size from which FFT convolution beat direct cuDNN convolution, by image size
# (rows of (image size, kernel size)), as `libnn bench fft_conv` measured on the H100 (fp32, stride 1;
# benchmarks/RESULTS.md, FFT convolution).
FFT_CROSSOVER = {"single channel": ((64, 63), (256, 31), (1024, 7), (2048, 3)),
                 "multi channel": ((256, 15), (1024, 15), (2048, 15))}
ALGOS = ("auto", "direct", "fft")
# The layer's attributes that are conv2d's options: setting one (use_path sets path) drops the layer's
# ConvOptions, made again at its next call.
CONV_OPTIONS = frozenset({"stride", "padding", "dilation", "groups", "layout", "path"})
# What a built layer checks when one of these is set again, as its constructor did (path is not
# checked: use_path sets paths of other ops on it). A new value changes the layer's version, as any
# setting's does (nn.module), so that what was built from the old one (a Sequential's fused and
# folded clone, a CUDA graph's capture) is made again.
_CONFIG_CHECKS = {"stride": lambda v: checks.pair("Conv2d", "stride", v, 1),
                  "padding": lambda v: checks.pair("Conv2d", "padding", v, 0),
                  "dilation": lambda v: checks.pair("Conv2d", "dilation", v, 1),
                  "groups": lambda v: checks.size("Conv2d", "groups", v),
                  "layout": lambda v: checks.choice("Conv2d", "layout", v, LAYOUTS),
                  "algo": lambda v: checks.choice("Conv2d", "algo", v, ALGOS),
                  "activation": lambda v: checks.choice("Conv2d", "activation", v, CONV_ACTIVATIONS)}


def prefers_fft(channels: int, size: int, kernel: int) -> bool:
    """Whether FFT convolution is expected to be faster than direct, from FFT_CROSSOVER: the row of
    the largest measured image size not above `size` (none: direct)."""
    crossover = None  # a loop, not a list of the rows: every call of an "auto" layer asks
    for measured, kernel_from in FFT_CROSSOVER["single channel" if channels == 1 else "multi channel"]:
        if measured <= size:
            crossover = kernel_from
    return crossover is not None and kernel >= crossover


def _fft_able(stride: tuple[int, int], dilation: tuple[int, int], groups: int) -> bool:
    return stride == (1, 1) and dilation == (1, 1) and groups == 1


def _check_fft(algo: str, stride: tuple[int, int], dilation: tuple[int, int], groups: int) -> None:
    if algo == "fft" and not _fft_able(stride, dilation, groups):
        raise ValueError("Conv2d: algo='fft' needs stride 1, dilation 1 and groups 1 "
                         f"(got stride={stride}, dilation={dilation}, groups={groups}); use algo='direct'")


class Conv2d(Module):
    """`algo`: "direct" (conv2d's paths), "fft" (fft_conv2d; stride 1, dilation 1, groups 1 only) or
    "auto" (FFT where FFT_CROSSOVER says it is faster, direct otherwise)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 activation: str | None = None, *, layout: str = "NHWC", dtype: Any = "fp32", device: str = "cpu",
                 path: str = "auto", algo: str = "auto", seed: int | None = None):
        super().__init__()
        in_channels = checks.size("Conv2d", "in_channels", in_channels)
        out_channels = checks.size("Conv2d", "out_channels", out_channels)
        r, s = checks.pair("Conv2d", "kernel_size", kernel_size, 1)
        stride, dilation = checks.pair("Conv2d", "stride", stride, 1), checks.pair("Conv2d", "dilation", dilation, 1)
        padding = checks.pair("Conv2d", "padding", padding, 0)
        groups = checks.size("Conv2d", "groups", groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: groups must divide in_channels and out_channels, got groups={groups} with "
                             f"in_channels={in_channels}, out_channels={out_channels}")
        bias = checks.flag("Conv2d", "bias", bias)
        checks.choice("Conv2d", "activation", activation, CONV_ACTIVATIONS)
        checks.choice("Conv2d", "layout", layout, LAYOUTS)
        checks.choice("Conv2d", "algo", algo, ALGOS)
        checks.path("Conv2d", path, {"direct": ("conv2d",), "fft": ("fft_conv",), "auto": ("conv2d", "fft_conv")}[algo])
        parsed, seed = checks.float_dtype("Conv2d", dtype), checks.seed("Conv2d", seed)
        checks.device("Conv2d", device)
        _check_fft(algo, stride, dilation, groups)
        shape = (out_channels, in_channels // groups, r, s)
        checks.parameters_fit("Conv2d", f"weight of shape {shape}", math.prod(shape) + out_channels * bias, parsed,
                              device)
        self.algo = algo
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (r, s)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.activation, self.layout, self.path = activation, layout, path
        bound = 1 / math.sqrt(in_channels // groups * r * s)
        self.register_parameter("weight", init_uniform(shape, bound, dtype, device, seed))
        self.register_parameter("bias", init_uniform((out_channels,), bound, dtype, device,
                                                     None if seed is None else seed + 1) if bias else None)
        self._converted: tuple[Any, Any] | None = None
        self._bias32: tuple[Any, Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONFIG_CHECKS and "weight" in self._parameters:  # the constructor checked its own
            value = _CONFIG_CHECKS[name](value)
        super().__setattr__(name, value)
        if name in CONV_OPTIONS:
            object.__setattr__(self, "_options", None)

    def filters(self) -> Any:
        """The weight in the filter layout of `self.layout` (KRSC for NHWC), converted once."""
        if self.layout == "NCHW":
            return self.weight
        if self._converted is None or self._converted[0] is not self.weight:
            xp = array_module(self.weight)
            self._converted = (self.weight, xp.ascontiguousarray(self.weight.transpose(0, 2, 3, 1)))
        return self._converted[1]

    def with_parameters(self, weight: Any, bias: Any) -> "Conv2d":
        """A Conv2d configured as this one, holding `weight` and `bias` (this layer's shapes, dtype and
        device) in place of its own: built by the constructor, which draws no initial values here."""
        with uninitialised():
            clone = Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                           self.dilation, self.groups, bias is not None, self.activation, layout=self.layout,
                           dtype=dtypes.short_name(weight.dtype), device="gpu" if is_cupy(weight) else "cpu",
                           algo=self.algo)
        clone.path = self.path  # as use_path sets it: a path of another op, which the constructor refuses
        clone.register_parameter("weight", weight)
        clone.register_parameter("bias", bias)
        return clone

    def uses_fft(self, x: Any) -> bool:
        if self.algo != "auto":
            if self.algo == "fft":  # stride, dilation or groups may have been set since the constructor
                _check_fft(self.algo, self.stride, self.dilation, self.groups)
            return self.algo == "fft"
        shape = x.shape  # read once: CuPy makes the tuple at every read
        if len(shape) != 4:  # conv2d names the expected rank
            return False
        h, w = (shape[1], shape[2]) if self.layout == "NHWC" else (shape[2], shape[3])
        return (_fft_able(self.stride, self.dilation, self.groups)
                and prefers_fft(self.in_channels, min(h, w), min(self.kernel_size)))

    def forward(self, x: Any, bn: Any = None, activation: str | None = None) -> Any:
        activation = activation or self.activation
        x = as_array(x, "Conv2d", "x")
        if self.uses_fft(x):
            return self._fft_forward(x, bn, activation)
        return conv2d_with(self._options or self.conv2d_options(), x, self.filters(), self.epilogue_bias(), bn,
                           activation)

    def conv2d_options(self) -> ConvOptions:
        """conv2d's options from this layer's attributes, keyed once until one of them is set again."""
        if self._options is None:
            self._options = conv_options(stride=self.stride, padding=self.padding, dilation=self.dilation,
                                         groups=self.groups, layout=self.layout, path=self.path)
        return self._options

    def epilogue_bias(self) -> Any:
        """The bias as conv2d's epilogue reads it: an fp16/bf16 bias on the GPU in fp32, converted once
        per bias array (as `filters` converts the weight), not by a kernel in every call."""
        bias, converted = self.bias, self._bias32
        if converted is not None and converted[0] is bias:  # the common case first: one test per call
            return converted[1]
        if bias is None or not is_cupy(bias) or bias.dtype.itemsize != 2:
            return bias
        self._bias32 = (bias, bias.astype(np.float32))
        return self._bias32[1]

    def _fft_forward(self, x: Any, bn: Any, activation: str | None) -> Any:
        """fft_conv2d works in NCHW; the epilogue (BN as scale/shift, activation) follows in fp32."""
        xp = array_module(x)
        nchw = x if self.layout == "NCHW" else xp.ascontiguousarray(x.transpose(0, 3, 1, 2))
        y = fft_conv2d(nchw, self.weight, self.bias, padding=self.padding,
                       path="auto" if self.path == "auto" else self.path)
        if bn is not None or activation:
            compute = y.astype(xp.float32 if xp is not np or y.dtype != np.float64 else np.float64)
            if bn is not None:
                scale, shift = bn if len(bn) == 2 else fold_batchnorm(*bn)
                compute = compute * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)
            y = activations.apply(compute, activation).astype(y.dtype)
        return y if self.layout == "NCHW" else xp.ascontiguousarray(y.transpose(0, 2, 3, 1))


class Conv2dBNAct(Module):
    """conv → batch norm → activation as one op: BN folded into the conv's weight and bias (the
    default), or kept as the graph's per-channel epilogue (`fold=False`). Formed by Sequential."""

    def __init__(self, conv: Conv2d, bn: BatchNorm2d, activation: str | None, fold: bool = True):
        super().__init__()
        for name, value, kind in (("conv", conv, Conv2d), ("bn", bn, BatchNorm2d)):
            if not isinstance(value, kind):
                raise TypeError(f"Conv2dBNAct: {name} must be a {kind.__name__}, got {type(value).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"Conv2dBNAct: the BatchNorm2d has num_features={bn.num_features} but the Conv2d before "
                             f"it has out_channels={conv.out_channels}")
        checks.choice("Conv2dBNAct", "activation", activation, CONV_ACTIVATIONS)
        self.conv, self.bn, self.activation = conv, bn, activation
        self.fold = checks.flag("Conv2dBNAct", "fold", fold)
        self._folded: Conv2d | None = None
        self._epilogue: tuple[Any, Any] | None = None
        self._made_at: tuple[int, int] | None = None  # (conv, bn) versions the two above were made at

    def describe(self) -> str:
        how = "BN folded into the weights" if self.fold else "BN as the epilogue"
        return f"Conv2d+BatchNorm2d{'+' + self.activation if self.activation else ''} fused ({how})"

    def forward(self, x: Any) -> Any:
        if self._made_at != (self.conv.version, self.bn.version):  # two reads a call: what was made from
            self._remake()  # them follows a replaced parameter and the conv's stride, padding, path, ...
        if not self.fold:
            return self.conv(x, bn=self._epilogue, activation=self.activation)
        # the clone is a plain Conv2d of ours: its forward is what calling it runs, without Module.__call__
        return self._folded.forward(x, activation=self.activation)

    def _remake(self) -> None:
        """The BN's scale and shift for the epilogue, or the folded clone: a Conv2d configured as the
        conv (with_parameters) with w' = w · scale and b' = b · scale + shift, computed in fp32 (fp64
        for fp64 layers) and rounded once to the layer's dtype."""
        c = self.conv
        scale, shift = self.bn.folded()
        if not self.fold:
            self._epilogue = (scale, shift)
        else:
            xp = array_module(c.weight)
            compute = xp.float64 if c.weight.dtype == xp.float64 else xp.float32
            w = (c.weight.astype(compute) * scale.reshape(-1, 1, 1, 1)).astype(c.weight.dtype)
            b = shift if c.bias is None else c.bias.astype(compute) * scale + shift
            self._folded = c.with_parameters(w, b.astype(c.weight.dtype))
        self._made_at = (c.version, self.bn.version)
