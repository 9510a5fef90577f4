"""Linear layer: y = act(x @ weight.T + bias) through libnn.ops.linear, or with its weight in FP8 through
libnn.ops.linear_fp8.

`Linear(..., dtype="fp8")`, or `quantize("fp8")` on a layer or any model holding Linear layers, keeps the
weight as E4M3 codes: `weight` (out_features, in_features) uint8 and `weight_scale` float32,
(out_features,) per output channel (the default) or (1,) per tensor, the names of Hugging Face's FP8
checkpoints; x, the bias and the result stay in the activations' dtype (fp16 or bf16 on the GPU).
`dtype="fp8"` builds the bias in fp16; for bf16 activations build the layer in bf16 and quantize it.
"""

from __future__ import annotations

import math
from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module, init_uniform
from libnn.ops.linear import ACTIVATIONS, linear
from libnn.ops.linear_fp8 import linear_fp8
from libnn.ops.quantize_fp8 import QUANTIZED_DTYPES, check_quantize, quantize_weight, require_fp8_gpu
from libnn.registry import get_op
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
        if quantized:
            self.quantize(dtype)

    def forward(self, x: Any, residual: Any = None, activation: str | None = None) -> Any:
        """activation(x @ weight.T + bias + residual): a residual (the output's shape) is added in the
        GEMM's epilogue, not by a pass of its own. `activation` overrides the layer's (as Conv2d.forward's
        does): Sequential fuses a following activation layer through it."""
        if self.quantized:
            return linear_fp8(x, self.weight, self.weight_scale, self.bias, activation or self.activation,
                              residual=residual, path=self.path)
        return linear(x, self.weight, self.bias, activation or self.activation, residual=residual, path=self.path)

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
            if self.path not in get_op("linear_fp8").paths:
                self.path = "auto"
        return self

    def keeps_dtype(self, name: str) -> bool:
        return self.quantized is not None and name in QUANTIZED_PARAMETERS

    def __repr__(self) -> str:
        quantized = f", quantized={self.quantized!r}" if self.quantized else ""
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}, path={self.path!r}{quantized})")
