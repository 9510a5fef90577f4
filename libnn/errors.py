"""Exceptions and warnings that libnn raises.

Every message names the op, the argument, what was expected and what came, so that a user can fix
the call without reading libnn's source.
"""


class LibnnError(Exception):
    """Base class of libnn's own errors."""


class PathUnavailableError(LibnnError):
    """A path was forced (``path="..."``) but cannot run here: no GPU, a library missing, or the
    problem (dtype, shape, options) is outside what the path supports."""


class NoPathError(LibnnError):
    """``path="auto"`` found no path that can compute this problem on these arrays."""


class LibraryError(LibnnError):
    """A vendor library (cuBLASLt, cuDNN, cuFFT, NVRTC) refused or failed; the message carries the
    library's own words."""


class KernelCompileError(LibnnError):
    """NVRTC could not compile a file of ``kernels/``; the message carries the file, line and log."""


class FallbackWarning(UserWarning):
    """Under ``path="auto"`` a path failed and libnn ran the next one; the message says why."""
