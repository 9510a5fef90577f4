"""Arrays in, arrays out: NumPy for the reference path, CuPy for GPU paths, and anything that speaks
DLPack or ``__cuda_array_interface__`` (torch tensors, JAX arrays...) taken without a copy."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from libnn.errors import LibnnError, LibraryError
from libnn.runtime.cache import PlanCache
from libnn.runtime.device import gpu_missing
from libnn.runtime.stream import capturing


_CUPY_TYPES: set[type] = set()  # the cupy array types seen so far: later checks are one set lookup


def is_cupy(a: Any) -> bool:
    kind = type(a)
    if kind in _CUPY_TYPES:
        return True
    if kind.__module__.startswith("cupy") and hasattr(a, "device"):
        _CUPY_TYPES.add(kind)
        return True
    return False


def data_pointer(a: Any) -> int:
    """The address of a CuPy or NumPy array's first element (NumPy: the kernel binds' tests on the CPU)."""
    return a.data.ptr if is_cupy(a) else a.__array_interface__["data"][0]


def refuse_misaligned(needs: str, arrays: dict[str, Any]) -> None:
    """LibraryError "<needs>; <names> is (are) not" unless every array given (None: skipped) starts on 16
    bytes, for a library or kernel whose 16-byte loads or descriptors need it."""
    misaligned = [name for name, a in arrays.items() if a is not None and data_pointer(a) % 16]
    if misaligned:
        raise LibraryError(f"{needs}; {', '.join(misaligned)} {'is' if len(misaligned) == 1 else 'are'} not")


def _dlpack_on_cuda(a: Any) -> bool | None:
    """True/False if `a` reports its DLPack device, None if it speaks no DLPack."""
    device = getattr(a, "__dlpack_device__", None)
    if device is None:
        return None
    kind, _ = device()
    return int(kind) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def as_array(a: Any, op: str, arg: str):
    """`a` as a numpy.ndarray or cupy.ndarray, sharing memory with it whenever possible."""
    if type(a) in _CUPY_TYPES or isinstance(a, np.ndarray) or is_cupy(a):
        return a
    if hasattr(a, "__cuda_array_interface__") or _dlpack_on_cuda(a):
        import cupy
        if hasattr(a, "__dlpack__"):
            return cupy.from_dlpack(a)
        return cupy.asarray(a)
    if _dlpack_on_cuda(a) is False:
        return np.from_dlpack(a)
    if isinstance(a, np.generic):
        return np.asarray(a)
    raise TypeError(f"{op}: {arg} must be an array (numpy.ndarray, cupy.ndarray, or anything with DLPack / "
                    f"__cuda_array_interface__), got {type(a).__module__}.{type(a).__name__}")


def allocator(shape: Sequence[int], dtype: Any) -> Callable[[], Any]:
    """A maker of uninitialised CuPy arrays of one shape and dtype on the current device, for a bound
    call's outputs: `cupy.ndarray(shape, dtype, memptr)` with the bytes counted once and taken from the
    current allocator (`cupy.cuda.alloc`: CuPy's pool, 256-byte aligned, as `cupy.empty`'s are). Passing
    the memory costs less per call than `cupy.empty` or `cupy.ndarray(shape, dtype)`, which take the
    same memory (`libnn bench overhead`, "floors"; benchmarks/RESULTS.md)."""
    import cupy

    new, alloc = cupy.ndarray, cupy.cuda.alloc
    shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return lambda: new(shape, dtype, alloc(nbytes))


def describe(a: Any) -> str:
    """A short phrase for error messages: 'a numpy.ndarray in host memory'."""
    where = f"on GPU {a.device.id}" if is_cupy(a) else "in host memory"
    return f"a {type(a).__module__.split('.')[0]}.{type(a).__name__} {where}"


def array_module(a: Any):
    if is_cupy(a):
        import cupy
        return cupy
    return np


def place(a: Any) -> str:
    """'cpu' or 'gpu:N'."""
    return f"gpu:{a.data.device_id}" if is_cupy(a) else "cpu"


def signature(a: Any) -> tuple | None:
    """What an op's checks and plans may depend on, for a bound call's key (None for a missing
    argument): for a CuPy array its shape, strides, dtype, device and the low 8 bits of its pointer
    (libraries choose kernels by operand alignment, up to 256 bytes); for a host array its type,
    shape, strides and dtype."""
    if type(a) in _CUPY_TYPES:  # first: the per-call case of every GPU op
        data = a.data
        return a.shape, a.strides, a.dtype, data.device_id, data.ptr & 255
    if a is None:
        return None
    return type(a), a.shape, a.strides, a.dtype


PER_THREAD_STREAM = 2  # cudaStreamPerThread: one handle that is a different stream in every thread


_current_stream = None  # cupy.cuda.get_current_stream, once CuPy is loaded and a GPU is known to be there


def stream_key() -> int | tuple[int, int]:
    """The current CuPy stream's handle (0 where there is no GPU, or CuPy is not loaded: CuPy can be
    installed on a machine without a driver, where asking for a stream raises): plans, handles and
    workspaces are per stream, so a bound call is too. The per-thread default stream
    (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) has one handle for a different stream in each thread, so
    there the thread is part of the key. Every op's call asks, so once the answer is "a GPU" (which
    stays true: CuPy stays loaded, and `gpu_missing` is computed once) the stream getter is kept."""
    global _current_stream
    get = _current_stream
    if get is None:
        cupy = sys.modules.get("cupy")
        if cupy is None or gpu_missing():
            return 0
        get = _current_stream = cupy.cuda.get_current_stream
    ptr = get().ptr
    return (ptr, threading.get_ident()) if ptr == PER_THREAD_STREAM else ptr


def device_of(arrays: dict[str, Any], op: str) -> str:
    """'cpu' or 'gpu:N' for a set of named arrays (None entries skipped); all must agree."""
    places = {name: place(a) for name, a in arrays.items() if a is not None}
    first = next(iter(places.values()))
    if any(p != first for p in places.values()):
        listing = ", ".join(f"{n} on {p}" for n, p in places.items())
        raise LibnnError(f"{op}: all arrays must be on one device, got {listing}")
    return first


def contiguous(a: Any):
    """A C-contiguous array with `a`'s values: `a` itself when it already is one."""
    if a.flags.c_contiguous:
        return a
    return array_module(a).ascontiguousarray(a)


def contiguous_arrays(*arrays: Any) -> tuple[Any, ...]:
    """Each of `arrays` C-contiguous (a copy where it is not), None where absent: what a bind packs for."""
    return tuple(None if a is None else contiguous(a) for a in arrays)


def copying_strided(run: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """`run`, a runner of C-contiguous arrays that reads only their pointers (layer_norm's, rms_norm's,
    softmax's, pool2d's), for the signature of the arrays `bound` (None: absent): `run` itself where every one is
    C-contiguous, so a cached call adds nothing to it; else a runner that passes C-contiguous copies (one
    more pass over each strided array). Arguments after the bound arrays (a prefetch hint) pass as they are."""
    if all(a is None or a.flags.c_contiguous for a in bound):
        return run
    count = len(bound)

    def copying(*arrays):
        return run(*contiguous_arrays(*arrays[:count]), *arrays[count:])
    return copying


def min_max(arrays: list[Any]) -> list[tuple[int, int]] | None:
    """(min, max) of each non-empty array, read to the host with one synchronisation for all of them;
    None while a CUDA graph is prepared or captured (no GPU value can be read then: the caller skips
    its check, which the graph's checked first pass has run)."""
    if not arrays:
        return []
    xp = array_module(arrays[0])
    if xp is not np and capturing():
        return None
    flat = xp.stack([v for a in arrays for v in (a.min(), a.max())]).tolist()
    return [(int(lo), int(hi)) for lo, hi in zip(flat[::2], flat[1::2])]


_constants = None  # PlanCache of device_constant's arrays, created on first use


def device_constant(n: int, value: float, dtype: Any) -> Any:
    """A length-n CuPy array of `value` on the current device, made once per (n, value, dtype, device)
    and synchronised, so that a library reading it from any stream sees it filled: what cuDNN gets for
    an input the caller left out (unit scales, zero shifts, full sequence lengths)."""
    import cupy

    global _constants
    if _constants is None:
        _constants = PlanCache("device constants")

    def build():
        filled = cupy.asarray(np.full(n, value, dtype))  # through NumPy: bf16 (ml_dtypes) included
        cupy.cuda.get_current_stream().synchronize()
        return filled

    return _constants.get((n, value, np.dtype(dtype), cupy.cuda.runtime.getDevice()), build)
