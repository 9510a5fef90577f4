"""The activations libnn fuses into epilogues, in the array arithmetic of NumPy or CuPy.

These are the definitions every path is tested against. GELU is the tanh approximation everywhere
in libnn (cuBLASLt's epilogue offers no other); NaN propagates through every activation.
"""

from __future__ import annotations

import math

from libnn.runtime.arrays import array_module

ACTIVATIONS = (None, "relu", "relu6", "gelu", "silu")
# The integer each kernel's `act` argument takes (kernels/*.cu share the numbering).
KERNEL_CODES = {None: 0, "relu": 1, "relu6": 2, "gelu": 3, "silu": 4}


def apply(v, activation: str | None):
    xp = array_module(v)
    if activation == "relu":
        return xp.where(v < 0, 0, v)  # where(), not maximum(): keep NaN as NaN
    if activation == "relu6":
        return xp.where(v < 0, 0, xp.where(v > 6, 6, v))
    if activation == "gelu":
        return 0.5 * v * (1 + xp.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    if activation == "silu":
        return v / (1 + xp.exp(-v))
    return v


def check(op: str, activation: str | None, supported: tuple = ACTIVATIONS) -> None:
    if activation not in supported:
        raise ValueError(f"{op}: activation must be one of {supported}, got {activation!r}")
