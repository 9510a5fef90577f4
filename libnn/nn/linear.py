"""Linear layer: y = act(x @ weight.T + bias) through libnn.ops.linear, or with its weight in FP8 through
libnn.ops.linear_fp8.

`Linear(..., dtype="fp8")`, or `quantize("fp8")` on a layer or any model holding Linear layers, keeps the
weight as E4M3 codes: `weight` (out_features, in_features) uint8 and `weight_scale` float32,
(out_features,) per output channel (the default) or (1,) per tensor, the names of Hugging Face's FP8
checkpoints; x, the bias and the result stay in the activations' dtype (fp16 or bf16 on the GPU).
`dtype="fp8"` builds the bias in fp16; for bf16 activations build the layer in bf16 and quantize it.
A float layer's `weight_scale` is None.

Layers that run several Linear children as one GEMM (BERT's query, key and value) stack them with
`stack_linear`, which stacks the codes and scales of quantised layers as it stacks float weights.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

from libnn import dtypes
from libnn.nn import checks
from libnn.nn.functional import dense, fp8_path
from libnn.nn.module import Module, init_uniform
from libnn.ops.linear import ACTIVATIONS
from libnn.ops.quantize_fp8 import QUANTIZED_DTYPES, check_quantize, quantize_weight, require_fp8_gpu
from libnn.runtime.arrays import array_module, device_of
from libnn.runtime.device import current_device_id

FP8_BIAS_DTYPE = "fp16"  # the bias (and activations) of Linear(dtype="fp8")
QUANTIZED_PARAMETERS = ("weight", "weight_scale")


def _is_quantized_dtype(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype.lower() in QUANTIZED_DTYPES


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto", seed: int | None = None):
        super().__init__()
        in_features = checks.size("Linear", "in_features", in_features)
        out_features = checks.size("Linear", "out_features", out_features)
        bias = checks.flag("Linear", "bias", bias)
        checks.choice("Linear", "activation", activation, ACTIVATIONS)
        quantized = _is_quantized_dtype(dtype)
        parsed, seed = checks.float_dtype("Linear", FP8_BIAS_DTYPE if quantized else dtype), checks.seed("Linear", seed)
        checks.device("Linear", device)
        checks.path("Linear", path, ("linear",))
        if quantized and device != "cpu":  # refused before anything is drawn
            require_fp8_gpu("Linear", current_device_id())
        checks.parameters_fit("Linear", f"in_features={in_features}, out_features={out_features}",
                              out_features * (in_features + bias), parsed, device)
        self.in_features, self.out_features = in_features, out_features
        self.activation, self.path, self.quantized = activation, path, None
        bound = 1 / math.sqrt(in_features)
        self.register_parameter("weight", init_uniform((out_features, in_features), bound, parsed, device, seed))
        self.register_parameter("bias", init_uniform((out_features,), bound, parsed, device,
                                                     None if seed is None else seed + 1) if bias else None)
        self.register_parameter("weight_scale", None)  # set by quantize()
        if quantized:
            self.quantize(dtype)

    def forward(self, x: Any, residual: Any = None, activation: str | None = None, prefetch: Any = None) -> Any:
        """activation(x @ weight.T + bias + residual): a residual (the output's shape) is added in the
        GEMM's epilogue, not by a pass of its own. `activation` overrides the layer's (as Conv2d.forward's
        does): Sequential fuses a following activation layer through it. `prefetch`: the ops' L2 prefetch
        hint, what the next kernel reads first (runtime/l2_prefetch.py)."""
        return dense(x, self.weight, self.bias, activation or self.activation, w_scale=self.weight_scale,
                     residual=residual, prefetch=prefetch, path=self.path)

    def quantize(self, dtype: str = "fp8", *, per_channel: bool = True) -> "Linear":
        """The weight as E4M3 codes (`weight`, uint8) and float32 scales (`weight_scale`: per output
        channel, or one with per_channel=False), in place (see Module.quantize); a layer already
        quantised stays as it is. A path linear_fp8 lacks ("cudnn") becomes "auto"."""
        check_quantize("Linear.quantize", dtype, per_channel, [self.weight])
        if self.quantized is None:
            weight = quantize_weight(self.weight, per_channel=per_channel)
            self.register_parameter("weight", weight.data)
            self.register_parameter("weight_scale", weight.scale)
            self.quantized = dtype.lower()
            self.path = fp8_path(self.path)
        return self

    def keeps_dtype(self, name: str) -> bool:
        return self.quantized is not None and name in QUANTIZED_PARAMETERS

    def __repr__(self) -> str:
        quantized = f", quantized={self.quantized!r}" if self.quantized else ""
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}, path={self.path!r}{quantized})")


# --- Linear layers stacked into one GEMM ---------------------------------------------------------------------
class StackedLinear(NamedTuple):
    """Linear layers stacked along their outputs, to run as one GEMM (stack_linear): `weight` (ΣN, K) in
    the layers' dtype, or for quantised layers E4M3 codes (uint8) with `weight_scale` (ΣN,) float32, one
    scale per row (a per-tensor scale repeated over its layer's rows: the same values, exactly), else
    None; `bias` (ΣN,), or None for layers without one. `parts`: each layer's weight, bias and
    weight_scale as the stacking left them, by which stack_linear tells whether the stack is current.
    Calling it runs the GEMM: stacked(x, activation, residual=, path=)."""
    weight: Any
    bias: Any
    weight_scale: Any
    parts: tuple[Any, ...]

    def __call__(self, x: Any, activation: str | None = None, *, residual: Any = None, path: str = "auto") -> Any:
        return dense(x, self.weight, self.bias, activation, w_scale=self.weight_scale, residual=residual, path=path)


def stack_linear(layers: Sequence[Linear], previous: StackedLinear | None = None) -> StackedLinear:
    """The weights (E4M3 codes and scales, for quantised layers) and biases of `layers` stacked along
    their output rows, in order, to run as one GEMM (q, k and v; gate and up). The layers' parameters
    then become views into the stacked arrays (share_stacked), so each weight is held once. `previous`,
    what this function returned for the same layers, is returned as it is while every layer still holds
    the parameters it left there; a replaced one (load_state_dict, to(), quantize(), `layer.weight_scale
    = s`) makes a new stack. Changes made in place reach the stack through the views, except to a
    per-tensor weight_scale (1,): that is a view of the first of its copies, so replace it instead.

    The layers must agree on in_features, on being quantised or not, on having a bias, and on their
    dtypes and device."""
    layers = tuple(layers)
    if previous is not None and _holds(layers, previous.parts):
        return previous
    _check_stackable("stack_linear", layers)
    xp = array_module(layers[0].weight)
    weight = xp.concatenate([layer.weight for layer in layers])
    bias = None if layers[0].bias is None else xp.concatenate([layer.bias for layer in layers])
    scale = None
    if layers[0].weight_scale is not None:  # a (1,) scale broadcast over its layer's rows
        scale = xp.concatenate([xp.broadcast_to(layer.weight_scale, layer.weight.shape[:1]) for layer in layers])
    return share_stacked(layers, weight, bias, scale)


def share_stacked(layers: Sequence[Linear], weight: Any, bias: Any = None, weight_scale: Any = None) -> StackedLinear:
    """Make the parameters of `layers` views into stacked arrays as stack_linear leaves them (rows in the
    layers' order; a per-tensor weight_scale becomes the (1,) view of its first row's scale), and return
    their StackedLinear: for the arrays stack_linear built, or a copy of them moved whole to another
    device (one copy per stack, not one per layer, and the layers then share it)."""
    layers = tuple(layers)
    _check_stackable("share_stacked", layers)
    rows = sum(layer.weight.shape[0] for layer in layers)
    expected = {"weight": (rows, layers[0].weight.shape[1]), "bias": None if layers[0].bias is None else (rows,),
                "weight_scale": None if layers[0].weight_scale is None else (rows,)}
    for name, a in (("weight", weight), ("bias", bias), ("weight_scale", weight_scale)):
        shape = None if a is None else tuple(a.shape)
        if shape != expected[name]:
            raise ValueError(f"share_stacked: {name} must be {'None' if expected[name] is None else expected[name]} "
                             f"for these {len(layers)} layers, got {'None' if shape is None else shape}")
    device_of({"weight": weight, "bias": bias, "weight_scale": weight_scale}, "share_stacked")
    start = 0
    for layer in layers:
        end = start + layer.weight.shape[0]
        layer.register_parameter("weight", weight[start:end])
        if bias is not None:
            layer.register_parameter("bias", bias[start:end])
        if weight_scale is not None:
            layer.register_parameter("weight_scale", weight_scale[start:start + layer.weight_scale.shape[0]])
        start = end
    return StackedLinear(weight, bias, weight_scale, _parts(layers))


def _parts(layers: Sequence[Linear]) -> tuple[Any, ...]:
    """The layers' weight, bias and weight_scale (None where absent), in order."""
    return tuple(a for layer in layers for a in (layer.weight, layer.bias, layer.weight_scale))


def _holds(layers: tuple[Linear, ...], parts: tuple[Any, ...]) -> bool:
    """Whether the layers still hold exactly the arrays `parts` lists (the same objects)."""
    now = _parts(layers)
    return len(now) == len(parts) and all(a is b for a, b in zip(now, parts))


def _check_stackable(where: str, layers: tuple[Any, ...]) -> None:
    """Layers that stack into one GEMM: nn.Linear all, agreeing on what the stack needs one of."""
    if not layers or not all(isinstance(layer, Linear) for layer in layers):
        raise TypeError(f"{where}: layers must be a non-empty sequence of nn.Linear, got "
                        f"{[type(layer).__name__ for layer in layers]}")
    agree = {"in_features": [layer.weight.shape[1] for layer in layers],
             "quantized": [layer.quantized for layer in layers],
             "bias": [layer.bias is not None for layer in layers],
             "weight dtype": [dtypes.short_name(layer.weight.dtype) for layer in layers],
             "bias dtype": [dtypes.short_name(layer.bias.dtype) for layer in layers if layer.bias is not None]}
    for what, values in agree.items():
        if len(set(values)) > 1:
            raise ValueError(f"{where}: layers must agree on {what} to run as one GEMM, got {values}")
    device_of({f"layers[{i}].{name}": a for i, layer in enumerate(layers) for name, a in layer.named_parameters()},
              where)
