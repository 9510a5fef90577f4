"""Element-wise activation layers by PyTorch's names (ReLU, ReLU6, GELU, SiLU), computed by
libnn.ops.activations; Sequential fuses one into the conv or linear layer before it where that op's
epilogue computes it."""

from __future__ import annotations

from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module
from libnn.ops import activations


class Activation(Module):
    """An element-wise activation by name; ReLU, ReLU6, GELU and SiLU are its instances."""

    name: str | None = None

    def forward(self, x: Any) -> Any:
        x = checks.float_input(type(self).__name__, x)
        return activations.apply(x, self.name).astype(x.dtype)


class ReLU(Activation):
    name = "relu"


class ReLU6(Activation):
    name = "relu6"


class GELU(Activation):
    """PyTorch's nn.GELU: exact (erf) by default, the tanh approximation with approximate="tanh"."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.name = "gelu_erf" if approximate == "none" else "gelu"


class SiLU(Activation):
    name = "silu"
