"""What the 2-D image ops (conv2d, pool2d) share: the layouts they take and the checks of their (h, w)
arguments. A module of its own so that neither op imports the other."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

LAYOUTS = ("NHWC", "NCHW")


def is_int(value: Any) -> bool:
    """An int or a NumPy integer; not a bool (stride=True is a slip, not 1), a float or an array."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def pair(op_name: str, name: str, value: int | Sequence[int], minimum: int) -> tuple[int, int]:
    """An int or a pair (tuple or list) of ints, each >= minimum, as a pair: a TypeError for a float,
    None, a string or an array, a ValueError for a value below the minimum."""
    both = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(both) != 2 or not all(is_int(v) for v in both):
        raise TypeError(f"{op_name}: {name} must be an int or a pair of ints, got {type(value).__name__} {value!r}")
    if min(both) < minimum:
        raise ValueError(f"{op_name}: {name} must be an int or a pair of ints >= {minimum}, got {value!r}")
    return int(both[0]), int(both[1])


def nhwc_strides(layout: str, C: int, H: int, W: int) -> tuple[int, int, int, int]:
    """Element strides of a contiguous tensor in (n, h, w, c) order, whichever its layout."""
    return (H * W * C, W * C, C, 1) if layout == "NHWC" else (C * H * W, W, 1, H * W)
