"""Layer normalization: y = (x − mean) / sqrt(var + eps) · weight + bias over the last dimension,
through libnn.ops.layer_norm. Parameters by PyTorch's names (weight, bias), so that a PyTorch
state_dict loads as it is."""

from __future__ import annotations

from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module, full
from libnn.ops.layer_norm import layer_norm


def _features(normalized_shape: Any) -> tuple[int]:
    """(N,) from N or (N,) (NumPy integers too)."""
    items = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
    if len(items) != 1 or not checks.is_int(items[0]) or items[0] < 1:
        raise ValueError("LayerNorm: normalized_shape must be N or (N,) with N >= 1 (libnn normalizes over the "
                         f"last dimension only), got {normalized_shape!r}")
    return (int(items[0]),)


class LayerNorm(Module):
    """torch.nn.LayerNorm over the last dimension: `normalized_shape` is N or (N,). weight starts as
    ones and bias as zeros (PyTorch's init); elementwise_affine=False has neither, bias=False no bias."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto"):
        super().__init__()
        shape = _features(normalized_shape)
        eps = checks.positive_float("LayerNorm", "eps", eps)
        elementwise_affine = checks.flag("LayerNorm", "elementwise_affine", elementwise_affine)
        bias = checks.flag("LayerNorm", "bias", bias)
        checks.path("LayerNorm", path, ("layer_norm",))
        checks.parameters_fit("LayerNorm", "normalized_shape", 2 * shape[0], checks.float_dtype("LayerNorm", dtype),
                              checks.device("LayerNorm", device))
        self.normalized_shape, self.eps, self.path = shape, eps, path
        self.elementwise_affine = elementwise_affine
        self.register_parameter("weight", full(shape, 1.0, dtype, device) if elementwise_affine else None)
        self.register_parameter("bias", full(shape, 0.0, dtype, device) if elementwise_affine and bias else None)

    def forward(self, x: Any, residual: Any = None) -> Any:
        """LayerNorm(x + residual): a residual (x's shape) is added as the rows are read, not by a pass
        of its own."""
        return layer_norm(x, self.weight, self.bias, residual=residual, eps=self.eps, path=self.path)

    def __repr__(self) -> str:
        return (f"LayerNorm({self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}, path={self.path!r})")
