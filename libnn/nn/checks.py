"""Checks of the arguments layers are built and called with, shared by every layer.

A bad size, eps, layout, dtype or device is refused when the layer is built, naming the layer and
the argument, rather than surfacing as a math domain error during initialisation, an op's message at
the first forward, or a result silently rounded to an integer dtype. Parameters that would not fit in
memory are refused before they are drawn.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from libnn import dtypes
from libnn.ops.spatial import is_int, pair as op_pair
from libnn.registry import get_op, ops as known_ops
from libnn.runtime import device as runtime_device
from libnn.runtime import memory
from libnn.runtime.arrays import as_array, describe, is_cupy

DEVICES = ("cpu", "gpu", "cuda")  # what Module.to() takes; "cuda" is "gpu"
FLOAT_DTYPES = "fp16, bf16, fp32 or fp64"


def _at_least(minimum: int) -> str:
    return {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")


def size(layer: str, name: str, value: Any, minimum: int | None = 1) -> int:
    """An int (a NumPy integer too) >= minimum, if there is one."""
    if not is_int(value):
        raise TypeError(f"{layer}: {name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{layer}: {name} must be {_at_least(minimum)}, got {value}")
    return int(value)


def pair(layer: str, name: str, value: Any, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints, each >= minimum, as a pair: conv2d's and pool2d's check,
    its one ValueError (a value below the minimum) worded as the layer's other sizes are."""
    try:
        return op_pair(layer, name, value, minimum)
    except ValueError:
        raise ValueError(f"{layer}: {name} must be {_at_least(minimum)} or a pair of them, got {value!r}") from None


def positive_float(layer: str, name: str, value: Any) -> float:
    """A finite real number > 0 (eps)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{layer}: {name} must be a real number, got {type(value).__name__} {value!r}")
    if not value > 0:  # NaN included
        raise ValueError(f"{layer}: {name} must be > 0, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{layer}: {name} must be finite, got {value!r}")
    return float(value)


def probability(layer: str, name: str, value: Any) -> float:
    """A real number in [0, 1] (a dropout rate)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{layer}: {name} must be a real number, got {type(value).__name__} {value!r}")
    if not 0 <= value <= 1:  # NaN included
        raise ValueError(f"{layer}: {name} must be a probability in [0, 1], got {value!r}")
    return float(value)


def flag(layer: str, name: str, value: Any) -> bool:
    """True or False, nothing merely truthy ("no" would mean yes)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{layer}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def choice(layer: str, name: str, value: Any, options: Sequence[Any]) -> Any:
    """One of `options` (strings, or None)."""
    if not (value is None or isinstance(value, str)) or value not in options:
        raise ValueError(f"{layer}: {name} must be one of {tuple(options)}, got {value!r}")
    return value


def path(layer: str, value: Any, ops: Sequence[str], per_op: bool = False) -> Any:
    """"auto" or the name of a path of one of `ops` (the ops the layer calls), checked when the layer
    is built rather than at its first forward (a typo); with `per_op`, also a dict naming a path per op
    (any op: a layer hands the dict on to layers that call other ops)."""
    if per_op and isinstance(value, dict):
        if unknown := sorted(set(value) - set(known_ops()), key=str):
            raise ValueError(f"{layer}: path names unknown ops {unknown}; the ops are {known_ops()}")
        for op, name in value.items():
            _path_name(f"{layer}: path[{op!r}]", name, (op,))
        return value
    return _path_name(f"{layer}: path", value, ops)


def _path_name(what: str, value: Any, ops: Sequence[str]) -> str:
    names = ["auto"] + sorted({name for op in ops for name in get_op(op).paths})
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{what} must be one of {names}, got {value!r}")
    return value


def seed(layer: str, value: Any) -> int | None:
    return None if value is None else size(layer, "seed", value, minimum=0)


def float_dtype(layer: str, value: Any) -> np.dtype:
    """The parameters' dtype: a floating-point one (integer parameters would round every result)."""
    if value is None:  # NumPy would read None as float64
        raise TypeError(f"{layer}: dtype must be {FLOAT_DTYPES}, got None")
    try:
        dtype = dtypes.parse(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{layer}: dtype {value!r}: {exc}") from None
    if not dtypes.is_float(dtype):
        raise TypeError(f"{layer}: dtype must be {FLOAT_DTYPES}, got {dtype}")
    return dtype


def device(layer: str, value: Any) -> str:
    """"cpu", or "gpu"/"cuda" where there is a GPU."""
    choice(layer, "device", value, DEVICES)
    if value != "cpu":
        if reason := runtime_device.gpu_missing():  # looked up per call: tests stand in for it
            raise ValueError(f"{layer}: device={value!r} needs a GPU, and there is none here ({reason}); "
                             "use device='cpu'")
    return value


def parameters_fit(layer: str, argument: str, elements: int, dtype: np.dtype, device: str) -> None:
    """Refuse parameters of `elements` values in all that would not fit, before they are drawn. The
    initialisers draw in float64 on the host and then cast (and copy to the GPU), so the host needs
    both copies at once."""
    memory.require(elements * (8 + dtype.itemsize), "cpu", layer, argument)
    if device != "cpu":
        memory.require(elements * dtype.itemsize, "gpu", layer, argument)


def float_input(layer: str, x: Any, like: Any = None, name: str = "x") -> Any:
    """`x` (the argument `name`) as an array of a floating-point dtype (an integer one would have the
    result rounded back to it), on the device of the parameter `like` when there is one."""
    x = as_array(x, layer, name)
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"{layer}: {name} must be a floating-point array ({FLOAT_DTYPES}), got dtype {x.dtype}; "
                        f"convert it first ({name}.astype(...))")
    if like is not None and is_cupy(x) != is_cupy(like):
        raise TypeError(f"{layer}: {name} is {describe(x)} but the layer's parameters are {describe(like)}; "
                        f"move {name} (cupy.asarray / cupy.asnumpy) or the layer (.to('gpu') / .to('cpu'))")
    return x
