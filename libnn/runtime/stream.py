"""The stream every libnn path launches on.

libnn does not keep a stream of its own: it uses CuPy's current stream, so `with libnn.stream(s):`
also covers CuPy work the user does in between, and a CuPy `with s:` block is honoured by libnn.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


def as_cupy_stream(s: Any):
    """A cupy Stream from a cupy Stream, a torch.cuda.Stream, or a raw cudaStream_t (int)."""
    import cupy

    if isinstance(s, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return s
    if hasattr(s, "cuda_stream"):  # torch.cuda.Stream
        return cupy.cuda.ExternalStream(int(s.cuda_stream))
    if isinstance(s, int):
        return cupy.cuda.ExternalStream(s)
    raise TypeError(f"libnn.stream: expected a cupy.cuda.Stream, torch.cuda.Stream or an int cudaStream_t, "
                    f"got {type(s).__name__}")


@contextlib.contextmanager
def stream(s: Any) -> Iterator[Any]:
    """Run every libnn (and CuPy) launch inside the block on stream `s`."""
    cupy_stream = as_cupy_stream(s)
    with cupy_stream:
        yield cupy_stream


def current_stream():
    import cupy
    return cupy.cuda.get_current_stream()


_graph_mode = threading.local()


@contextlib.contextmanager
def graph_mode() -> Iterator[None]:
    """Mark the passes that prepare and capture a CUDA graph (libnn.nn.graphs): `capturing()` is true
    in them, so the warm-up passes take exactly the code paths the capture will take."""
    depth = getattr(_graph_mode, "depth", 0)
    _graph_mode.depth = depth + 1
    try:
        yield
    finally:
        _graph_mode.depth = depth


def capturing() -> bool:
    """True while a CUDA graph is being prepared or captured on this thread (or the current stream is
    capturing). Host synchronisations (a check that reads a GPU value) are illegal in a capture, so
    ops skip them and choose forms that need none."""
    return bool(getattr(_graph_mode, "depth", 0)) or stream_capturing()


def stream_capturing() -> bool:
    """True while the current stream captures a CUDA graph (the legacy null stream never does): work
    queued now is recorded, not run."""
    stream = current_stream()
    return stream.ptr != 0 and stream.is_capturing()
