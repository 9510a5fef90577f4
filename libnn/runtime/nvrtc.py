"""NVRTC through cuda-bindings: the bindings themselves, their error check, and what the compiler
reports about itself (its version, the archs it targets).

Apart from the kernel loader (`runtime.kernels`) because `runtime.device` reports NVRTC's version
among the libraries it lists, and the loader asks `runtime.device` for the current device: with both
halves in one module the two imported each other.
"""

from __future__ import annotations

from libnn.errors import KernelCompileError


def bindings():
    """cuda.bindings.nvrtc, or a KernelCompileError saying what to install."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KernelCompileError(
            "compiling kernels needs NVRTC through cuda-bindings: install libnn[cu12] or libnn[cu13] "
            f"(or libnn[test]); import failed: {exc}") from exc
    return nvrtc


def check(result, what: str) -> None:
    """Raise a KernelCompileError naming `what` if an NVRTC call returned anything but success."""
    nvrtc = bindings()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(result)
        raise KernelCompileError(f"NVRTC {what} failed: {text.decode()}")


def nvrtc_version() -> str:
    err, major, minor = bindings().nvrtcVersion()
    check(err, "version query")
    return f"{major}.{minor}"


def supported_archs() -> list[int]:
    """The sm_XX numbers this NVRTC can compile for."""
    nvrtc = bindings()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    check(err, "supported-arch query")
    return list(archs)
