"""Pooling layers (MaxPool2d, AvgPool2d) over op pool2d, with PyTorch's arguments and rules."""

from __future__ import annotations

from typing import Any

from libnn.nn import checks
from libnn.nn.module import Module
from libnn.ops.conv2d import LAYOUTS
from libnn.ops.pool2d import avg_pool2d, max_pool2d

# The layer's attributes that are the op's sizes: setting one drops the sizes the layer passes (_op_sizes).
POOL_SIZES = frozenset({"kernel_size", "stride", "padding"})


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

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in POOL_SIZES:
            object.__setattr__(self, "_sizes", None)

    def forward(self, x: Any) -> Any:
        kernel, stride, padding = self._sizes or self._op_sizes()
        return max_pool2d(x, kernel, stride, padding, layout=self.layout, path=self.path)

    def _op_sizes(self) -> tuple[Any, Any, Any]:
        """kernel_size, stride and padding as the layer passes them to the op, each square pair as its
        int: the op checks the two alike, and keys an int without building a key of the pair's types
        (registry.option_key: about 0.04 µs against 0.25 µs on a CPU, three sizes at every call)."""
        self._sizes = (_square(self.kernel_size, 1), _square(self.stride, 1), _square(self.padding, 0))
        return self._sizes


class AvgPool2d(MaxPool2d):
    def forward(self, x: Any) -> Any:
        kernel, stride, padding = self._sizes or self._op_sizes()
        return avg_pool2d(x, kernel, stride, padding, layout=self.layout, path=self.path)


def _square(size: Any, minimum: int) -> Any:
    """`size` as its one int where it is a tuple of two equal ints (exactly int) >= minimum, which the op's
    checks take as that pair; anything else as it is, for the op's checks to refuse or take as before."""
    if type(size) is tuple and len(size) == 2 and type(size[0]) is int and type(size[1]) is int:
        if size[0] == size[1] >= minimum:
            return size[0]
    return size
