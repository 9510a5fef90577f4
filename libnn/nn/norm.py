"""Normalization layers, with parameters by PyTorch's names so that a PyTorch state_dict loads as it is:
- LayerNorm: y = (x − mean) / sqrt(var + eps) · weight + bias over the last dimension, through
  libnn.ops.layer_norm (weight, bias).
- RMSNorm: y = x / sqrt(mean(x²) + eps) · weight over the last dimension (LLaMA's, and Hugging Face's
  LlamaRMSNorm's `weight`), through libnn.ops.rms_norm.
- BatchNorm2d: batch norm in inference, the per-channel affine map of its running statistics (weight,
  bias, running_mean, running_var); Sequential folds it into the Conv2d before it (nn/conv.py)."""

from __future__ import annotations

from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module, full
from libnn.ops.conv2d import LAYOUTS, fold_batchnorm
from libnn.ops.layer_norm import layer_norm
from libnn.ops.rms_norm import rms_norm


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


class RMSNorm(Module):
    """RMS normalization over the last dimension, of size `dim` (torch.nn.RMSNorm over (dim,), Hugging
    Face's LlamaRMSNorm). weight starts as ones; elementwise_affine=False has none."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *, dtype: Any = "fp32",
                 device: str = "cpu", path: str = "auto"):
        super().__init__()
        dim = checks.size("RMSNorm", "dim", dim)
        eps = checks.positive_float("RMSNorm", "eps", eps)
        elementwise_affine = checks.flag("RMSNorm", "elementwise_affine", elementwise_affine)
        checks.path("RMSNorm", path, ("rms_norm",))
        checks.parameters_fit("RMSNorm", "dim", dim, checks.float_dtype("RMSNorm", dtype),
                              checks.device("RMSNorm", device))
        self.dim, self.eps, self.path, self.elementwise_affine = dim, eps, path, elementwise_affine
        self.register_parameter("weight", full((dim,), 1.0, dtype, device) if elementwise_affine else None)

    def forward(self, x: Any, residual: Any = None, return_sum: bool = False) -> Any:
        """RMSNorm(x + residual), the residual (x's shape) added as the rows are read; with return_sum,
        (y, x + residual): what a pre-norm block carries on to the next one."""
        return rms_norm(x, self.weight, residual=residual, eps=self.eps, return_sum=return_sum, path=self.path)

    def __repr__(self) -> str:
        return (f"RMSNorm({self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"path={self.path!r})")


class BatchNorm2d(Module):
    """Batch norm in inference: y = (x - running_mean) / sqrt(running_var + eps) * weight + bias."""

    def __init__(self, num_features: int, eps: float = 1e-5, *, layout: str = "NHWC", dtype: Any = "fp32",
                 device: str = "cpu"):
        super().__init__()
        num_features = checks.size("BatchNorm2d", "num_features", num_features)
        eps = checks.positive_float("BatchNorm2d", "eps", eps)
        checks.choice("BatchNorm2d", "layout", layout, LAYOUTS)
        checks.parameters_fit("BatchNorm2d", "num_features", 4 * num_features, checks.float_dtype("BatchNorm2d", dtype),
                              checks.device("BatchNorm2d", device))
        self.num_features, self.eps, self.layout = num_features, eps, layout
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_parameter(name, full((num_features,), value, dtype, device))

    def folded(self) -> tuple[Any, Any]:
        """(scale, shift) of the affine map this layer computes."""
        return fold_batchnorm(self.weight, self.bias, self.running_mean, self.running_var, self.eps)

    def forward(self, x: Any) -> Any:
        x = checks.float_input("BatchNorm2d", x, self.weight)
        if x.ndim != 4:  # a 2-D (N, C) input would broadcast to a 4-D result
            raise ValueError(f"BatchNorm2d: x must be 4-D ({', '.join(self.layout)}), got shape {tuple(x.shape)}")
        channels = x.shape[3 if self.layout == "NHWC" else 1]
        if channels != self.num_features:
            raise ValueError(f"BatchNorm2d: x has {channels} channels (shape {tuple(x.shape)}, layout {self.layout}) "
                             f"but the layer has num_features={self.num_features}")
        scale, shift = self.folded()
        shape = (1, 1, 1, -1) if self.layout == "NHWC" else (1, -1, 1, 1)
        return (x * scale.reshape(shape) + shift.reshape(shape)).astype(x.dtype)
