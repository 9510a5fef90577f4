"""Kernel launches with their arguments packed once, for bound calls.

A bound call knows everything about its launches but the arrays' pointers: the kernel, the grid, the
block, the shared memory, the stream and every scalar argument. `bind(...)` packs all of it once; each
launch then writes the pointers into their slots and calls `cuLaunchKernelEx` through cuda-bindings
with a configuration built once and the address of the packed argument array. CuPy's
`RawKernel.__call__` converts every argument again on every launch, several times the cost (`libnn bench
overhead`, "floors").

Argument slots are 8 bytes each; the driver copies each parameter's own size from its slot (4 bytes for
an int32 or float32, stored in the slot's low bytes on a little-endian host) when the launch is issued,
so the slots may be rewritten as soon as `cuLaunchKernelEx` returns. A lock keeps two threads launching
through one bound call (the same stream) from mixing their pointers.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from libnn.errors import LibraryError
from libnn.runtime import kernels
from libnn.runtime.stream import current_stream

ARRAY = object()  # an argument that is an array: its device pointer is written at each launch (None: null)


class Launch:
    """One kernel with fixed geometry and scalars; `launch(*arrays)` passes the arrays' pointers in the
    order of the ARRAY placeholders."""

    __slots__ = ("_launch", "_args", "_slots", "_pointers", "_array_slots", "_lock", "_success",
                 "_invalid_context", "_device", "name")

    def __init__(self, function: Any, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
                 stream_ptr: int, args: Sequence[Any], programmatic: bool = False):
        import cupy
        from cuda.bindings import driver

        self.name = name
        self._device = cupy.cuda.runtime.getDevice()  # the device `function` is loaded on
        self._launch = driver.cuLaunchKernelEx
        self._success = driver.CUresult.CUDA_SUCCESS
        self._invalid_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        self._slots = np.zeros(len(args), np.uint64)
        self._array_slots = [i for i, a in enumerate(args) if a is ARRAY]
        for i, a in enumerate(args):
            if a is not ARRAY:
                self._slots[i:i + 1].view(np.asarray(a).dtype)[0] = a  # the value in the slot's low bytes
        self._pointers = np.array([self._slots.ctypes.data + 8 * i for i in range(len(args))], np.uint64)
        # cuLaunchKernelEx's arguments, built once: the configuration (four arguments to convert per launch,
        # not cuLaunchKernel's eleven: 0.4-0.8 µs less per launch on the H100's host, benchmarks/RESULTS.md)
        # and the packed argument array's address, read once (.ctypes costs microseconds per access); only
        # the slots behind it change between launches
        self._args = (_launch_config(grid, block, shared_mem, stream_ptr, programmatic),
                      driver.CUfunction(function.kernel.ptr), self._pointers.ctypes.data, 0)
        self._lock = threading.Lock()

    def __call__(self, *arrays: Any) -> None:
        slots = self._slots
        with self._lock:
            for i, a in zip(self._array_slots, arrays):
                slots[i] = 0 if a is None else a.data.ptr
            (err,) = self._launch(*self._args)
            if err is self._invalid_context:  # a thread whose CUDA context CuPy has not made current yet
                self._make_context_current()
                (err,) = self._launch(*self._args)
        if err is not self._success:
            raise LibraryError(f"launching {self.name} failed: {err.name}")

    def _make_context_current(self) -> None:
        """A new thread has no current context for the driver API until the runtime API (CuPy) makes
        the device's primary context current in it, which CuPy does lazily: do it now."""
        import cupy

        cupy.cuda.runtime.setDevice(self._device)
        cupy.cuda.runtime.free(0)  # setDevice alone defers making the primary context current


def bind(file: str, kernel: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], *,
         shared_mem: int = 0, stream_ptr: int | None = None, programmatic: bool = False) -> Launch:
    """A packed launch of kernels/<file>'s `kernel` on the stream (default: the current one). `args`
    lists the kernel's parameters in order: ARRAY for each array (passed at launch), NumPy scalars
    (np.int32, np.int64, np.float32, np.uint64) for the rest. `programmatic`: launched with CUDA's
    programmatic stream serialization (sm_90 and newer), so that it may start while the kernel ahead of it
    finishes; the kernel must call pdl_wait (kernels/common.cuh) before touching that kernel's data."""
    function = kernels.function(file, kernel, shared_mem)
    return Launch(function, f"kernels/{file}:{kernel}", grid, block, shared_mem,
                  current_stream().ptr if stream_ptr is None else stream_ptr, args, programmatic)


def _launch_config(grid: Sequence[int], block: Sequence[int], shared_mem: int, stream_ptr: int,
                   programmatic: bool) -> Any:
    """cuLaunchKernelEx's configuration (grid and block padded to three dimensions with 1s), with the
    programmatic stream serialization attribute where `programmatic`."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = (*grid, *(1,) * (3 - len(grid)))
    config.blockDimX, config.blockDimY, config.blockDimZ = (*block, *(1,) * (3 - len(block)))
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream_ptr)
    config.numAttrs = 0
    if programmatic:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attribute]
        config.numAttrs = 1
    return config
