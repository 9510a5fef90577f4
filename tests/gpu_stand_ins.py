"""Stand-ins for CuPy and the GPU in host-only tests of the GPU front ends (tests/test_cached_calls_host*.py,
tests/test_seed_cnn_host.py): host arrays that the front end takes for CuPy ones, allocations at CuPy's
alignment, and the patches under which libnn reports a GPU and a stream without one. Each test file's
fixture adds its own CuPy namespace and records the launches it needs."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from libnn.runtime import arrays, device, launch, memory

STREAM = types.SimpleNamespace(ptr=0x7F00)
# cupy.cuda: the current stream, and an allocator whose "memory" is the byte count (host_ndarray ignores it)
CUDA = types.SimpleNamespace(get_current_stream=lambda: STREAM, alloc=lambda nbytes: nbytes)


def host_ndarray(shape, dtype=np.float32, memptr=None) -> np.ndarray:
    """cupy.ndarray's stand-in for runtime.arrays.allocator's outputs (`memptr`, from CUDA.alloc, unused):
    an uninitialised host array."""
    return np.empty(shape, dtype)


class DeviceArray(np.ndarray):
    """A host array that the front end takes for a CuPy one (arrays.is_cupy: a type from a module named
    cupy*, with a device): `data` gives its pointer and device as CuPy's MemoryPointer does, `device` its
    device as CuPy's Device does. A subclass on another GPU sets `device_id`."""

    device_id = 0

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0], device_id=self.device_id)

    @property
    def device(self):
        return types.SimpleNamespace(id=self.device_id)


DeviceArray.__module__ = "cupy.stand_in"


def on_device(a: Any) -> DeviceArray:
    return np.asarray(a).view(DeviceArray)


def device_empty(shape, dtype=np.float32) -> DeviceArray:
    """An uninitialised device array at a 256-byte boundary, as CuPy's allocations are (the pointer's low
    8 bits are keyed: NumPy's own alignment would key each output apart)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + 256, np.uint8)
    start = -raw.ctypes.data % 256
    return on_device(raw[start:start + size].view(dtype).reshape(shape))


def report_a_gpu(monkeypatch) -> None:
    """libnn sees a GPU and CuPy's current stream, and refuses no allocation for its size; the stand-in
    arrays are taken for CuPy's from the first signature on."""
    monkeypatch.setattr(device, "gpu_missing", lambda: None)
    monkeypatch.setattr(launch, "compute_capability", lambda device_id: (9, 0))  # an H100's, for launch options
    monkeypatch.setattr(arrays, "gpu_missing", lambda: None)
    monkeypatch.setattr(arrays, "_current_stream", None)
    monkeypatch.setattr(memory, "require", lambda *args: None)
    assert arrays.is_cupy(on_device(np.empty(1)))
