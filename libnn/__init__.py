"""libnn: GPU inference layers on NVIDIA's libraries.

Every op has several paths computing the same function: library paths (cuBLASLt, cuDNN, cuFFT),
our own CUDA kernels (`custom`), and a float64 NumPy `reference`. `path="auto"` picks the fastest
path that supports the call; any path can be forced by name.
"""

# ops first: importing an op module registers the op (libnn.registry looks ops up, never imports them)
from libnn import ops  # isort: skip
from libnn import nn
from libnn.config import config
from libnn.errors import (FallbackWarning, KernelCompileError, LibnnError, LibraryError, NoPathError,
                          PathUnavailableError)
from libnn.registry import get_op, paths
from libnn.runtime.cache import cache_info, cache_keys
from libnn.runtime.device import has_gpu, info
from libnn.runtime.stream import stream

__version__ = "0.1.0"

__all__ = ["nn", "ops", "config", "paths", "get_op", "info", "has_gpu", "stream", "cache_info", "cache_keys",
           "LibnnError", "PathUnavailableError", "NoPathError", "LibraryError", "KernelCompileError",
           "FallbackWarning"]
