"""Pooling layers (MaxPool2d, AvgPool2d) over op pool2d, with PyTorch's arguments and rules."""

from __future__ import annotations

from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module
from libnn.ops.conv2d import LAYOUTS
from libnn.ops.pool2d import avg_pool2d, max_pool2d


class MaxPool2d(Module):
    """Max over each window (AvgPool2d: the mean); stride defaults to the kernel size, padding is at
    most half the window (PyTorch's rules)."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, *, layout: str = "NHWC",
                 path: str = "auto"):
        super().__init__()
        name = type(self).__name__
        kernel = checks.pair(name, "kernel_size", kernel_size, 1)
        stride = kernel if stride is None else checks.pair(name, "stride", stride, 1)
        padding = checks.pair(name, "padding", padding, 0)
        if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
            raise ValueError(f"{name}: padding {padding} must be at most half the kernel size {kernel}")
        checks.choice(name, "layout", layout, LAYOUTS)
        checks.path(name, path, ("pool2d",))
        self.kernel_size, self.stride, self.padding, self.layout, self.path = kernel, stride, padding, layout, path

    def forward(self, x: Any) -> Any:
        return max_pool2d(x, self.kernel_size, self.stride, self.padding, layout=self.layout, path=self.path)


class AvgPool2d(MaxPool2d):
    def forward(self, x: Any) -> Any:
        return avg_pool2d(x, self.kernel_size, self.stride, self.padding, layout=self.layout, path=self.path)
