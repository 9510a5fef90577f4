"""Layer normalization: y = (x − mean) / sqrt(var + eps) · weight + bias over the last dimension,
through libnn.ops.layernorm. Parameters by PyTorch's names (weight, bias), so that a PyTorch
state_dict loads as it is."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from libnn.nn.module import Module, full
from libnn.ops.layernorm import layer_norm


def _features(normalized_shape: Any) -> tuple[int]:
    """(N,) from N or (N,) (NumPy integers too)."""
    try:
        shape = (operator.index(normalized_shape),)
    except TypeError:
        shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else ()
    if len(shape) != 1 or not isinstance(shape[0], (int, np.integer)) or shape[0] < 1:
        raise ValueError("LayerNorm: normalized_shape must be N or (N,) with N >= 1 (libnn normalizes over the "
                         f"last dimension only), got {normalized_shape!r}")
    return (int(shape[0]),)


class LayerNorm(Module):
    """torch.nn.LayerNorm over the last dimension: `normalized_shape` is N or (N,). weight starts as
    ones and bias as zeros (PyTorch's init); elementwise_affine=False has neither, bias=False no bias."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto"):
        super().__init__()
        shape = _features(normalized_shape)
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps!r}")
        self.normalized_shape, self.eps, self.path = shape, eps, path
        self.elementwise_affine = elementwise_affine
        self.register_parameter("weight", full(shape, 1.0, dtype, device) if elementwise_affine else None)
        self.register_parameter("bias", full(shape, 0.0, dtype, device) if elementwise_affine and bias else None)

    def forward(self, x: Any) -> Any:
        return layer_norm(x, self.weight, self.bias, eps=self.eps, path=self.path)

    def __repr__(self) -> str:
        return (f"LayerNorm({self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}, path={self.path!r})")
