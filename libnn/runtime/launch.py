"""Kernel launches with their arguments packed once, for bound calls.

A bound call knows everything about its launches but the arrays' pointers: the kernel, the grid, the
block, the shared memory, the stream and every scalar argument. `bind(...)` packs all of it once; each
launch then writes the pointers into their slots and issues the launch with arguments built once and
the address of the packed argument array:
- a plain launch calls `cuLaunchKernel` through CuPy's own driver binding
  (`cupy_backends.cuda.api.driver.launchKernel`, whose typed C parameters convert its eleven integers
  at C speed);
- a programmatic one (below) calls `cuLaunchKernelEx` through cuda-bindings, with its configuration
  built once, since CuPy has no binding of it.
Both cost less per launch than CuPy's `RawKernel.__call__`, which converts every argument again on
every launch, and the plain one less than cuda-bindings' `cuLaunchKernelEx` (`libnn bench overhead`,
"floors"; benchmarks/RESULTS.md).

Argument slots are 8 bytes each; the driver copies each parameter's own size from its slot (4 bytes for
an int32 or float32, stored in the slot's low bytes on a little-endian host) when the launch is issued,
so the slots may be rewritten as soon as the launch returns. A lock keeps two threads launching
through one bound call (the same stream) from mixing their pointers.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np

from libnn.errors import LibraryError
from libnn.runtime import kernels
from libnn.runtime.device import compute_capability, gpu_index
from libnn.runtime.stream import current_stream

MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents (x's is 2**31 - 1)
GRID_STRIDE_BLOCKS = MAX_GRID_YZ  # a grid-stride kernel's blocks along any dimension: enough to fill any GPU
GRID_STRIDE_BLOCKS_X = 8 * MAX_GRID_YZ  # the same along x, for kernels with many small blocks (x's limit is far higher)

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: a thread CuPy has made no context current in

ARRAY = object()  # an argument that is an array: its device pointer is written at each launch (None: null)


class Launch:
    """One kernel with fixed geometry and scalars; `launch(*arrays)` passes the arrays' pointers in the
    order of the ARRAY placeholders."""

    __slots__ = ("_launch", "_args", "_slots", "_pointers", "_array_slots", "_lock", "_device", "name")

    def __init__(self, function: Any, name: str, grid: Sequence[int], block: Sequence[int], shared_mem: int,
                 stream_ptr: int, args: Sequence[Any], programmatic: bool = False):
        import cupy

        self.name = name
        self._device = cupy.cuda.runtime.getDevice()  # the device `function` is loaded on
        self._slots = np.zeros(len(args), np.uint64)
        self._array_slots = [i for i, a in enumerate(args) if a is ARRAY]
        for i, a in enumerate(args):
            if a is not ARRAY:
                self._slots[i:i + 1].view(np.asarray(a).dtype)[0] = a  # the value in the slot's low bytes
        self._pointers = np.array([self._slots.ctypes.data + 8 * i for i in range(len(args))], np.uint64)
        # the packed argument array's address is read once (.ctypes costs microseconds per access); only
        # the slots behind it change between launches
        params = int(self._pointers.ctypes.data)
        if programmatic:
            from cuda.bindings import driver

            self._launch = _launch_ex()
            self._args = (_launch_config(grid, block, shared_mem, stream_ptr, programmatic),
                          driver.CUfunction(function.kernel.ptr), params, 0)
        else:
            from cupy_backends.cuda.api import driver as cupy_driver

            self._launch = cupy_driver.launchKernel
            self._args = (function.kernel.ptr, *_dim3(grid), *_dim3(block), shared_mem, stream_ptr, params, 0)
        self._lock = threading.Lock()

    def __call__(self, *arrays: Any) -> None:
        slots = self._slots
        with self._lock:
            for i, a in zip(self._array_slots, arrays):
                slots[i] = 0 if a is None else a.data.ptr
            try:
                self._launch(*self._args)
            except _driver_error() as exc:
                self._relaunch(exc)

    def _relaunch(self, failure: Exception) -> None:
        """After a failed launch: a thread whose CUDA context CuPy has not made current yet (the driver
        API's launch sees none until the runtime API, CuPy, makes the device's primary context current,
        which CuPy does lazily) gets it and launches again; any other failure is raised, named."""
        if getattr(failure, "status", None) == _INVALID_CONTEXT:
            import cupy

            cupy.cuda.runtime.setDevice(self._device)
            cupy.cuda.runtime.free(0)  # setDevice alone defers making the primary context current
            try:
                self._launch(*self._args)
                return
            except _driver_error() as exc:
                failure = exc
        raise LibraryError(f"launching {self.name} failed: {failure}") from failure


def _driver_error() -> type:
    """CuPy's driver error, which both launch entry points raise."""
    from cupy_backends.cuda.api.driver import CUDADriverError

    return CUDADriverError


@functools.cache
def _launch_ex() -> Callable[..., None]:
    """cuLaunchKernelEx through cuda-bindings, raising CuPy's driver error as the plain launch does
    (cuda-bindings returns its error instead)."""
    from cuda.bindings import driver

    launch_ex, success = driver.cuLaunchKernelEx, driver.CUresult.CUDA_SUCCESS

    def launch(config: Any, function: Any, params: int, extra: int) -> None:
        (err,) = launch_ex(config, function, params, extra)
        if err is not success:
            raise _driver_error()(int(err))
    return launch


def _dim3(dims: Sequence[int]) -> tuple[int, int, int]:
    """A grid or block padded to three dimensions with 1s."""
    return (*dims, *(1,) * (3 - len(dims)))


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


def programmatic_supported(device: str) -> bool:
    """Whether kernels on `device` ("gpu:N") may be launched with programmatic stream serialization (sm_90
    and newer; griddepcontrol is a no-op below, where a launch with the attribute would be refused)."""
    return compute_capability(gpu_index(device)) >= (9, 0)


def _launch_config(grid: Sequence[int], block: Sequence[int], shared_mem: int, stream_ptr: int,
                   programmatic: bool) -> Any:
    """cuLaunchKernelEx's configuration (grid and block padded to three dimensions with 1s), with the
    programmatic stream serialization attribute where `programmatic`."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
    config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
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
