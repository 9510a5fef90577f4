"""Library handles, one per (device, stream), created on first use and kept for the process.

A handle is bound to a stream (cuDNN) or used with one (cuBLASLt), and libraries are not safe when
one handle serves two streams at once, so the stream is part of the key.
"""

from __future__ import annotations

from libnn.runtime.cache import PlanCache
from libnn.runtime.device import current_device_id
from libnn.runtime.stream import current_stream

_cublaslt: PlanCache = PlanCache("cublaslt handles")
_cudnn: PlanCache = PlanCache("cudnn handles")


def cublaslt_handle() -> int:
    """The cublasLtHandle_t for the current device and stream."""
    from nvmath.bindings import cublasLt

    return _cublaslt.get((current_device_id(), current_stream().ptr), cublasLt.create)


def cudnn_handle():
    """The cuDNN handle for the current device and stream (cuDNN frontend's handle object)."""
    import cudnn

    stream = current_stream()

    def build():
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=stream.ptr)
        return handle

    return _cudnn.get((current_device_id(), stream.ptr), build)


_workspaces: dict[tuple[int, int], object] = {}


def workspace(nbytes: int, device_id: int | None = None, stream_ptr: int | None = None):
    """A scratch buffer of at least `nbytes` for the device and stream (default: the current ones),
    shared by every plan that runs there: work on one stream is ordered, so plans never use it at
    the same time. It grows to the largest request and is never shrunk."""
    import cupy

    key = (current_device_id() if device_id is None else device_id,
           current_stream().ptr if stream_ptr is None else stream_ptr)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _workspaces[key] = cupy.empty(max(nbytes, 256), cupy.uint8)
    return buffer
