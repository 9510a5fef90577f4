"""Refusing an allocation that would not fit, before it is made.

NumPy asked for 400 GB raises its own MemoryError from deep inside a call (or, with overcommit, gets
pages the kernel kills the process for later); CuPy raises OutOfMemoryError after its pool has been
emptied. Both name neither libnn's function nor the argument that asked for too much. `require`
compares the bytes a call will allocate with what is available now, host RAM (/proc/meminfo's
MemAvailable) or free GPU memory (the driver's free bytes plus blocks CuPy's pool holds for reuse),
and raises a MemoryError that names both, and the function and argument to blame.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

import numpy as np

DEVICES = ("cpu", "gpu")


def array_bytes(shape: Iterable[int], dtype: Any) -> int:
    """The bytes of an array of `shape` and `dtype`, in Python integers (no overflow)."""
    return math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize


def host_available_bytes() -> int:
    """RAM available to a new allocation without swapping: MemAvailable from /proc/meminfo (Linux),
    else the free physical pages sysconf reports."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_available_bytes() -> int:
    """Free memory on the current GPU: the driver's free bytes plus what CuPy's pool keeps for reuse."""
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    return free + cupy.get_default_memory_pool().free_bytes()


def available_bytes(device: str) -> int:
    if device not in DEVICES:
        raise ValueError(f"available_bytes: device must be one of {DEVICES}, got {device!r}")
    return host_available_bytes() if device == "cpu" else gpu_available_bytes()


def format_bytes(n: int) -> str:
    """'1.5 GiB (1610612736 bytes)': readable, and exact for a reader comparing numbers."""
    size, unit = float(n), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, next_unit
    return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit} ({n} bytes)"


def require(nbytes: int, device: str, function: str, argument: str) -> None:
    """Raise MemoryError if `nbytes` more would not fit in `device` memory ("cpu" or "gpu") now,
    naming `function`, the `argument` responsible, the bytes needed and the bytes available."""
    available = available_bytes(device)
    if nbytes > available:
        where = "host RAM" if device == "cpu" else "free GPU memory"
        raise MemoryError(f"{function}: {argument} needs {format_bytes(nbytes)}, more than the "
                          f"{format_bytes(available)} of {where} available")
