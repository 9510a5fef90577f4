"""Linear layer: y = act(x @ weight.T + bias) through libnn.ops.linear."""

from __future__ import annotations

import math
from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module, init_uniform
from libnn.ops.linear import ACTIVATIONS, linear


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto", seed: int | None = None):
        super().__init__()
        in_features = checks.size("Linear", "in_features", in_features)
        out_features = checks.size("Linear", "out_features", out_features)
        bias = checks.flag("Linear", "bias", bias)
        checks.choice("Linear", "activation", activation, ACTIVATIONS)
        parsed, seed = checks.float_dtype("Linear", dtype), checks.seed("Linear", seed)
        checks.device("Linear", device)
        checks.path("Linear", path, ("linear",))
        checks.parameters_fit("Linear", f"in_features={in_features}, out_features={out_features}",
                              out_features * (in_features + bias), parsed, device)
        self.in_features, self.out_features = in_features, out_features
        self.activation, self.path = activation, path
        bound = 1 / math.sqrt(in_features)
        self.register_parameter("weight", init_uniform((out_features, in_features), bound, dtype, device, seed))
        self.register_parameter("bias", init_uniform((out_features,), bound, dtype, device,
                                                     None if seed is None else seed + 1) if bias else None)

    def forward(self, x: Any, residual: Any = None, activation: str | None = None) -> Any:
        """activation(x @ weight.T + bias + residual): a residual (the output's shape) is added in the
        GEMM's epilogue, not by a pass of its own. `activation` overrides the layer's (as Conv2d.forward's
        does): Sequential fuses a following activation layer through it."""
        return linear(x, self.weight, self.bias, activation or self.activation, residual=residual, path=self.path)

    def __repr__(self) -> str:
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}, path={self.path!r})")
