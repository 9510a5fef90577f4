"""The activations libnn fuses into epilogues, in the array arithmetic of NumPy or CuPy.

These are the definitions every path is tested against. "gelu" is the tanh approximation (the GELU
cuBLASLt's and cuDNN's epilogues compute); "gelu_erf" is the exact 0.5·v·(1 + erf(v/√2)) that
PyTorch's nn.GELU() and BERT use. NaN propagates through every activation.
"""

from __future__ import annotations

import math

import numpy as np

from libnn.runtime import contracts
from libnn.runtime.arrays import array_module

ACTIVATIONS = (None, "relu", "relu6", "gelu", "silu", "gelu_erf")
# The integer each kernel's `act` argument takes: kernels/common.cuh's ACT_NONE, ACT_RELU, ...
KERNEL_CODES = {a: contracts.constant("common.cuh", f"ACT_{(a or 'none').upper()}") for a in ACTIVATIONS}


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
    if activation == "gelu_erf":
        return 0.5 * v * (1 + _erf(v / math.sqrt(2)))
    return v


def _erf(v):
    """erf elementwise: CuPy's for device arrays; for NumPy (which has none) math.erf per element."""
    xp = array_module(v)
    if xp is not np:
        import cupyx.scipy.special
        return cupyx.scipy.special.erf(v)
    return np.vectorize(math.erf, otypes=[np.float64])(v).astype(v.dtype, copy=False) if v.size else v


def check(op: str, activation: str | None, supported: tuple = ACTIVATIONS) -> None:
    if activation not in supported:
        raise ValueError(f"{op}: activation must be one of {supported}, got {activation!r}")
