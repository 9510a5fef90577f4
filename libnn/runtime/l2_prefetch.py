"""The L2 prefetch hint of the decode GEMVs (`prefetch=` of linear, linear_fp8 and rms_norm_linear).

At batch 1 a decode step is a chain of GEMVs, each streaming its weight once; between two of them DRAM idles
while one kernel drains and the next starts (and through attention, between the QKV and output projections).
A GEMV told what the next one reads first prefetches up to L2_PREFETCH_BYTES of it into L2 behind its own
first loads (kernels/common.cuh l2_prefetch_hint), so that the next kernel's first reads hit L2: the 16-layer
1.1B LLaMA's GEMV chain went from 76% to 86% of the copy rate (benchmarks/RESULTS.md, sixteenth session).
The decoders no longer give it: since the later launch changes their batch-1 steps run 1.9% faster without
(LLaMA; GPT-2 unchanged: RESULTS.md, eighteenth session). It stays an op option for chains where it pays.

The hint is None, an array, or a tuple of up to MAX_RANGES arrays: each a C-contiguous CuPy array on the op's
device that no kernel in flight writes (a weight), since the prefetch may run while the kernel ahead is
still running. A GEMV reads its weight's first rows first, so a weight is hinted whole; a stacked gate_up
weight, whose GEMV reads rows f and F + f together, as its two halves. The budget is split evenly over the
arrays, each share capped at the array's size, what one leaves going to the next (the kernel narrows each
range to whole 16-byte units). It changes no result: paths without the prefetch ignore it, and nothing is
prefetched below sm_90 (the bulk prefetch is a Hopper instruction).
"""

from __future__ import annotations

from typing import Any, Callable

from libnn.runtime import contracts, launch
from libnn.runtime.arrays import is_cupy
from libnn.runtime.device import compute_capability, gpu_index

MAX_RANGES = 2  # the byte ranges a GEMV kernel prefetches (its prefetch0 and prefetch1 parameters)


def budget() -> int:
    """The bytes a GEMV prefetches for the next kernel (kernels/common.cuh L2_PREFETCH_BYTES)."""
    return contracts.constants("common.cuh")["L2_PREFETCH_BYTES"]


def hinted_arrays(where: str, prefetch: Any) -> tuple:
    """The hint as a tuple of arrays (empty for None), after checking its type and length: a TypeError or
    ValueError naming `where` and the argument."""
    if prefetch is None:
        return ()
    arrays = tuple(prefetch) if isinstance(prefetch, (tuple, list)) else (prefetch,)
    if not 1 <= len(arrays) <= MAX_RANGES or not all(is_cupy(a) for a in arrays):
        raise TypeError(f"{where}: prefetch must be None, a CuPy array or a tuple of 1 to {MAX_RANGES} CuPy "
                        f"arrays (what the next kernel reads first), got {_described(prefetch)}")
    return arrays


def prefetch_bytes(where: str, arrays: tuple, device: str) -> tuple[int, ...]:
    """The bytes of each hinted array to prefetch for an op on `device` ("gpu:N"; 0 below sm_90), after
    checking that each is on that device and C-contiguous."""
    for i, a in enumerate(arrays):
        name = f"prefetch[{i}]" if len(arrays) > 1 else "prefetch"
        if not device.startswith("gpu:") or a.device.id != gpu_index(device):
            raise ValueError(f"{where}: {name} is on gpu:{a.device.id} but the op runs on {device}; a prefetch "
                             f"hint is an array on the op's GPU")
        if not a.flags.c_contiguous:
            raise ValueError(f"{where}: {name} must be C-contiguous (a weight, or one half of a stacked weight), "
                             f"got shape {tuple(a.shape)} with strides {a.strides}")
    if not arrays:
        return ()
    left = budget() if compute_capability(gpu_index(device)) >= (9, 0) else 0
    shares = []
    for i, a in enumerate(arrays):
        shares.append(min(left // (len(arrays) - i), a.nbytes))
        left -= shares[-1]
    return tuple(shares)


def kernel_parameters(nbytes: tuple[int, ...]) -> dict[str, Any]:
    """A GEMV kernel's prefetch parameters for contracts' pack(), `nbytes` from prefetch_bytes: an array slot
    (launch.ARRAY) and its byte count for each hinted array, null and 0 for the rest. The launch then takes
    the hinted arrays after the kernel's own (none without a hint: the launch is what it was)."""
    parameters: dict[str, Any] = {}
    for i in range(MAX_RANGES):
        hinted = i < len(nbytes)
        parameters[f"prefetch{i}"] = launch.ARRAY if hinted else None
        parameters[f"prefetch{i}_bytes"] = nbytes[i] if hinted else 0
    return parameters


def ignoring_hint(runner: Callable[..., Any], nbytes: tuple[int, ...]) -> Callable[..., Any]:
    """The runner of a path without the prefetch for a problem whose hint has `nbytes` (prefetch_bytes): the
    runner itself where there is no hint, else one that drops the hint the call passes last."""
    if not nbytes:
        return runner
    return lambda *args: runner(*args[:-1])


def _described(prefetch: Any) -> str:
    if isinstance(prefetch, (tuple, list)):
        return f"a {type(prefetch).__name__} of {len(prefetch)}: ({', '.join(type(a).__name__ for a in prefetch)})"
    return type(prefetch).__name__
